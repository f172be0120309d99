"""Every reason rule (doeks/pod/reasons.py) and the places reasons are derived, fast: no cluster, no job.

The log lines are what real programs wrote (tests/fixtures/reasons/*.log, made by its capture.py: doeks' training
script, Python's own errors, torchrun, torchrun's etcd rendezvous, the kernel refusing memory). The pods and events
are in the API server's shapes (k8s.io/api core/v1 Pod.status, Event) with the words of Kubernetes v1.35's own
components, as tests/test_kubernetes_jobs.py meets them on doeks' cluster: the scheduler's FailedScheduling
("0/1 nodes are available: 1 Insufficient nvidia.com/gpu. preemption: ...", pkg/scheduler/framework/types.go
FitError and the preemption plugin's PostFilter), the kubelet's ErrImagePull / ImagePullBackOff waiting reasons
and Failed / BackOff events (pkg/kubelet/images), FailedMount (pkg/kubelet/volumemanager, its hostPath type check
message), the runtime's OOMKilled with exit 137 (containerd's CRI), and JobSet's JobCreationFailed. They go through
the kubernetes target's own reading (the eks target's class, kubectl answered by tests/kubectl_standin.py) and the
TrainJob's `diagnose`. The same rules against a real API server: tests/test_kubernetes_jobs.py (marked kubernetes);
here a developer sees a broken rule in seconds."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from doeks.pod import reasons
from doeks.targets.base import check_train_args

from .test_targets import STANDIN, TINY, settings_for

LOGS = Path(__file__).parent / "fixtures" / "reasons"
TRACEBACK = "Traceback (most recent call last):"  # what Python writes first: a traceback is read from it on
# torch's words for a CUDA out-of-memory error (c10/cuda/CUDACachingAllocator.cpp, torch 2.13): no GPU here to make one
CUDA_OOM = ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
            "79.19 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process has 78.12 GiB memory in use."]


def log(name: str) -> list[str]:
    return (LOGS / f"{name}.log").read_text().splitlines()


# (log, code, permanent, the reason's text, a word of its fix)
LINE_CASES = [
    ("bad-arguments", "bad-arguments", True,
     "bad arguments to the training script: unrecognized arguments: --bogus 1", "--train-args"),
    ("bad-argument-value", "bad-arguments", True,
     "bad arguments to the training script: argument --epochs: invalid int value: 'lots'", "TRAIN_ARGS"),
    ("data-missing", "data-missing", True,
     "data missing: data folder /tmp/capture/empty/train is missing or empty", "invoke elasticjob.data"),
    ("data-layout", "data-missing", True,
     "data laid out wrong: /tmp/capture/flat/val holds files, not class folders", "--relayout-val"),
    ("bad-checkpoint", "bad-checkpoint", True,
     "unusable checkpoint: checkpoint /tmp/capture/ck/step-2 is partial or corrupt and there is no earlier one "
     "(RuntimeError: Missing key in checkpoint state_dict: doeks_meta.): move /tmp/capture/ck away to start from scratch",
     "--fresh"),
    ("import-error", "import-error", True,
     "import error: ModuleNotFoundError: No module named 'doeks_no_such_module' (/tmp/capture/uses_timm.py, line 2, "
     "in <module>)", "elasticjob/Dockerfile"),
    ("missing-file", "missing-file", True,
     "missing file: FileNotFoundError: [Errno 2] No such file or directory: '/fsx-shared/data/labels.json' "
     "(/tmp/capture/reads.py, line 1, in <module>)", "SHARED_MOUNT"),
    ("no-script", "missing-file", True,
     "missing file: can't open file '/tmp/capture/not-there.py': [Errno 2] No such file or directory", "--train-args"),
    ("exception-in-script", "exception", True,
     "the script raised ValueError: lr must be positive, got -1 (/tmp/capture/mine.py, line 3, in check)", "fix the script"),
    ("worker-failed-under-torchrun", "exception", True,
     "the script raised ValueError: lr must be positive, got -1 (/tmp/capture/mine.py, line 3, in check)",
     "elasticjob.logs"),
    ("no-memory", "oom", False, "out of memory: Cannot allocate memory", "BATCH_SIZE"),
    ("etcd-unreachable", "rendezvous", False, "rendezvous server unreachable", "invoke eks.create"),
    ("etcd-lost-mid-job", "rendezvous", False, "rendezvous server unreachable", "<JOB_NAME>-etcd"),
]


@pytest.mark.parametrize("name,code,permanent,text,fix", LINE_CASES, ids=[c[0] for c in LINE_CASES])
def test_each_line_rule_names_what_a_real_program_wrote(name, code, permanent, text, fix):
    found = reasons.from_lines(log(name))
    assert (found.code, found.permanent, found.text) == (code, permanent, text)
    assert fix in found.fix and found.line() == f"{text} (fix: {found.fix})"
    assert reasons.classify(log(name), [1], failed=True) == found  # a line beats an exit code and a failed job


def test_a_cuda_out_of_memory_error_is_transient():
    found = reasons.from_lines(CUDA_OOM)
    assert (found.code, found.permanent) == ("oom", False) and found.fix == reasons.OOM_FIX
    assert found.text == "out of memory: " + CUDA_OOM[0][:200]  # a reason line keeps the first 200 characters
    # raised through the script's own frames (its forward pass), still memory, not the script's bug (issue 32's
    # reading of the script's exceptions made every traceback permanent)
    raised = reasons.from_lines([TRACEBACK, '  File "/workspace/fit.py", line 40, in main', "    out = model(x)"] + CUDA_OOM)
    assert (raised.code, raised.permanent) == ("oom", False)


def test_a_real_gpus_out_of_memory_under_torchrun_is_out_of_memory():
    """Captured on an H200 (torch 2.11.0+cu130): a user's script asks cudaMalloc for 400 GiB under torchrun; the log
    holds the script's traceback, torch's OutOfMemoryError and torchrun's own ChildFailedError after it."""
    found = reasons.from_lines(log("cuda-oom-under-torchrun"), roots=["/tmp/capture"])
    assert (found.code, found.permanent, found.fix) == ("oom", False, reasons.OOM_FIX)
    assert found.text.startswith("out of memory: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 400.00 GiB")


