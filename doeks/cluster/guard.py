"""The network guard: while doeks' cluster runs, no packet to a private range (and none from a pod) leaves by the
machine's default interface. One iptables chain in the mangle table's POSTROUTING (after routing and kube-proxy's
DNAT, before any SNAT, and a chain kube-proxy never writes to), whose DROP rules count what they stop.

The one exception is the machine's own resolver when it has a private address (a nameserver in /etc/resolv.conf
reached by the default interface): the host keeps its DNS on port 53. Pods never reach it: everything from the pod
range is dropped first.
"""
from __future__ import annotations

import ipaddress
import re
import shutil
import subprocess
from pathlib import Path

from ..errors import DoeksError, MissingTool
from . import versions

CHAIN = "DOEKS-GUARD"
TABLE = "mangle"
HOOK = "POSTROUTING"
PRIVATE = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")


def iptables() -> str:
    found = shutil.which("iptables") or shutil.which("iptables", path="/usr/sbin:/sbin")
    if not found:
        raise MissingTool("iptables is not installed: apt-get install iptables (kube-proxy and doeks' guard need it)")
    return found


def _ipt(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([iptables(), "-w", "5", "-t", TABLE, *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise DoeksError(f"iptables -t {TABLE} {' '.join(args)} failed: {result.stderr.strip()}")
    return result


def default_interface() -> str:
    out = subprocess.run(["ip", "-4", "route", "show", "default"], capture_output=True, text=True).stdout
    found = re.search(r"\bdev (\S+)", out)
    if not found:
        raise DoeksError("this machine has no default route: doeks cannot tell which interface to guard")
    return found.group(1)


def resolvers(resolv_conf: Path = Path("/etc/resolv.conf")) -> list[str]:
    """The machine's private IPv4 nameservers (the host's own DNS, kept reachable on port 53)."""
    found = []
    try:
        text = resolv_conf.read_text()
    except OSError:
        return []
    for match in re.finditer(r"^\s*nameserver\s+(\S+)", text, flags=re.M):
        try:
            address = ipaddress.ip_address(match.group(1))
        except ValueError:
            continue
        if address.version == 4 and address.is_private and not address.is_loopback:
            found.append(str(address))
    return found


def rules(interface: str) -> list[list[str]]:
    """The chain's rules, in order."""
    out = [["-s", versions.POD_CIDR, "-o", interface, "-j", "DROP"]]
    for resolver in resolvers():
        for proto in ("udp", "tcp"):
            out.append(["-d", f"{resolver}/32", "-o", interface, "-p", proto, "--dport", "53", "-j", "RETURN"])
    out += [["-d", cidr, "-o", interface, "-j", "DROP"] for cidr in PRIVATE]
    return out


def installed() -> bool:
    return _ipt("-n", "-L", CHAIN, check=False).returncode == 0


def install() -> str:
    """Make the chain (again, fresh) and hook it first into POSTROUTING; returns the guarded interface."""
    interface = default_interface()
    if installed():
        _ipt("-F", CHAIN)
    else:
        _ipt("-N", CHAIN)
    for rule in rules(interface):
        _ipt("-A", CHAIN, *rule)
    if _ipt("-C", HOOK, "-j", CHAIN, check=False).returncode != 0:
        _ipt("-I", HOOK, "1", "-j", CHAIN)
    return interface


def remove() -> bool:
    """Unhook and delete the chain; True if it was there. Safe to call twice."""
    if shutil.which("iptables") is None and not Path("/usr/sbin/iptables").exists():
        return False
    while _ipt("-C", HOOK, "-j", CHAIN, check=False).returncode == 0:
        _ipt("-D", HOOK, "-j", CHAIN)
    if not installed():
        return False
    _ipt("-F", CHAIN)
    _ipt("-X", CHAIN)
    return True


def listing() -> str:
    """The chain with each rule's packet and byte counters (what a failed "nothing left the machine" check shows)."""
    result = _ipt("-n", "-v", "-x", "-L", CHAIN, check=False)
    return result.stdout if result.returncode == 0 else result.stderr.strip()


def dropped() -> int:
    """Packets the guard's DROP rules have stopped since it was installed (0 when it is not installed: the listing is
    then iptables' error, which has no DROP line)."""
    total = 0
    for line in listing().splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[0].isdigit() and fields[2] == "DROP":
            total += int(fields[0])
    return total
