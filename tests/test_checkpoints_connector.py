"""Checkpoints through s3torchconnector (the client the job uses where the endpoint answers as S3 does) against
bench/s3_endpoint.py, a real HTTP server process with S3's latency, and the background write's CPU priority."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from doeks.workload import checkpoints

from .conftest import ROOT

pytest.importorskip("s3torchconnector")
torch = pytest.importorskip("torch")


@pytest.fixture
def requests(tmp_path):
    """The endpoint's log: one 'METHOD target' line per request it answered."""
    return tmp_path / "requests.log"


@pytest.fixture
def endpoint(monkeypatch, requests):
    server = subprocess.Popen([sys.executable, str(ROOT / "bench" / "s3_endpoint.py"), "--files", "0", "--bucket", "bench",
                               "--latency-ms", "20", "--max-seconds", "120", "--log", str(requests)],
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
    """A file that is not streamed (tests/test_checkpoints_direct.py: where its stream failed; here the client of
    direct reads cannot be made) is read through the connector's DCP-optimized reader (the byte ranges of the plan's
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
    monkeypatch.setattr(checkpoints._S3, "direct", lambda self: None)

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


def _nice(tid: int | None = None) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid or threading.get_native_id())


def _record_writing_threads(store, seen: list):
    """The priority of each thread that writes a checkpoint file (the writer's file threads)."""
    writer_for = store.at.writer

    def writer(name):
        writer = writer_for(name)
        create_stream = writer.fs.create_stream

        def recording(path, mode):
            seen.append(_nice())
            return create_stream(path, mode)

        writer.fs.create_stream = recording
        return writer

    store.at.writer = writer


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="Linux nice")
def test_the_background_write_runs_at_a_lower_cpu_priority_than_training(tmp_path):
    """The threads that write an asynchronous save's files run WRITE_NICE below the caller (where the CPU is short,
    training's step comes first); the caller's own thread stays as it was, and a blocking save writes at its
    priority."""
    store = checkpoints.Store(tmp_path / "ck")
    seen: list[int] = []
    _record_writing_threads(store, seen)
    base = _nice()
    state = _state()
    store.save(state, 1)
    store.wait()
    assert seen and set(seen) == {min(19, base + checkpoints.WRITE_NICE)}, seen
    assert _nice() == base and os.getpriority(os.PRIO_PROCESS, os.getpid()) == base
    seen.clear()
    store.save(state, 2, background=False)
    assert seen and set(seen) == {base}, seen
    loaded = _fresh(state)
    store.load(loaded, store.latest())
    assert all(torch.equal(loaded["model"][n], t) for n, t in state["model"].items())


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="Linux nice")
def test_the_s3_client_of_a_background_write_makes_its_threads_at_the_lower_priority(endpoint, monkeypatch):
    """The connector's native client makes its event loop threads where its first request goes (for a save, DCP's
    executor asking whether a .metadata exists, before any data is written): that thread is already lowered, so the
    client's threads, which do the upload's work, run below training too. A restore makes none: it reads through the
    client of direct reads (botocore, on the caller's threads, at its priority)."""
    from s3torchconnector._s3client import _s3client

    built: list[tuple[bool, int]] = []  # (on the caller's thread or the probe's, nice) per native client
    caller = threading.get_native_id()
    builder = _s3client.S3Client._client_builder

    def recording(self):  # the store's probe of the endpoint (a client of its own, dropped after) runs on its own thread
        built.append((threading.get_native_id() == caller or threading.current_thread().name == "checkpoint-probe",
                      _nice()))
        return builder(self)

    monkeypatch.setattr(_s3client.S3Client, "_client_builder", recording)
    store = checkpoints.Store("s3://bench/priority")
    base = _nice()
    store.save(_state(), 1)
    store.wait()
    writes = [nice for on_caller, nice in built if not on_caller]
    assert writes and set(writes) == {min(19, base + checkpoints.WRITE_NICE)}, built
    built.clear()
    store.load(_fresh(_state()), "step-1")
    assert built == [], built


def test_the_connector_clients_are_made_once_per_process_not_per_checkpoint(endpoint, monkeypatch):
    """Three saves make one native client for the writes (and the first save's probe its own): a client per checkpoint
    opened new connections to S3 and made new threads every time. Two restores make none (the client of direct reads
    reads the metadata and the data; one was made for the reads before)."""
    from s3torchconnector._s3client import _s3client

    built: list[int] = []
    builder = _s3client.S3Client._client_builder

    def counting(self):
        built.append(threading.get_native_id())
        return builder(self)

    monkeypatch.setattr(_s3client.S3Client, "_client_builder", counting)
    store = checkpoints.Store("s3://bench/reuse")
    state = _state()
    for step in (1, 2, 3):
        store.save(state, step)
    store.wait()
    for name in ("step-2", "step-3"):
        loaded = _fresh(state)
        store.load(loaded, name)
        assert all(torch.equal(loaded["model"][n], t) for n, t in state["model"].items())
    assert len(built) == 2, built  # the probe's, the writes'


