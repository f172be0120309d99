"""The network guard: while doeks' cluster runs, no packet to a private range (and none from a pod) leaves by the
machine's default interface. One iptables chain in the mangle table's POSTROUTING (after routing and kube-proxy's
DNAT, before any SNAT, and a chain kube-proxy never writes to), whose DROP rules count what they stop.

The one exception is the machine's own resolver when it has a private address (a nameserver in /etc/resolv.conf
reached by the default interface): the host keeps its DNS on port 53. Pods never reach it: everything from the
cluster's range (every node's pods, the extra nodes' own addresses) is dropped first.

An extra node (a network namespace of its own, doeks.cluster.node) gets a chain of the same name in its own mangle
POSTROUTING before any of its processes starts: what leaves it by its eth0 must go to the cluster's range (the API
server, the other nodes and their pods, all on the bridge); anything else is dropped and counted there. Its only way
out is through the host anyway, where the host's chain stands too. `dropped()` counts both.
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


def _ipt(*args: str, check: bool = True, netns: str | None = None) -> subprocess.CompletedProcess:
    enter = [shutil.which("nsenter") or "/usr/bin/nsenter", f"--net=/run/netns/{netns}", "--"] if netns else []
    result = subprocess.run(enter + [iptables(), "-w", "5", "-t", TABLE, *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        where = f" in network namespace {netns}" if netns else ""
        raise DoeksError(f"iptables -t {TABLE} {' '.join(args)}{where} failed: {result.stderr.strip()}")
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
    out = [["-s", versions.CLUSTER_CIDR, "-o", interface, "-j", "DROP"]]
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


NODE_INTERFACE = "eth0"  # an extra node's end of its veth pair


def node_rules() -> list[list[str]]:
    """An extra node's chain: to the cluster's range by its eth0, nothing else."""
    return [["-o", NODE_INTERFACE, "-d", versions.CLUSTER_CIDR, "-j", "RETURN"],
            ["-o", NODE_INTERFACE, "-j", "DROP"]]


def install_node(netns: str) -> None:
    """The guard of an extra node, inside its network namespace (made fresh), before anything there starts."""
    if _ipt("-n", "-L", CHAIN, check=False, netns=netns).returncode == 0:
        _ipt("-F", CHAIN, netns=netns)
    else:
        _ipt("-N", CHAIN, netns=netns)
    for rule in node_rules():
        _ipt("-A", CHAIN, *rule, netns=netns)
    if _ipt("-C", HOOK, "-j", CHAIN, check=False, netns=netns).returncode != 0:
        _ipt("-I", HOOK, "1", "-j", CHAIN, netns=netns)


def node_namespaces() -> list[str]:
    """The extra nodes' network namespaces that exist now."""
    folder = Path("/run/netns")
    return sorted(p.name for p in folder.glob(f"{versions.NODE_NETNS_PREFIX}*")) if folder.is_dir() else []


def node_installed(netns: str) -> bool:
    return _ipt("-C", HOOK, "-j", CHAIN, check=False, netns=netns).returncode == 0


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
    """The chain with each rule's packet and byte counters (what a failed "nothing left the machine" check shows): the
    host's, then every extra node's under its network namespace's name."""
    parts = [_listing()]
    parts += [f"{netns}:\n{_listing(netns)}" for netns in node_namespaces()]
    return "\n".join(parts)


def _listing(netns: str | None = None) -> str:
    result = _ipt("-n", "-v", "-x", "-L", CHAIN, check=False, netns=netns)
    return result.stdout if result.returncode == 0 else result.stderr.strip()


def dropped() -> int:
    """Packets the guard's DROP rules have stopped since it was installed (0 when it is not installed: the listing is
    then iptables' error, which has no DROP line): the host's chain and every extra node's."""
    return _dropped() + sum(_dropped(netns) for netns in node_namespaces())


def _dropped(netns: str | None = None) -> int:
    total = 0
    for line in _listing(netns).splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[0].isdigit() and fields[2] == "DROP":
            total += int(fields[0])
    return total
