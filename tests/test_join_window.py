"""The local agent's join window (doeks.local.agent): with the supervisor wanting N nodes, the round closes when all
N have joined, also when they start seconds apart (a loaded machine, a node still importing torch): one rendezvous
round with every node, not a round of the first node alone and a second one when the others arrive."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

from doeks import services

from .conftest import ROOT

SCRIPT = "import os\nprint('WORLD', os.environ['WORLD_SIZE'], 'RANK', os.environ['RANK'], flush=True)\n"


def test_nodes_started_seconds_apart_rendezvous_once_with_every_node(state_dir, tmp_path):
    server = services.etcd(state_dir)
    server.start()
    home = tmp_path / "job"
    home.mkdir()
    (home / "status.json").write_text(json.dumps({"desired": 2}))  # what the supervisor wants (doeks.local.jobs)
    script = tmp_path / "world.py"
    script.write_text(SCRIPT)
    endpoint = server.endpoint().split("://", 1)[-1]
    argv = [sys.executable, "-m", "doeks.local.agent", "--local-addr", "127.0.0.1", "--nnodes", "1:3",
            "--nproc-per-node", "1", "--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint,
            "--rdzv-id", f"stagger-{os.getpid()}-{time.time_ns()}", "--rdzv-conf", "last_call_timeout=1,timeout=600",
            "--max-restarts", "0", "--monitor-interval", "0.5", str(script)]
    env = {**os.environ, "DOEKS_JOB_HOME": str(home), "DOEKS_PRELOAD": "0", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    nodes = []
    try:
        for delay in (0, 6):  # the second node starts well after the first has joined and the last call (1 s) is over
            time.sleep(delay)
            nodes.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        outputs = [node.communicate(timeout=240)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
        server.stop()
    text = "\n".join(outputs)
    assert all(node.returncode == 0 for node in nodes), text[-4000:]
    rounds = re.findall(r"Rendezvous version (\d+) is complete. Final state: .*'participants': \[([\d, ]*)\]", text)
    assert rounds, text[-4000:]
    assert {participants for _, participants in rounds} == {"0, 1"}, text[-4000:]  # never a round of one
    assert len({version for version, _ in rounds}) == 1, text[-4000:]  # one round
    assert sorted(re.findall(r"WORLD (\d+) RANK (\d+)", text)) == [("2", "0"), ("2", "1")], text[-4000:]