def test_a_resume_asks_s3_only_what_it_needs(endpoint, requests):
    """A job's resume (a new store: newest(), then load()) makes one request per thing it must know: the listing, one
    HeadObject per checkpoint kept (sent together), the metadata once (newest() reads the meta, load() the state of the
    same checkpoint), and `latest` in one GetObject. Before: s3fs read `latest` with a HeadObject first, the metadata
    was read twice, and the connector's probe (four requests) came between the listing and the first read."""
    state = _state()
    first = checkpoints.Store("s3://bench/resume", keep=3)
    for step in (2, 4, 6):
        first.save(state, step, background=False)
    resuming = checkpoints.Store("s3://bench/resume", keep=3)
    resuming.at.choose()  # the probe, started by the store beside its listing, is over
    before = len(requests.read_text().splitlines())
    assert resuming.latest() == "step-6"
    name, meta = resuming.newest()
    loaded = _fresh(state)
    resuming.load(loaded, name)
    asked = requests.read_text().splitlines()[before:]
    assert (name, meta["step"]) == ("step-6", 6)
    assert torch.equal(loaded["model"]["w3"], state["model"]["w3"])
    assert [a for a in asked if "latest" in a] == ["GET /bench/resume/latest"]
    assert sorted(a for a in asked if a.startswith("HEAD")) == [f"HEAD /bench/resume/step-{n}/.metadata" for n in (2, 4, 6)]
    assert [a for a in asked if a.startswith("GET") and a.endswith("/.metadata")] == ["GET /bench/resume/step-6/.metadata"]
    assert len([a for a in asked if a.startswith("GET /bench?list-type=2")]) == 1
    assert not [a for a in asked if "probe" in a or a.startswith(("PUT", "POST", "DELETE"))]


def test_a_prefetched_checkpoint_loads_from_memory_and_one_that_failed_as_usual(endpoint, requests, monkeypatch):
    """A resuming job starts the download as soon as it knows its checkpoint (Store.prefetch after newest()), so it
    goes on while the job sets up; load() then asks S3 for no data: every file was read once, whole, by the prefetch
    (one ranged GetObject each). A prefetch whose read failed (here: the object gone before it was read, then put
    back) leaves load() to read that file as usual; a load of another checkpoint drops what was prefetched."""
    state = _state()
    first = checkpoints.Store("s3://bench/prefetch", keep=3)
    for step in (2, 4):
        first.save(state, step, background=False)
    resuming = checkpoints.Store("s3://bench/prefetch", keep=3)
    name, _ = resuming.newest()
    with monkeypatch.context() as short:
        short.setattr(checkpoints, "_available_memory", lambda: 4 * 1024 * 1024)  # no room: nothing started
        assert not resuming.prefetch(name) and not resuming._prefetched
    files = sorted(f.rsplit("/", 1)[-1] for f in resuming.at.fs.find("bench/prefetch/step-4") if f.endswith(".distcp"))
    assert len(files) == 4
    before = len(requests.read_text().splitlines())
    assert resuming.prefetch(name)
    for future in resuming._prefetched[name].values():
        future.result(timeout=30)
    during = len(requests.read_text().splitlines())
    fetched = [a for a in requests.read_text().splitlines()[before:during] if a.startswith("GET")]
    assert sorted(a.split("/")[-1] for a in fetched) == files, fetched
    loaded = _fresh(state)
    resuming.load(loaded, name)
    assert all(torch.equal(loaded["model"][n], t) for n, t in state["model"].items())
    assert torch.equal(loaded["scale"], state["scale"])
    assert not [a for a in requests.read_text().splitlines()[during:] if a.startswith("GET")]

    # a file's prefetch failed: that file is read as usual, the others from memory
    again = checkpoints.Store("s3://bench/prefetch", keep=3)
    name, _ = again.newest()
    key = f"bench/prefetch/{name}/{files[0]}"
    kept = again.at.fs.cat_file(key)
    again.at.fs.rm(key)
    assert again.prefetch(name)
    for future in again._prefetched[name].values():
        future.exception(timeout=30)
    again.at.fs.pipe_file(key, kept)
    during = len(requests.read_text().splitlines())
    loaded = _fresh(state)
    again.load(loaded, name)
    assert all(torch.equal(loaded["model"][n], t) for n, t in state["model"].items())
    read = [a for a in requests.read_text().splitlines()[during:] if a.startswith("GET") and ".distcp" in a]
    assert {a.split("/")[-1].split("?")[0] for a in read} == {files[0]}, read
    assert not again._prefetched


FIRST_IMPORT = """import json, sys, threading
seen = []
start = threading.Thread.start

def recording(self):  # at each thread's start: is torch.distributed imported, whole, already?
    imported = sys.modules.get("torch.distributed")
    seen.append((self.name, hasattr(imported, "init_process_group")))
    start(self)

threading.Thread.start = recording
sys.path.insert(0, sys.argv[2])
from doeks.workload.checkpoints import Store
assert "torch" not in sys.modules
store = Store(sys.argv[1])
import torch.distributed.checkpoint  # as newest() reads the metadata, beside the probe
store.at.choose()
print(json.dumps(seen))
"""