def test_the_cuda_runtimes_own_out_of_memory_is_out_of_memory_too():
    """`CUDA error: out of memory` is the CUDA runtime's wording (a kernel launch or cudaMalloc outside torch's
    allocator: NCCL's buffers, a library's workspace): memory as well, with the batch-size fix."""
    line = "RuntimeError: CUDA error: out of memory"
    found = reasons.from_lines([line, "CUDA kernel errors might be asynchronously reported at some other API call"])
    assert (found.code, found.permanent, found.fix) == ("oom", False, reasons.OOM_FIX)
    raised = reasons.from_lines([TRACEBACK, '  File "/workspace/fit.py", line 40, in main', "    out = model(x)", line])
    assert (raised.code, raised.permanent) == ("oom", False)


# older torch's words for it, a RuntimeError (c10/cuda/CUDACachingAllocator.cpp, torch 1.13), as older code and
# libraries still raise it
OLD_CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.19 GiB total capacity; 77.12 GiB already "
                "allocated; 1.06 GiB free; 78.00 GiB reserved in total by PyTorch)")


def test_a_cuda_out_of_memory_runtime_error_is_memory_not_the_scripts_bug(tmp_path):
    """`RuntimeError: CUDA out of memory` (older torch, and code that raises it by hand) is out of memory by its words,
    not by its type: raised by the script's own frame, or by a library's the same after a restart, it is a transient
    "lower BATCH_SIZE", not the script's permanent error ("fix the script"). Real tracebacks: the script and an
    installed library, run by Python."""
    import subprocess
    import sys

    library = tmp_path / "site-packages"
    library.mkdir()
    (library / "oldtorch.py").write_text(f"def forward(x):\n    raise RuntimeError({OLD_CUDA_OOM!r})\n")
    (tmp_path / "fit.py").write_text(
        "import sys, oldtorch\n"
        "def step():\n"
        "    try:\n"
        "        oldtorch.forward(1)\n"
        "    except RuntimeError as error:  # the script's own raise, with the library's words\n"
        "        raise RuntimeError(str(error)) from None\n"
        "step() if sys.argv[1] == 'mine' else oldtorch.forward(1)\n")

    def run(how: str) -> list[str]:
        result = subprocess.run([sys.executable, str(tmp_path / "fit.py"), how], capture_output=True, text=True,
                                timeout=60, env={**os.environ, "PYTHONPATH": str(library)})
        assert result.returncode == 1 and result.stderr.startswith(TRACEBACK), result.stderr
        return result.stderr.splitlines()

    mine, library_s = run("mine"), run("library")
    assert mine[-1] == library_s[-1] == f"RuntimeError: {OLD_CUDA_OOM}"
    restarted = library_s + ["doeks: worker group failed (exit codes [1]): torchrun restarts it (1 of 10)"] + library_s
    for lines in (mine, restarted):
        found = reasons.from_lines(lines)
        assert (found.code, found.permanent, found.fix) == ("oom", False, reasons.OOM_FIX), found
        assert found.text == "out of memory: " + OLD_CUDA_OOM[:200]  # (a reason keeps 200 characters)
        assert reasons.tracebacks(lines).permanent() is None  # what doeks' torchrun and the targets ask first
    # another message from the same raise is the script's: the rule is memory's words, not any RuntimeError
    other = [line.replace(OLD_CUDA_OOM, "shapes do not match") for line in mine]
    assert reasons.from_lines(other).code == "exception" and reasons.from_lines(other).permanent


