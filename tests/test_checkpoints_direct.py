"""A restore from S3 streams each checkpoint file with ranged GetObjects of its own (doeks/workload/checkpoint_s3.py:
_Direct, _stream_file): every tensor's bytes go from the socket into the model's memory, and a file whose stream
fails is read again through the usual reader. Against bench/s3_endpoint.py (a real HTTP server process with S3's
latency, its connection resets and TLS); real torch.save output and real DCP checkpoints."""
from __future__ import annotations

import io
import resource
import subprocess
import sys
import warnings

import boto3
import pytest

from doeks.workload import checkpoint_read, checkpoint_s3, checkpoints

from .conftest import ROOT

torch = pytest.importorskip("torch")
pytest.importorskip("s3torchconnector")


def _saved(tensor) -> memoryview:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return memoryview(buffer.getvalue())


@pytest.mark.parametrize("kind", ["dense", "transposed", "view with an offset", "scalar", "empty", "bfloat16", "bool",
                                  "large"])
def test_an_item_read_forwards_finds_its_storage_where_the_central_directory_says(kind):
    """_head_layout reads torch.save's zip from its first bytes (a stream has no end to read first); it finds the
    tensor's storage where _saved_layout, which reads the central directory at the item's end, finds it."""
    torch.manual_seed(0)
    tensor = {"dense": torch.randn(3, 4), "transposed": torch.randn(3, 4).t(), "view with an offset": torch.randn(7)[2:],
              "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 3), "bfloat16": torch.randn(4, 4).to(torch.bfloat16),
              "bool": torch.tensor([True, False]), "large": torch.randn(1024, 1024)}[kind]
    saved = _saved(tensor)
    expected = checkpoint_read._saved_layout(lambda at, size: saved[at:at + size], len(saved))
    found = checkpoint_read._head_layout(saved[:checkpoint_read.HEAD], len(saved))
    assert expected is not None and found is not None
    assert found[0] == expected


def test_what_is_not_a_plain_tensor_or_lies_beyond_the_head_is_not_found():
    saved = _saved(torch.randn(4, 4))
    assert checkpoint_read._head_layout(saved[:40], len(saved)) is None  # the storage's header not within the head
    assert checkpoint_read._head_layout(_saved({"a": torch.randn(2)})[:checkpoint_read.HEAD], 10_000) is None
    assert checkpoint_read._head_layout(memoryview(b"not a zip" * 100), 900) is None