def test_a_store_imports_torch_distributed_before_it_starts_its_threads(endpoint, tmp_path):
    """A resuming Store starts threads at once (the connector's probe, the client of direct reads) while the caller
    lists and reads with DCP. In a process that had not imported torch yet, the probe's import of torch beside the
    caller's import of DCP aborted the process (SIGABRT in torch's _c10d_init: Python handed the caller a torch half
    imported; tests/test_checkpoints_s3.py's fixture, three times in a row): so the Store imports torch whole on the
    caller's thread before it starts any. A fresh process that has not imported torch, DCP imported as newest()
    does, while the probe runs."""
    import json

    (tmp_path / "first.py").write_text(FIRST_IMPORT)
    result = subprocess.run([sys.executable, str(tmp_path / "first.py"), "s3://bench/first", str(ROOT)],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.splitlines()[-1])
    mine = [(name, imported) for name, imported in seen if name.startswith("checkpoint-")]
    assert {name for name, _ in mine} >= {"checkpoint-probe", "checkpoint-direct"}, seen
    assert all(imported for _, imported in mine), mine


def test_a_prefetch_counts_every_rank_of_the_node_against_its_memory(endpoint, requests, tmp_path, monkeypatch):
    """Each rank of a node prefetches the whole checkpoint into its own memory (DDP: every rank reads all of it), so
    the check is the checkpoint times LOCAL_WORLD_SIZE against a quarter of the memory available: with room for 4
    copies, 4 ranks prefetch and 8 do not (eight ranks of an 8-GPU node, each with its copy, ran the node out of
    memory at resume). A folder's prefetch is the one page cache of the node: the ranks do not count."""
    state = _state()
    checkpoints.Store("s3://bench/ranks", keep=1).save(state, 2, background=False)
    resuming = checkpoints.Store("s3://bench/ranks", keep=1)
    name, _ = resuming.newest()
    size = sum(info["size"] for info in resuming.at.fs.find(f"bench/ranks/{name}", detail=True).values()
               if info["name"].endswith(".distcp"))
    assert size > 8_000_000
    monkeypatch.setattr(checkpoints, "_available_memory", lambda: 4 * 4 * size)  # a quarter: 4 copies
    before = len(requests.read_text().splitlines())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert not resuming.prefetch(name) and not resuming._prefetched
    assert not [a for a in requests.read_text().splitlines()[before:] if ".distcp" in a]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert resuming.prefetch(name)
    assert all(len(f.result(timeout=30)) for f in resuming._prefetched[name].values())

    folder = checkpoints.Store(str(tmp_path / "ck"), keep=1)
    folder.save(state, 2, background=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert folder.prefetch("step-2")


def test_the_job_resumes_from_s3_through_the_connector_with_its_checkpoint_prefetched(endpoint, tmp_path, capsys,
                                                                                      monkeypatch):
    """The built-in job (train.py, in this process) against the endpoint: trained 2 steps, run again to 4, it resumes
    from step-2, having started that checkpoint's download right after newest() named it, and load() read the
    prefetched files (the prefetch's Futures were asked for their bytes)."""
    from doeks.datastage import relayout_val
    from doeks.workload import data, train

    root = tmp_path / "data"
    data.generate(root, classes=2, train_per_class=8, val_per_class=2, size=36)
    relayout_val(root)
    prefetched, asked = [], []
    real_prefetch = checkpoints.Store.prefetch

    def prefetch(self, name):
        started = real_prefetch(self, name)
        prefetched.append((name, started, sorted(self._prefetched.get(name, {}))))
        for file, future in self._prefetched.get(name, {}).items():
            real_result = future.result
            future.result = lambda *a, _file=file, _real=real_result, **k: (asked.append(_file), _real(*a, **k))[1]
        return started

    monkeypatch.setattr(checkpoints.Store, "prefetch", prefetch)

    def run(steps: int):
        capsys.readouterr()
        code = train.main(["--data", str(root), "--checkpoint-dir", "s3://bench/job", "--metrics-dir",
                           str(tmp_path / "m"), "--arch", "mobilenet_v3_small", "--epochs", "2", "--batch-size", "4",
                           "--crop-size", "32", "--workers", "0", "--checkpoint-every", "1", "--log-every", "1",
                           "--max-steps", str(steps)])
        return code, capsys.readouterr().out

    code, out = run(2)
    assert code == 0 and "resumed" not in out and not prefetched
    code, out = run(4)
    assert code == 0 and "resumed from checkpoint step=2" in out, out
    assert [(n, s) for n, s, _ in prefetched] == [("step-2", True)] and prefetched[0][2]
    assert sorted(asked) == prefetched[0][2]
