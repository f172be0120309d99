"""Staging (doeks.datastage) against bench/s3_endpoint.py, a real HTTP server process with S3's latency: resume after
a SIGKILL mid-copy, wrong-size files fetched again (and only they), retries on 503 SlowDown, one-line errors, and the
SigV4 signature checked against botocore's own S3 signer (what real S3 verifies)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from doeks import datastage

from .conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from s3_endpoint import Store  # noqa: E402

FILES, SIZE = 300, 20_000
ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
       "PYTHONPATH": str(ROOT)}


@pytest.fixture
def endpoint(tmp_path, request):
    """The bench endpoint as its own process (20 ms per request); yields (url, request log path); stops with stdin."""
    extra = getattr(request, "param", [])
    if "--tls" in extra:  # a certificate for 127.0.0.1, made here
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(tmp_path / "key.pem"),
                        "-out", str(tmp_path / "cert.pem")], check=True, capture_output=True)
        extra = [a.format(cert=tmp_path / "cert.pem", key=tmp_path / "key.pem") for a in extra]
    log = tmp_path / "requests.log"
    server = subprocess.Popen([sys.executable, str(ROOT / "bench" / "s3_endpoint.py"), "--files", str(FILES), "--size", str(SIZE),
                               "--latency-ms", "20", "--max-seconds", "120", "--log", str(log), *extra],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    port = int(server.stdout.readline().split()[1])
    yield f"{'https' if '--tls' in extra else 'http'}://127.0.0.1:{port}", log
    server.stdin.close()
    server.wait(10)


def store() -> Store:
    return Store("bench", "imagenet", FILES, SIZE)


def stage_cli(url: str, dest: Path, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "doeks.datastage", "s3://bench/imagenet", str(dest), *args],
                            env={**os.environ, **ENV, "AWS_ENDPOINT_URL": url}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def gets(log: Path) -> list[str]:
    return [line.split(" ", 1)[1] for line in log.read_text().splitlines() if line.startswith("GET ") and "list-type" not in line]


def assert_identical(dest: Path, reference: Store) -> None:
    files = {p.relative_to(dest).as_posix(): p for p in dest.rglob("*") if p.is_file()}
    assert len(files) == FILES
    for key in reference.keys:
        assert files[key[len("imagenet/"):]].read_bytes() == bytes(reference.body(key)), key


def test_resume_after_a_kill_mid_copy_fetches_only_what_is_missing(endpoint, tmp_path):
    url, log = endpoint
    dest = tmp_path / "data"
    first = stage_cli(url, dest, "--threads", "4")  # 300 files x 20 ms / 4 in flight: ~1.5 s
    deadline = time.monotonic() + 30
    while sum(1 for p in dest.rglob("*.JPEG") if p.is_file()) < 60:
        assert first.poll() is None and time.monotonic() < deadline, "the first run ended before it could be killed"
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.wait()
    complete = {p.relative_to(dest).as_posix() for p in dest.rglob("*.JPEG") if p.is_file()}
    assert 60 <= len(complete) < FILES
    reference = store()
    for rel in complete:  # a rename makes a file complete or absent: nothing half-written under its own name
        assert (dest / rel).stat().st_size == reference.objects[f"imagenet/{rel}"][1]
    log.write_text("")

    second = stage_cli(url, dest, "--threads", "16")
    out, err = second.communicate(timeout=60)
    assert second.returncode == 0, err
    assert f"{FILES - len(complete)} downloaded, {len(complete)} already there" in out
    assert "verified" in out and "progress: 300/300" in out
    fetched = gets(log)
    assert len(fetched) == FILES - len(complete)  # not one GET for a file that was complete
    assert not {f.split("/imagenet/", 1)[1] for f in fetched} & complete
    assert not [p for p in dest.rglob("*") if p.name.endswith(datastage.PART)]  # the killed run's temp files are gone
    assert_identical(dest, reference)


def test_wrong_size_files_are_fetched_again_and_only_they(endpoint, tmp_path):
    url, log = endpoint
    dest = tmp_path / "data"
    reference = store()
    result = datastage.stage("s3://bench/imagenet", dest, region="us-east-1", credentials={"aws_access_key_id": "testing", "aws_secret_access_key": "testing"},
                             endpoint_url=url, concurrency=32, writers=4)
    assert (result.files, result.downloaded, result.skipped) == (FILES, FILES, 0)
    assert result.bytes == reference.total_bytes
    short, long_, gone = (dest / k[len("imagenet/"):] for k in reference.keys[:3])
    short.write_bytes(short.read_bytes()[:-1])
    long_.write_bytes(long_.read_bytes() + b"x")
    gone.unlink()
    (dest / "train" / f".stray{datastage.PART}").write_bytes(b"left by a killed run")
    log.write_text("")
    progress = []
    again = datastage.stage("s3://bench/imagenet", dest, region="us-east-1",
                            credentials={"aws_access_key_id": "testing", "aws_secret_access_key": "testing"},
                            endpoint_url=url, concurrency=8, writers=0, progress=lambda d, t: progress.append((d, t)))
    assert (again.downloaded, again.skipped) == (3, FILES - 3)
    assert sorted(gets(log)) == sorted(f"/bench/{k}" for k in reference.keys[:3])
    assert progress[-1] == (FILES, FILES)
    assert_identical(dest, reference)


@pytest.mark.parametrize("endpoint", [["--fail-every", "7"]], indirect=True)
def test_slow_down_answers_are_retried(endpoint, tmp_path):
    url, _ = endpoint
    result = datastage.stage("s3://bench/imagenet", tmp_path / "d", region="us-east-1",
                             credentials={"aws_access_key_id": "testing", "aws_secret_access_key": "testing"},
                             endpoint_url=url, concurrency=16)
    assert result.downloaded == FILES and result.retries >= FILES // 7 - 2
    assert_identical(tmp_path / "d", store())


@pytest.mark.parametrize("endpoint", [["--reset-every", "9"]], indirect=True)
def test_connections_reset_mid_request_are_retried_and_the_files_are_identical(endpoint, tmp_path):
    """Every 9th request's connection reset (TCP RST), half of them after the answer's head and half its body: the
    stage retries each on a new connection, writes no half file, and ends with every file byte for byte."""
    url, log = endpoint
    dest = tmp_path / "d"
    result = datastage.stage("s3://bench/imagenet", dest, region="us-east-1",
                             credentials={"aws_access_key_id": "testing", "aws_secret_access_key": "testing"},
                             endpoint_url=url, concurrency=16)
    resets = [line for line in log.read_text().splitlines() if line.startswith("RESET ")]
    assert len(resets) >= FILES // 9  # (the log has one line per request, and one more per reset)
    assert result.downloaded == FILES and result.retries >= len(resets)
    assert not [p for p in dest.rglob("*") if p.name.endswith(datastage.PART)]
    assert_identical(dest, store())


def test_bad_bucket_and_empty_prefix_are_one_line_errors(endpoint, tmp_path):
    url, _ = endpoint
    for source, message in (("s3://nobucket/x", "error: S3 answered 404 NoSuchBucket"), ("s3://bench/nothing", "error: nothing under")):
        run = subprocess.run([sys.executable, "-m", "doeks.datastage", source, str(tmp_path / "d")], capture_output=True,
                             text=True, env={**os.environ, **ENV, "AWS_ENDPOINT_URL": url}, timeout=60)
        assert run.returncode == 1 and run.stderr.startswith(message) and len(run.stderr.strip().splitlines()) == 1, run.stderr


@pytest.mark.parametrize("key,params,token", [
    ("imagenet/train/n01440764/img 1+(ü).JPEG", None, None),
    ("", {"list-type": "2", "prefix": "data/imagenet/", "encoding-type": "url", "continuation-token": "a/b=c+d"}, "FwoGZX//tok=="),
])
def test_signature_is_what_botocore_signs(key, params, token):
    """Real S3 checks SigV4; botocore's S3SigV4Auth (botocore/auth.py, 1.43) is the reference signer."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    host = "bucket.s3.us-west-2.amazonaws.com"
    path = datastage.encode_path("/" + key)
    query = datastage.encode_query(params) if params else ""
    request = AWSRequest(method="GET", url=f"https://{host}{path}" + (f"?{query}" if query else ""))
    request.headers["X-Amz-Content-SHA256"] = datastage.EMPTY_SHA256
    request.context["payload_signing_enabled"] = True
    S3SigV4Auth(Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", token), "s3", "us-west-2").add_auth(request)
    ours = dict(datastage.Signer({"aws_access_key_id": "AKIDEXAMPLE", "aws_secret_access_key": "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
                                  "aws_session_token": token}, "us-west-2").headers("GET", host, path, query, request.headers["X-Amz-Date"]))
    assert ours["authorization"] == request.headers["Authorization"]
    if token:
        assert ours["x-amz-security-token"] == token


def test_the_cluster_jobs_command_stages(endpoint, tmp_path, state_dir):
    """The Job csi.data.stage applies on EKS runs exactly this command (python -m doeks.datastage ...)."""
    import yaml

    from .conftest import invoke

    url, _ = endpoint
    result = invoke("csi.data.stage", "--source", "s3://bench/imagenet", "--dry-run", env={"TARGET": "eks", "STAGE_THREADS": "16"})
    assert result.returncode == 0, result.stderr
    job = next(d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] == "Job")  # with its ServiceAccount
    container = job["spec"]["template"]["spec"]["containers"][0]
    command = container["command"]
    assert command[:3] == ["python", "-m", "doeks.datastage"] and command[3] == "s3://bench/imagenet"
    assert command[4] == "/fsx-shared/data" and command[5:7] == ["--threads", "16"]
    dest = tmp_path / "mount" / "data"
    run = subprocess.run([sys.executable] + command[1:4] + [str(dest)] + command[5:], capture_output=True, text=True,
                         env={**os.environ, **ENV, "AWS_ENDPOINT_URL": url}, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1].startswith(f"staged {FILES} files") and "verified" in run.stdout
    assert_identical(dest, store())