def test_every_rule_has_a_case_here():
    """A rule added to reasons.py without a real log here fails this: each line rule is the first to match one case."""
    matched = set()
    for lines in [log(c[0]) for c in LINE_CASES] + [CUDA_OOM]:
        for line in lines:
            index = next((i for i, rule in enumerate(reasons._LINE_RULES) if rule[2].search(line)), None)
            if index is not None:
                matched.add(index)
    assert matched == set(range(len(reasons._LINE_RULES)))
    assert {e[0] for e in EVENT_CASES} == set(reasons._EVENT_RULES)


def test_a_sagemaker_failure_reason_loses_its_closing_quote():
    """SageMaker's FailureReason quotes the script's last error (the training toolkit's ExecuteUserScriptError)."""
    from .test_status_sagemaker import FAILURE

    failure = FAILURE.splitlines()
    assert failure[-2].endswith('--bogus 1"')
    assert reasons.classify(failure, failed=True).text == \
        "bad arguments to the training script: unrecognized arguments: --bogus 1"
    # only the quote goes, not a last character of the message that happens to be one of its neighbours
    assert reasons.from_lines(['ErrorMessage "usage: train.py', 'train.py: error: unrecognized arguments: --size 4X"']).text \
        == "bad arguments to the training script: unrecognized arguments: --size 4X"


def test_an_exception_a_library_raised_is_not_the_scripts_bug():
    """The same ValueError, raised in the standard library (its frame last in the traceback): a restart may pass, so
    no permanent reason; a failed job names it as its last error."""
    lines = log("exception-in-library")
    assert reasons.from_lines(lines) is None
    failed = reasons.classify(lines, [1], failed=True)
    assert (failed.code, failed.permanent) == ("failed", False)
    assert failed.text == "failed (exit 1): ValueError: Invalid literal for Fraction: 'one half' (/tmp/capture/lib.py, line 2, in <module>)"
    # a frame of an installed package, of the interpreter's frozen modules: not the script's either
    for frame in ('  File "/usr/lib/python3/dist-packages/x.py", line 1, in f', '  File "<frozen runpy>", line 88, in _run_code'):
        assert reasons.from_lines([frame, "ValueError: boom"]) is None
    assert reasons.from_lines(["ValueError: boom"]) is None  # no traceback at all: no frame of the script's
    assert reasons.from_lines([TRACEBACK, '  File "/opt/ml/code/mine.py", line 3', "ValueError: boom"]).permanent
    # Fedora's and RHEL's interpreter keeps installed packages in lib64 (no "/lib/python" in the path)
    assert reasons.from_lines(['  File "/usr/lib64/python3.11/site-packages/x.py", line 1, in f', "ValueError: b"]) is None
    # a traceback is read from its first line on (issue 32's reading): frames without it are no exception's
    assert reasons.from_lines(['  File "/opt/ml/code/mine.py", line 3', "ValueError: boom"]) is None


