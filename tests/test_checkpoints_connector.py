"""Checkpoints through s3torchconnector (the client the job uses where the endpoint answers as S3 does) against
bench/s3_endpoint.py, a real HTTP server process with S3's latency."""
from __future__ import annotations

import subprocess
import sys

import pytest

from doeks.workload import checkpoints

from .conftest import ROOT

pytest.importorskip("s3torchconnector")
torch = pytest.importorskip("torch")


@pytest.fixture
def endpoint(monkeypatch):
    server = subprocess.Popen([sys.executable, str(ROOT / "bench" / "s3_endpoint.py"), "--files", "0", "--bucket", "bench",
                               "--latency-ms", "20", "--max-seconds", "120"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    port = int(server.stdout.readline().split()[1])
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_REGION", "us-west-2")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    yield
    server.stdin.close()
    server.wait(10)


def _state() -> dict:
    torch.manual_seed(0)  # several tensors of a few MB: the writer's 4 threads write 4 files, each of several items
    return {"model": {f"w{i}": torch.randn(300_000 + 1000 * i) for i in range(8)}, "scale": torch.tensor(3.5)}


def _fresh(state: dict) -> dict:
    return {k: ({n: torch.zeros_like(t) for n, t in v.items()} if isinstance(v, dict) else torch.zeros_like(v))
            for k, v in state.items()}


def test_s3_checkpoint_through_the_connector_restores_with_its_dcp_reader(endpoint, monkeypatch):
    """A restore reads the .distcp files through the connector's DCP-optimized reader (the byte ranges of the plan's
    items; the chunks kept, not copied into a BytesIO), not through its generic sequential reader, and the state
    and the meta come back as saved."""
    from s3torchconnector.s3reader import dcp_optimized, sequential

    made = {"dcp": 0, "sequential": []}
    dcp_init, seq_init = dcp_optimized.DCPOptimizedS3Reader.__init__, sequential.SequentialS3Reader.__init__

    def count_dcp(self, *args, **kwargs):
        made["dcp"] += 1
        dcp_init(self, *args, **kwargs)

    def count_sequential(self, bucket, key, *args, **kwargs):
        made["sequential"].append(key.rsplit("/", 1)[-1])
        seq_init(self, bucket, key, *args, **kwargs)

    monkeypatch.setattr(dcp_optimized.DCPOptimizedS3Reader, "__init__", count_dcp)
    monkeypatch.setattr(sequential.SequentialS3Reader, "__init__", count_sequential)

    store = checkpoints.Store("s3://bench/connector", keep=2)
    state = _state()
    store.save(state, 5, {"epoch": 1})
    store.wait()
    assert store.at.client == "s3torchconnector" and store.latest() == "step-5"
    assert store.read_meta("step-5") == {"epoch": 1, "step": 5}
    loaded = _fresh(state)
    store.load(loaded, "step-5")
    assert all(torch.equal(loaded["model"][n], t) for n, t in state["model"].items())
    assert torch.equal(loaded["scale"], state["scale"])
    assert made["dcp"] >= 4  # every data file read through the DCP reader (the meta's own read included)
    assert set(made["sequential"]) == {".metadata"}  # only DCP's .metadata goes through the sequential reader