@pytest.mark.parametrize("endpoint", [["--tls", "{cert}", "{key}"]], indirect=True)
def test_https_with_the_ca_bundle_botocore_uses(endpoint, tmp_path):
    """S3 is HTTPS: the same copy over TLS, trusting AWS_CA_BUNDLE (a certificate made here for 127.0.0.1)."""
    url, _ = endpoint
    assert url.startswith("https://")
    run = subprocess.run([sys.executable, "-m", "doeks.datastage", "s3://bench/imagenet", str(tmp_path / "d"), "--quiet"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, **ENV, "AWS_ENDPOINT_URL": url, "AWS_CA_BUNDLE": str(tmp_path / "cert.pem")})
    assert run.returncode == 0, run.stderr
    assert_identical(tmp_path / "d", store())
    untrusted = subprocess.run([sys.executable, "-m", "doeks.datastage", "s3://bench/imagenet", str(tmp_path / "e"), "--quiet"],
                               capture_output=True, text=True, timeout=120, env={**os.environ, **ENV, "AWS_ENDPOINT_URL": url})
    assert untrusted.returncode == 1 and "self-signed certificate" in untrusted.stderr and "AWS_CA_BUNDLE" in untrusted.stderr
    assert len(untrusted.stderr.strip().splitlines()) == 1  # one line, not retried six times