def _endpoint(tmp_path, *extra: str):
    log = tmp_path / "requests.log"
    server = subprocess.Popen([sys.executable, str(ROOT / "bench" / "s3_endpoint.py"), "--files", "0", "--bucket", "bench",
                               "--latency-ms", "20", "--max-seconds", "120", "--log", str(log), *extra],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    port = int(server.stdout.readline().split()[1])
    return server, port, log


@pytest.fixture
def s3(tmp_path, monkeypatch, request):
    """The endpoint (with the test's extra arguments); yields (url, request log)."""
    extra = list(getattr(request, "param", []))
    scheme = "http"
    if "--tls" in extra:  # a certificate for 127.0.0.1, made here, trusted through AWS_CA_BUNDLE
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(tmp_path / "key.pem"),
                        "-out", str(tmp_path / "cert.pem")], check=True, capture_output=True)
        extra = ["--tls", str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")]
        monkeypatch.setenv("AWS_CA_BUNDLE", str(tmp_path / "cert.pem"))
        # botocore sends a PutObject over HTTPS with a checksum trailer in an HTTP chunked body, which the endpoint
        # does not read (it stores an empty object); asked to checksum only where S3 requires it, it sends it plain
        monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
        scheme = "https"
    server, port, log = _endpoint(tmp_path, *extra)
    url = f"{scheme}://127.0.0.1:{port}"
    for name, value in {"AWS_ENDPOINT_URL": url, "AWS_REGION": "us-west-2", "AWS_ACCESS_KEY_ID": "testing",
                        "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        monkeypatch.setenv(name, value)
    yield url, log
    server.stdin.close()
    server.wait(10)


def _state() -> dict:
    torch.manual_seed(3)  # a 64 MB tensor (16384 pages) beside small ones and a value that is not a tensor
    return {"w": torch.randn(4096, 4096), "t": torch.randn(64, 32).t().contiguous(),
            "layers": {f"b{i}": torch.randn(1000 + i) for i in range(12)}, "step": 7}


def _fresh() -> dict:
    """A target written before, as a model's and an optimizer's memory is when a job loads into them."""
    return {"w": torch.zeros(4096, 4096), "t": torch.zeros(64, 32).t(),
            "layers": {f"b{i}": torch.zeros(1000 + i) for i in range(12)}, "step": 0}


def _same(loaded: dict, state: dict) -> bool:
    return (torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["t"], state["t"]) and loaded["step"] == 7
            and all(torch.equal(loaded["layers"][k], v) for k, v in state["layers"].items()))


def _gets(log, before: int) -> list[str]:
    return [line for line in log.read_text().splitlines()[before:] if line.startswith("GET") and ".distcp" in line]


def test_a_restore_from_s3_reads_each_file_once_straight_into_the_targets(s3, capsys):
    """One GetObject per checkpoint file, and the 64 MB tensor's bytes go from the socket into the target: the load
    makes far fewer page faults than its 16384 pages (through the connector's chunks, new Python bytes, it made
    more than that), and says nothing of reading a file again."""
    url, log = s3
    state = _state()
    checkpoints.Store("s3://bench/direct", keep=1).save(state, 1, background=False)
    store = checkpoints.Store("s3://bench/direct", keep=1)
    name = store.latest()
    store.read_meta(name)
    store.at.choose()
    store.at.direct()  # (its client made: botocore's model read once, not counted)
    before = len(log.read_text().splitlines())
    target = _fresh()
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        store.load(target, name)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    assert _same(target, state)
    assert faults < 4096, f"{faults} page faults: the 64 MB tensor went through fresh memory"
    files = sorted({line.split("/")[-1] for line in _gets(log, 0)})
    assert len(files) == 4 and sorted(line.split("/")[-1] for line in _gets(log, before)) == files
    assert "read again" not in capsys.readouterr().out


@pytest.mark.parametrize("s3", [["--tls"]], indirect=True)
def test_a_direct_read_over_https_trusts_aws_ca_bundle_and_only_it(s3, monkeypatch):
    """S3 is HTTPS: the direct reads go over TLS (the body read from the TLS socket into the caller's memory),
    trusting the certificate AWS_CA_BUNDLE names, as every other client of doeks does; without it, refused."""
    url, log = s3
    data = bytes(range(256)) * 12_000  # 3 MB
    boto3.client("s3", endpoint_url=url, region_name="us-west-2").put_object(Bucket="bench", Key="tls/f", Body=data)
    memory = memoryview(bytearray(len(data) - 1000))
    body = checkpoint_s3._Direct(url, "us-west-2", 2).get("bench", "tls/f", 1000, len(data))
    body.fill(memory[:5])
    body.fill(memory[5:])
    body.close()
    assert memory == data[1000:]
    monkeypatch.delenv("AWS_CA_BUNDLE")
    with pytest.raises(Exception, match="certificate verify failed"):
        checkpoint_s3._Direct(url, "us-west-2", 2).get("bench", "tls/f", 0, 10)


RESET = 100  # the endpoint resets every RESET-th request's connection: odd resets before the answer, even ones mid-body


@pytest.mark.parametrize("s3", [["--reset-every", str(RESET)]], indirect=True)
def test_a_connection_reset_in_the_middle_of_a_file_reads_that_file_again_the_usual_way(s3, capsys):
    """The endpoint answers half of one checkpoint file's body, then resets the connection (TCP RST): that file is
    read again through the connector's reader, said in one line, and the state loads whole. Requests are counted so
    that the reset that comes mid-body is the restore's first GET of a file."""
    url, log = s3
    state = _state()
    checkpoints.Store("s3://bench/reset", keep=1).save(state, 1, background=False)
    store = checkpoints.Store("s3://bench/reset", keep=1)
    name = store.latest()
    store.read_meta(name)  # (the load reads no .metadata: it is kept from here)
    store.at.choose()
    store.at.direct()
    pad = boto3.client("s3", endpoint_url=url, region_name="us-west-2")

    def served() -> int:
        return len([line for line in log.read_text().splitlines() if not line.startswith("RESET")])

    assert served() < 2 * RESET - 1, "the save made more requests than the test counts on: raise RESET"
    while served() < 2 * RESET - 1:  # the next request is the 2nd reset's, which comes mid-body
        try:
            pad.head_bucket(Bucket="bench")
        except Exception:  # noqa: BLE001 - (the 1st reset, before its answer: retried, or not)
            pass
    target = _fresh()
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        store.load(target, name)
    out = capsys.readouterr().out
    resets = [line for line in log.read_text().splitlines() if line.startswith("RESET")]
    assert len(resets) == 2 and resets[1].startswith("RESET GET") and ".distcp" in resets[1], resets
    file = resets[1].split("/")[-1].split("?")[0]
    assert f"checkpoint: {file} is read again through S3StorageReader" in out, out
    assert _same(target, state)


def test_a_restore_of_part_of_a_checkpoint_asks_only_for_the_runs_of_bytes_it_needs(s3):
    """Items a restore does not need, lying between ones it does, are skipped: read and dropped where they are less
    than GAP bytes (a request round trip costs more), a GetObject of its own for what lies beyond a larger gap. Eight
    12 MB tensors: DCP's writer puts two in each of its four files, then the small ones after them; a load of the
    first of each pair and the small ones leaves a 12 MB gap in every file: two GETs per file, 24 MB less read."""
    url, log = s3
    torch.manual_seed(5)
    state = {"big": {f"w{i}": torch.randn(3_000_000) for i in range(8)}, "small": {f"s{i}": torch.randn(100) for i in range(8)}}
    checkpoints.Store("s3://bench/part", keep=1).save(state, 1, background=False)
    store = checkpoints.Store("s3://bench/part", keep=1)
    name = store.latest()
    meta = store._reader(name).read_metadata()
    by_file: dict = {}
    for index, info in meta.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((info.offset, index.fqn))
    firsts = {[fqn for _, fqn in sorted(items) if fqn.startswith("big.")][0] for items in by_file.values()}
    assert len(by_file) == 4 and len(firsts) == 4 and all(len(items) >= 3 for items in by_file.values()), by_file
    wanted = {"big": {f.split(".")[1]: torch.zeros(3_000_000) for f in firsts},
              "small": {f"s{i}": torch.zeros(100) for i in range(8)}}
    before = len(log.read_text().splitlines())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        store.load(wanted, name)
    assert all(torch.equal(wanted["big"][k], state["big"][k]) for k in wanted["big"])
    assert all(torch.equal(wanted["small"][k], state["small"][k]) for k in wanted["small"])
    gets = sorted(line.split("/")[-1] for line in _gets(log, before))
    assert gets == sorted(f for f in by_file for _ in range(2)), gets