def test_a_permanent_line_wins_over_transient_ones_wherever_it_is():
    for lines in (log("etcd-lost-mid-job") + log("bad-arguments"), log("bad-arguments") + log("etcd-lost-mid-job")):
        assert reasons.from_lines(lines).code == "bad-arguments"
    # the script's own exception before any line rule (issue 32: it is what the user must fix), else the first one
    for lines in (log("data-missing") + log("import-error"), log("import-error") + log("data-missing")):
        assert reasons.from_lines(lines).code == "import-error"
    assert reasons.from_lines(log("data-missing") + log("no-script")).code == "data-missing"
    # of transient ones, the last
    assert reasons.from_lines(log("no-memory") + log("etcd-unreachable")).code == "rendezvous"
    assert reasons.from_lines(log("etcd-unreachable") + log("no-memory")).code == "oom"
    # and a transient line wins over a transient event (a line says more)
    found = reasons.classify(log("etcd-lost-mid-job"), events=["FailedScheduling"])
    assert found.code == "rendezvous"
    assert reasons.classify(log("bad-arguments"), events=["OOMKilled"]).code == "bad-arguments"


# (event or container-state reason, code, text)
EVENT_CASES = [
    ("OOMKilled", "oom", "out of memory: a container was OOM-killed (OOMKilled)"),
    ("ErrImagePull", "image", "the training image cannot be pulled (ErrImagePull)"),
    ("ImagePullBackOff", "image", "the training image cannot be pulled (ImagePullBackOff)"),
    ("FailedScheduling", "unschedulable", "pods cannot be scheduled (FailedScheduling)"),
    ("FailedMount", "volume", "the shared volume cannot be mounted (FailedMount)"),
]


@pytest.mark.parametrize("event,code,text", EVENT_CASES, ids=[c[0] for c in EVENT_CASES])
def test_each_event_rule(event, code, text):
    found = reasons.from_events(["Scheduled", "Pulling", event, "BackOff"])
    assert (found.code, found.text, found.permanent) == (code, text, False)
    assert found.fix == reasons._EVENT_RULES[event][3] and found.fix
    assert reasons.classify([], [], [event]) == found


def test_the_newest_event_is_the_reason():
    """A pod first FailedScheduling while its claim was binding, then FailedMount, is stuck on the mount."""
    assert reasons.from_events(["FailedScheduling", "FailedMount"]).code == "volume"
    assert reasons.from_events(["FailedMount", "FailedScheduling"]).code == "unschedulable"
    assert reasons.from_events(["Scheduled", "Started", "BackOff", ""]) is None


def test_exit_codes_restarts_and_failure_without_a_known_cause():
    assert reasons.classify(["step=3 epoch=0 loss=1.2"], [0]) is None  # healthy
    for code in (137, -9):  # the OOM killer's SIGKILL, as a container's exit code and as a process's
        killed = reasons.classify([], [0, code])
        assert killed == reasons.Reason("oom", "a process was killed (exit 137, SIGKILL: out of memory, or killed by hand)",
                                        "if nobody killed it: " + reasons.OOM_FIX, False)
    assert reasons.classify([], [None, 1]) is None  # a failed exit alone, the job still running: no reason yet
    lines = log("exception-in-library")
    assert reasons.classify(lines, [1], restarts=reasons.CRASH_LOOP_RESTARTS - 1) is None
    loop = reasons.classify(lines, [1], restarts=reasons.CRASH_LOOP_RESTARTS)
    assert (loop.code, loop.permanent) == ("crash-loop", False)
    assert loop.text == "crash loop: 3 restarts, last error: ValueError: Invalid literal for Fraction: 'one half' " \
        "(/tmp/capture/lib.py, line 2, in <module>)"
    assert loop.fix == f"{reasons.LOGS_FIX}; fix the cause, then `invoke elasticjob.deploy`"
    assert reasons.classify([], events=["CrashLoopBackOff"]).text == "crash loop: 0 restarts"
    failed = reasons.classify([], [None, 0, 2], failed=True)
    assert (failed.text, failed.fix) == \
        ("failed (exit 2)", f"{reasons.LOGS_FIX} (`invoke elasticjob.logs --tail 50`: the end of each node's log)")
    assert reasons.classify([], [], failed=True).text == "failed"