def test_keys_that_would_leave_the_destination_are_refused():
    assert datastage.relative("data/imagenet/train/n1/a.JPEG", "data/imagenet/") == "train/n1/a.JPEG"
    for key in ("data/imagenet/../../etc/passwd", "data/imagenet//x", "data/imagenet/train/./a", "data/imagenet/.."):
        with pytest.raises(datastage.DoeksError, match="does not map"):
            datastage.relative(key, "data/imagenet/")


def test_a_head_of_a_missing_key_has_no_body_and_the_connection_goes_on(endpoint):
    """HEAD answers carry no body, a 404's neither: the endpoint sent NoSuchKey's XML after a HEAD's 404, and the
    client's next request on that connection read it as its status line ("Bad status line ... <?xml"), so s3fs (DCP's
    fsspec reader and writer, which ask HeadObject for a `.metadata` that is not there yet) failed against it. Read
    on the socket itself (http.client drops what follows a HEAD's headers, so it never sees the stray body)."""
    import socket

    url, _ = endpoint
    host, port = url.split("//", 1)[1].split(":")
    key = store().keys[0]
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"HEAD /bench/imagenet/no-such-key HTTP/1.1\r\nHost: x\r\n\r\n"
                     + f"GET /bench/{key} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        answer, body = b"", bytes(store().body(key))
        while not answer.endswith(body):
            chunk = sock.recv(1 << 16)
            assert chunk, answer[:600]
            answer += chunk
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 404 ") and rest.startswith(b"HTTP/1.1 200 OK\r\n"), answer[:600]
