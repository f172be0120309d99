"""The network guard, shown on hosts of the test's own: two network namespaces joined by a veth pair, the first with
its default route over the veth (its "default interface"). The guard is installed inside the first namespace with
doeks' own code; a packet to a private address, and one from the pod range, must be dropped there and counted,
and never reach the second namespace. No packet of this test leaves those namespaces.
"""
from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from .conftest import ROOT

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")

GUARD = """
import json, sys
from doeks.cluster import guard
if sys.argv[1] == "install":
    print(guard.install())
elif sys.argv[1] == "dropped":
    print(guard.dropped())
elif sys.argv[1] == "remove":
    print(guard.remove())
"""


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(argv)}: {result.stderr}")
    return result


@pytest.fixture
def hosts():
    tag = uuid.uuid4().hex[:6]
    inside, outside = f"dg-in-{tag}", f"dg-out-{tag}"
    sh("ip", "netns", "add", inside)
    sh("ip", "netns", "add", outside)
    try:
        sh("ip", "link", "add", f"vg{tag}a", "type", "veth", "peer", "name", f"vg{tag}b")
        sh("ip", "link", "set", f"vg{tag}a", "netns", inside)
        sh("ip", "link", "set", f"vg{tag}b", "netns", outside)
        for ns, dev, address in ((inside, f"vg{tag}a", "192.0.2.10/24"), (outside, f"vg{tag}b", "192.0.2.1/24")):
            sh("ip", "-n", ns, "addr", "add", address, "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", inside, "route", "add", "default", "via", "192.0.2.1")
        # the far side counts every packet that reaches it
        sh("ip", "netns", "exec", outside, "iptables", "-w", "5", "-t", "raw", "-A", "PREROUTING", "-i", f"vg{tag}b")
        yield inside, outside, f"vg{tag}a", f"vg{tag}b"
    finally:
        sh("ip", "netns", "del", inside, check=False)
        sh("ip", "netns", "del", outside, check=False)


def in_ns(ns: str, *args: str) -> str:
    return sh("ip", "netns", "exec", ns, sys.executable, "-c", GUARD, *args).stdout.strip()


def arrived(outside: str, dev: str) -> int:
    out = sh("ip", "netns", "exec", outside, "iptables", "-w", "5", "-t", "raw", "-n", "-v", "-x", "-L", "PREROUTING").stdout
    return sum(int(line.split()[0]) for line in out.splitlines()[2:] if dev in line and line.split()[0].isdigit())


def send(ns: str, address: str, source: str | None = None) -> None:
    code = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
            + (f"s.bind(({source!r}, 0)); " if source else "")
            + "\nfor _ in range(3):\n    try:\n        s.sendto(b'x', (%r, 9))\n    except PermissionError:\n        pass" % address)
    sh("ip", "netns", "exec", ns, sys.executable, "-c", code, check=False)


def test_the_guard_drops_and_counts_private_traffic_leaving_by_the_default_interface(hosts, monkeypatch):
    inside, outside, dev_in, dev_out = hosts
    monkeypatch.chdir(ROOT)
    # without the guard, a packet to a private address would leave (the far side sees it): the test can tell
    send(inside, "10.77.0.1")
    assert arrived(outside, dev_out) == 3
    assert in_ns(inside, "install") == dev_in
    send(inside, "10.77.0.1")
    send(inside, "172.20.0.1")
    send(inside, "192.168.50.1")
    assert arrived(outside, dev_out) == 3          # nothing more arrived
    assert int(in_ns(inside, "dropped")) == 9      # and every one was counted
    # public addresses are not the guard's business; the pod range is, whatever the destination
    send(inside, "198.51.100.7")
    assert arrived(outside, dev_out) == 6
    sh("ip", "-n", inside, "addr", "add", "10.244.0.77/32", "dev", "lo")
    send(inside, "198.51.100.7", source="10.244.0.77")
    assert arrived(outside, dev_out) == 6
    assert int(in_ns(inside, "dropped")) == 12
    assert in_ns(inside, "remove") == "True"
    assert in_ns(inside, "remove") == "False"     # twice is fine
    assert int(in_ns(inside, "dropped")) == 0