def test_the_last_error_is_the_scripts_not_torchruns_summary():
    assert reasons.last_error(log("worker-failed-under-torchrun")) == \
        "ValueError: lr must be positive, got -1 (/tmp/capture/mine.py, line 3, in check)"
    # (python-etcd's EtcdConnectionFailed does not end in Error: the last line that does is urllib3's)
    assert reasons.last_error(log("etcd-lost-mid-job")).startswith("urllib3.exceptions.MaxRetryError: HTTPConnectionPool")
    # torchrun's own exception only when there is no other; then a line naming an error, never its table's lines
    assert reasons.last_error(["torch.distributed.elastic.rendezvous.api.RendezvousClosedError", "exitcode  : 1"]) == \
        "torch.distributed.elastic.rendezvous.api.RendezvousClosedError"
    assert reasons.last_error(["error_file: <N/A>", "loader: error reading a file", "traceback : see"]) == \
        "loader: error reading a file"
    child = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: "  # torchrun's line, as it writes it
    assert reasons.last_error(["loader: Error reading a file", child]) == "loader: Error reading a file"
    assert reasons.last_error([child + "worker 0 failed", "RendezvousClosedError: closed"]) == \
        "RendezvousClosedError: closed"
    assert reasons.last_error(["step=1", "done"]) == ""
    # a prefix in brackets (a replica's name) is not part of the error; brackets inside the message are
    assert reasons.last_error(["[node-0] ValueError: shape [3, 4] ] is not [4, 3]", "[node-0] exiting"]) == \
        "ValueError: shape [3, 4] ] is not [4, 3]"
    long = "ValueError: " + "x" * 300
    assert reasons.last_error([long]) == long[:200] and reasons.last_error(["failed: " + long]) == ("failed: " + long)[:200]
    assert reasons.last_error([child + "x" * 300]) == ""
    torchrun_own = "torch.distributed.elastic.rendezvous.api.RendezvousClosedError: " + "y" * 300
    assert reasons.last_error([torchrun_own]) == torchrun_own[:200]
    # a prefix with a space in it (a replica's label) goes as a whole
    assert reasons.last_error(["[node 0] ValueError: boom"]) == "ValueError: boom"
    # torchrun's table when the worker left an error file: its path names "error", the line is no error
    assert reasons.last_error(["loader: error reading a file",
                               "  error_file: /tmp/torchelastic_4k2x/none_ab12/attempt_0/0/error.json"]) == \
        "loader: error reading a file"


# -- where reasons are derived: the kubernetes target's reading of pods, events and logs --------------------------
UNSCHEDULABLE = ("0/1 nodes are available: 1 Insufficient nvidia.com/gpu. preemption: 0/1 nodes are available: 1 No "
                 "preemption victims found for incoming pod.")


def _pod(name: str, phase: str, state: dict, restarts: int = 0, last: dict | None = None, conditions=None) -> dict:
    status = {"name": "pytorch", "restartCount": restarts, "ready": "running" in state, "started": "running" in state,
              "image": "doeks-train:does-not-exist", "imageID": "", "state": state, "lastState": last or {}}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "labels": {"doeks/job": "imagenet"}},
            "spec": {"nodeName": "doeks"} if phase != "Pending" or state else {},
            "status": {"phase": phase, "conditions": conditions or [],
                       **({"containerStatuses": [status]} if state else {})}}


def _event(obj: str, reason: str, message: str, component: str, count: int = 1) -> dict:
    return {"apiVersion": "v1", "kind": "Event", "type": "Warning", "reason": reason, "message": message, "count": count,
            "source": {"component": component}, "metadata": {"name": f"{obj}.1", "namespace": "default"},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": obj, "namespace": "default"},
            "firstTimestamp": "2026-11-25T21:00:00Z", "lastTimestamp": "2026-11-25T21:00:05Z"}


