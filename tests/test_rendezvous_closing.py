"""A node's agent that ends on an error of its own (a rendezvous that timed out, an etcd that went away and came back
empty) leaves its run's rendezvous open: the run's other nodes, and this node's container restarted by the kubelet,
can still join it. torch's launch_agent closes the rendezvous whenever an agent ends other than by a signal, which
makes the run one nobody can join again: every node after it meets RendezvousClosedError at every restart, for good
(doeks' cluster, CI 2026-11-28: the etcd pod made again, a node that failed in the new etcd closed the round the
restarted one had opened, and that one crash-looped while the other trained alone). A run that ended (its workers
succeeded, or failed with no restart left) still closes it: that is how the other nodes learn it is over.
Real etcd, real torchrun (the image's, doeks.pod.torchrun), real processes."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from doeks import services

from .conftest import ROOT

pytestmark = pytest.mark.slow


def torchrun(port: int, run: str, script, nodes: str, timeout_s: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "doeks.pod.torchrun", "--nnodes", nodes, "--nproc-per-node", "1", "--rdzv-backend",
            "etcd", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run,
            "--rdzv-conf", f"last_call_timeout=1,timeout={timeout_s}", "--max-restarts", "0", str(script)]
    return subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                                                 "DOEKS_PRELOAD": "0"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_node_that_gave_up_waiting_for_its_peers_leaves_the_run_open_to_them(state_dir, tmp_path):
    """The first node of two waits 3 s for the second, gives up (RendezvousTimeoutError: its container would be
    restarted); the two that come after rendezvous together and run (torch closed the run: both met
    RendezvousClosedError)."""
    script = tmp_path / "world.py"
    script.write_text("import os\nprint('WORLD', os.environ['WORLD_SIZE'], flush=True)\n")
    run = f"open-{os.getpid()}-{time.time_ns()}"
    server = services.etcd(state_dir)
    port = services.free_port()
    server.start(port=port)
    nodes = []
    try:
        first = torchrun(port, run, script, "2", 3)
        nodes.append(first)
        said = first.communicate(timeout=120)[0]
        assert first.returncode == 1 and "doeks: RendezvousTimeoutError: fewer nodes than the run's minimum" in said, \
            said[-3000:]
        assert "Traceback" not in said, said[-3000:]  # one line, not torch's 40
        nodes += [torchrun(port, run, script, "2", 120) for _ in range(2)]
        outputs = [node.communicate(timeout=180)[0] for node in nodes[1:]]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
        server.stop()
    for node, output in zip(nodes[1:], outputs):
        assert "RendezvousClosedError" not in output, output[-3000:]
        assert node.returncode == 0 and "WORLD 2" in output, output[-3000:]