# case: (pods, events, the reason, the replica's state, the PyTorchJob's last condition: the training operator v1.9
# sets Created when it makes the pods and Running once they run)
POD_CASES = {
    "unschedulable": (
        [_pod("imagenet-worker-0", "Pending", {}, conditions=[{"type": "PodScheduled", "status": "False",
                                                                "reason": "Unschedulable", "message": UNSCHEDULABLE}])],
        [_event("imagenet-worker-0", "FailedScheduling", UNSCHEDULABLE, "default-scheduler", 3)],
        "pods cannot be scheduled (FailedScheduling)", "Pending", "Created"),
    "image": (
        [_pod("imagenet-worker-0", "Pending", {"waiting": {
            "reason": "ImagePullBackOff", "message": 'Back-off pulling image "doeks-train:does-not-exist": ErrImagePull: '
            'failed to pull and unpack image "docker.io/library/doeks-train:does-not-exist": failed to resolve '
            'reference "docker.io/library/doeks-train:does-not-exist": failed to do request: Head '
            '"https://registry-1.docker.io/v2/library/doeks-train/manifests/does-not-exist": proxyconnect tcp: dial tcp '
            '127.0.0.1:9: connect: connection refused'}})],
        [_event("imagenet-worker-0", "Failed", 'Failed to pull image "doeks-train:does-not-exist": failed to pull and '
                'unpack image "docker.io/library/doeks-train:does-not-exist"', "kubelet", 2),
         _event("imagenet-worker-0", "Failed", "Error: ErrImagePull", "kubelet", 2),
         _event("imagenet-worker-0", "BackOff", 'Back-off pulling image "doeks-train:does-not-exist"', "kubelet", 4),
         _event("imagenet-worker-0", "Failed", "Error: ImagePullBackOff", "kubelet", 4)],
        "the training image cannot be pulled (ImagePullBackOff)", "Pending", "Created"),
    "oom": (
        [_pod("imagenet-worker-0", "Running", {"waiting": {
            "reason": "CrashLoopBackOff", "message": "back-off 20s restarting failed container=pytorch "
            "pod=imagenet-worker-0_default(0c5e)"}}, restarts=2,
            last={"terminated": {"exitCode": 137, "reason": "OOMKilled", "startedAt": "2026-11-25T21:00:01Z",
                                 "finishedAt": "2026-11-25T21:00:04Z", "containerID": "containerd://ab12"}})],
        [_event("imagenet-worker-0", "BackOff", "Back-off restarting failed container pytorch in pod "
                "imagenet-worker-0_default(0c5e)", "kubelet", 2)],
        "out of memory: a container was OOM-killed (OOMKilled)", "Restarting", "Running"),
    "volume": (
        [_pod("imagenet-worker-0", "Pending", {"waiting": {"reason": "ContainerCreating"}})],
        [_event("imagenet-worker-0", "FailedMount", 'MountVolume.SetUp failed for volume "nomount" : hostPath type '
                "check failed: /nonexistent/doeks-test is not a directory", "kubelet", 5)],
        "the shared volume cannot be mounted (FailedMount)", "Pending", "Created"),
}


@pytest.fixture
def world(state_dir, tmp_path, monkeypatch):
    """A small job's settings and the scripted kubectl on PATH (tests/test_targets.py's, without its moto server:
    reading a job's status asks AWS nothing)."""
    import os
    import sys

    from doeks import settings as S

    for key, value in TINY.items():
        monkeypatch.setenv(key, value)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").write_text(f"#!/bin/sh\nexec {sys.executable} {STANDIN} \"$@\"\n")
    (bin_dir / "kubectl").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("KUBECTL_SCRIPT", str(tmp_path / "kubectl.json"))
    monkeypatch.setenv("RECORD", str(tmp_path / "record.jsonl"))
    S.reset()
    return {"script": tmp_path / "kubectl.json"}


@pytest.fixture
def cluster(world):
    from .test_targets import pytorchjob_json

    def answer(pods: list, events: list, logs: str = "", state: str = "Running"):
        world["script"].write_text(json.dumps([
            {"match": ["get", "pytorchjob"], "stdout": pytorchjob_json(state)},
            {"match": ["get", "pods"], "stdout": json.dumps({"apiVersion": "v1", "kind": "List", "items": pods})},
            {"match": ["get", "events"], "stdout": json.dumps({"apiVersion": "v1", "kind": "List", "items": events})},
            {"match": ["logs"], "stdout": logs}]))

    return answer


@pytest.mark.parametrize("case", list(POD_CASES))
def test_the_kubernetes_targets_reason_from_pods_and_events(cluster, case):
    from doeks import targets

    pods, events, text, state, condition = POD_CASES[case]
    cluster(pods, events + [_event("another-job-worker-0", "OOMKilled", "not this job's", "kubelet")], state=condition)
    status = targets.get(settings_for("eks")).describe()
    assert status.reason == text and not status.permanent
    assert status.replicas[0].state == state


def test_the_kubernetes_targets_permanent_reason_from_a_running_pods_log(cluster):
    """A permanent error in the log of a pod the kubelet still calls Running: torchrun would only retry it."""
    from doeks import targets

    cluster([_pod("imagenet-worker-0", "Running", {"running": {"startedAt": "2026-11-25T21:00:01Z"}})], [],
            logs="".join(f"[pod/imagenet-worker-0/pytorch] {line}\n" for line in log("data-missing")))
    status = targets.get(settings_for("eks")).describe()
    assert status.permanent and status.reason == "data missing: data folder /tmp/capture/empty/train is missing or empty"


def test_a_trainjob_the_api_server_refuses_is_named_with_jobsets_words(world):
    """JobSet records JobCreationFailed with the API server's refusal when the TrainJob's pod template is invalid
    (its words on doeks' cluster: tests/test_kubernetes_cluster.py): permanent, before any pod exists."""
    from doeks import settings as S
    from doeks import trainjob

    refusal = ('Job.batch "tj-node-0" is invalid: spec.template.spec.containers[0].volumeMounts[1].name: Not found: '
               '"dshm"')
    job = {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": {"name": "imagenet"},
           "status": {"conditions": []}}
    event = _event("imagenet", reasons.JOB_CREATION_FAILED, refusal, "jobset")
    event["involvedObject"] = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "name": "imagenet"}
    world["script"].write_text(json.dumps([
        {"match": ["get", "trainjob"], "stdout": json.dumps(job)},
        {"match": ["get", "pods"], "stdout": json.dumps({"items": []})},
        {"match": ["get", "events"], "stdout": json.dumps({"items": [event]})}]))
    found = trainjob.diagnose(S.current())
    assert (found.code, found.permanent) == ("refused", True)
    assert found.text == f"the JobSet cannot create its Jobs: {refusal}" and found.fix == reasons.REFUSED_FIX
    # the same TrainJob, its pods unschedulable: the event rule, through diagnose
    pods = POD_CASES["unschedulable"][0]
    world["script"].write_text(json.dumps([
        {"match": ["get", "trainjob"], "stdout": json.dumps(job)},
        {"match": ["get", "pods"], "stdout": json.dumps({"items": pods})},
        {"match": ["get", "events"], "stdout": json.dumps({"items": POD_CASES["unschedulable"][1]})}]))
    assert trainjob.diagnose(S.current()).text == "pods cannot be scheduled (FailedScheduling)"


@pytest.mark.slow  # ~15 s: the training script, torch and torchrun run once for each log
def test_the_logs_here_are_what_the_programs_write_now(tmp_path):
    """The fixtures again from the real programs (capture.py, into a temp folder): each gives the same reason as its
    committed copy, so a changed message in the training script or a new torch is seen here, not on a cluster."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("capture", LOGS / "capture.py")
    capture = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(capture)
    fresh = capture.cases(tmp_path)
    # not made again here: an etcd killed mid-job (a cluster), a real GPU's out of memory (captured on an H200)
    assert set(fresh) == {p.stem for p in LOGS.glob("*.log")} - {"etcd-lost-mid-job", "cuda-oom-under-torchrun"}
    for name, text in fresh.items():
        now = reasons.from_lines(text.splitlines())
        assert now == reasons.from_lines(log(name)), name


def test_training_arguments_are_checked_with_the_scripts_own_parser():
    """check_train_args, what every target's plan runs before anything starts (through the CLI: test_status_local)."""
    from doeks.errors import DoeksError

    assert check_train_args([]) is None and check_train_args(["--epochs", "3", "--lr", "0.1"]) is None
    with pytest.raises(DoeksError) as bad:
        check_train_args(["--bogus", "1"])
    assert str(bad.value) == ("--train-args '--bogus 1': train.py: error: unrecognized arguments: --bogus 1 "
                              "(`python doeks/workload/train.py --help` lists its arguments)")
    with pytest.raises(DoeksError, match=r"^--train-args '--epochs lots': train.py: error: argument --epochs: invalid int"):
        check_train_args(["--epochs", "lots"])
    with pytest.raises(DoeksError) as helped:
        check_train_args(["--epochs", "1", "--help"])
    assert str(helped.value) == "--train-args '--epochs 1 --help': not a training run (--help exits)"
