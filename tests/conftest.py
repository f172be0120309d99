"""Shared fixtures: an isolated state folder and a helper that runs `invoke` as a user would."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = Path(os.environ.get("DOEKS_SCHEMAS", ROOT.parent / "shared" / "schemas"))
# Where each schema is in the upstream Go module `invoke setup --kubernetes` downloads (a clone without
# ../shared/schemas reads them there): (module, version, path in the module)
UPSTREAM_SCHEMAS = {
    "eksctl-clusterconfig-v1alpha5.schema.json": ("github.com/weaveworks/eksctl", "v0.215.0",
                                                  "pkg/apis/eksctl.io/v1alpha5/assets/schema.json"),
    "kubeflow.org_pytorchjobs.crd.yaml": ("github.com/kubeflow/training-operator", "v1.9.4",
                                          "manifests/base/crds/kubeflow.org_pytorchjobs.yaml"),
    "kubeflow.org_mpijobs-v2beta1.crd.yaml": ("github.com/kubeflow/mpi-operator", "v0.8.0",
                                              "manifests/base/kubeflow.org_mpijobs.yaml"),
    "trainer.kubeflow.org_trainjobs-v2.3.0.crd.yaml": ("github.com/kubeflow/trainer/v2", "v2.3.0",
                                                       "manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml"),
}


def shared_fixture(name: str) -> Path:
    """A recording kept in the project's shared/ folder (../shared/fixtures), not in a clone: skipped with one line
    where it is missing."""
    path = SCHEMAS.parent / "fixtures" / name
    if not path.is_file():
        pytest.skip(f"{path} missing: a recording from a real run, kept in the project's shared/ folder only")
    return path


def schema_path(name: str) -> Path:
    """An upstream schema: ../shared/schemas/NAME where the checkout has it, else the same file in its upstream Go
    module in the module cache (`invoke setup --kubernetes` downloads them; nothing is fetched here); otherwise the
    test is skipped with one line naming what is missing."""
    if (SCHEMAS / name).is_file():
        return SCHEMAS / name
    module, version, inside = UPSTREAM_SCHEMAS[name]
    import subprocess

    try:
        cache = subprocess.run(["go", "env", "GOMODCACHE"], capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError:
        cache = ""
    escaped = "".join(f"!{c.lower()}" if c.isupper() else c for c in module)
    found = Path(cache) / f"{escaped}@{version}" / inside if cache else None
    if found is not None and found.is_file():
        return found
    if os.environ.get("CI") and module != "github.com/weaveworks/eksctl":
        pytest.fail(f"schema {name} missing: {SCHEMAS} has none and {module}@{version} is not in the Go module "
                    "cache (`invoke setup --kubernetes` downloads it)")
    pytest.skip(f"schema {name} missing: no {SCHEMAS / name} and no {module}@{version} in the Go module cache "
                f"(`invoke setup --kubernetes` downloads it)")


def _threads_of(pid: int) -> str:
    """Each thread of a process: its name, state (R, S, D: in the kernel, uninterruptible), where it waits and its
    signals pending and blocked (a SIGTERM taken by a thread other than the main one does not wake the main one)."""
    said = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            stat = (task / "stat").read_text()
            wchan = (task / "wchan").read_text()
            signals = {k: v.strip() for k, v in (line.split(":", 1) for line in (task / "status").read_text().splitlines())
                       if k in ("SigPnd", "ShdPnd", "SigBlk")}
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        said.append(f"thread {task.name} {name!r}: state {rest[0]}, waits in {wchan or '-'}, {signals}")
    return "\n".join(said)


def _stuck(pid: int) -> str:
    """What a task that ran past its test's limit was doing: its processes, their threads (_threads_of) and, where
    py-spy is installed, their Python stacks (an intermittent hang is seen once in a CI log, and only this says where)."""
    import shutil

    from doeks.local import jobs

    said = []
    for each in [pid, *jobs.descendants(pid)]:
        try:
            command = Path(f"/proc/{each}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            continue
        said.append(f"--- process {each}: {command}")
        said.append(_threads_of(each))
        if shutil.which("py-spy") and "python" in command:
            dump = subprocess.run(["py-spy", "dump", "--pid", str(each)], capture_output=True, text=True, timeout=30)
            said.append((dump.stdout or dump.stderr)[-3000:])
    return "\n".join(said)


def invoke(*args: str, env: dict | None = None, timeout: float = 600, check: bool = False,
           cwd: Path = ROOT) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    process = subprocess.Popen([sys.executable, "-m", "invoke", *args], cwd=cwd, env=full_env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stuck = _stuck(process.pid)
        process.kill()
        stdout, stderr = process.communicate()
        raise AssertionError(f"invoke {' '.join(args)} did not end in {timeout:.0f} s; its output ends:\n"
                             f"{stderr[-6000:]}\n{stdout[-2000:]}\nits processes then:\n{stuck}") from None
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    if check and result.returncode != 0:
        raise AssertionError(f"invoke {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def wait_for(predicate, timeout: float, what: str, poll: float = 0.2):
    """The predicate's first truthy value, or an AssertionError naming what did not happen in time."""
    from doeks.waiting import until

    return until(predicate, timeout, what, poll=poll, error=AssertionError)


def training_processes(*roots: int) -> list[int]:
    """Pids of the training script's processes (workers) under these processes: a local node's agent, or a container's
    init; a process that ends while it is being read is left out."""
    from doeks.local import jobs

    found = []
    for root in roots:
        for pid in jobs.descendants(root):
            try:
                if "train.py" in open(f"/proc/{pid}/cmdline").read():
                    found.append(pid)
            except OSError:
                pass
    return found


def job_settings(values: dict[str, str], monkeypatch):
    """Settings of a small job (its .env keys set in the environment) with its synthetic data made."""
    from doeks import elastic
    from doeks import settings as S
    from doeks.runner import Runner

    for key, value in values.items():
        monkeypatch.setenv(key, value)
    S.reset()
    s = S.current()
    elastic.make_data(s, Runner(echo=False))
    return s


@pytest.fixture(scope="session")
def docker_client():
    """The local docker daemon with the base image `invoke setup --docker` makes (what every image here builds on).
    CI always has both: there a missing one fails the test; elsewhere it is skipped."""
    from doeks import machine

    if not machine.docker_reachable():
        if os.environ.get("CI"):
            pytest.fail("CI must have a docker daemon: `invoke setup --docker` should have started one")
        pytest.skip("no docker daemon reachable (invoke setup --docker)")
    import docker

    client = docker.from_env(timeout=600)  # removing an image on vfs storage takes a while
    try:
        client.images.get(machine.BASE_IMAGE)
    except docker.errors.ImageNotFound:
        if os.environ.get("CI"):
            pytest.fail(f"base image {machine.BASE_IMAGE} missing: `invoke setup --docker` makes it")
        pytest.skip(f"base image {machine.BASE_IMAGE} missing (invoke setup --docker)")
    return client


SESSION_KUBECONFIG = os.environ.get("KUBECONFIG")  # as the run was started, before any test's connect


@pytest.fixture(autouse=True)
def no_machine_cluster(request, tmp_path_factory, monkeypatch):
    """Outside the `kubernetes` mark a test sees no doeks cluster: doeks' own cluster is one per machine, and its
    folder (doeks.cluster.versions.cluster_dir: certificates, kubeconfig, what `up --dry-run` reads to say what it
    would keep) points at an empty one of this test run, so a cluster another run or user has up is neither read nor
    changed (TARGET=kubernetes plans read it: with a job of another run holding the claim they said otherwise)."""
    if request.node.get_closest_marker("kubernetes") is None:
        monkeypatch.setenv("DOEKS_CLUSTER_DIR", str(tmp_path_factory.getbasetemp() / "no-cluster"))
        # a target's connect run in this process points KUBECONFIG at its cluster (doeks.kube.use/use_only), in a
        # test or in a cluster module's fixture: each test starts from the session's own KUBECONFIG, or the next ones'
        # commands carry that kubeconfig (KUBECONFIG decides the cluster, the image, the plan: CI once failed 2 tests
        # that ran after the cluster modules, and passed them alone)
        monkeypatch.setenv("KUBECONFIG", SESSION_KUBECONFIG or "")
        if SESSION_KUBECONFIG is None:
            monkeypatch.delenv("KUBECONFIG")
    yield


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    """A fresh STATE_DIR for the test, also exported for `invoke` subprocesses; stops what it started."""
    folder = tmp_path / "state"
    monkeypatch.setenv("STATE_DIR", str(folder))
    from doeks import settings

    settings.reset()
    yield folder
    from doeks import services
    from doeks.local import jobs

    for home in (folder / "jobs").glob("*") if (folder / "jobs").exists() else []:
        jobs.stop(home)
    for server in services.services(folder):
        server.stop()
    settings.reset()


@pytest.fixture(scope="session")
def cluster_state(tmp_path_factory):
    """The state folder of the test run's one cluster (kubernetes-sigs e2e style: one cluster per run). doeks' own
    cluster is one per machine, and its claim's volume is a folder under STATE_DIR, so every cluster module shares
    this folder; the modules start the cluster with `up`/`eks.create` (a second one keeps it) and clean up their own
    jobs. The run starts with none: a cluster an earlier run left (one killed before its end: the cluster's state
    outlives it) would carry that run's pods and volumes. At the end `invoke down` stops it (again: the `cluster_down`
    tests already did, twice)."""
    state = tmp_path_factory.mktemp("cluster") / "state"
    env = {"TARGET": "kubernetes", "STATE_DIR": str(state), "KUBECONFIG": ""}
    invoke("down", "--yes", env=env, timeout=900)
    yield state
    invoke("down", "--yes", env=env, timeout=900)


WORKERS = 2  # one for the cluster's tests, one for the rest beside them (docs/testing.md, "CI")
# The modules run by the cluster's worker: every one with a `kubernetes` test (checked at collection), every
# test_rehearsal_* (its registry and IAM too) and those that act on the machine's network namespaces, which the
# cluster's nodes use
CLUSTER_MODULES = frozenset({
    "test_kubernetes_cluster.py", "test_kubernetes_faults.py", "test_kubernetes_jobs.py", "test_kubernetes_kueue.py",
    "test_kubernetes_mpi.py", "test_kubernetes_pipeline.py", "test_kubernetes_sdk.py", "test_netns_dir.py",
    "test_network_guard.py"})


def in_cluster_group(module: str) -> bool:
    name = Path(module).name
    return name in CLUSTER_MODULES or name.startswith("test_rehearsal_")


def scope(nodeid: str) -> str:
    """The group of a test under `--dist loadgroup`: "cluster", or its module's path."""
    module = nodeid.split("::", 1)[0]
    return "cluster" if in_cluster_group(module) else module


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """A whole-suite run (no paths given) goes on two workers (pytest-xdist, `--dist loadgroup`); paths, `-n 0`,
    `-p no:xdist`, `--pdb`, `--collect-only` and `--fixtures` run in this process as before."""
    option = config.option
    if not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput"):
        return
    if (config.args_source == pytest.Config.ArgsSource.TESTPATHS and option.numprocesses is None
            and option.dist == "no" and not option.distload and not option.collectonly and not option.usepdb
            and not option.showfixtures and not option.show_fixtures_per_test and (os.cpu_count() or 1) >= WORKERS):
        option.numprocesses, option.dist = WORKERS, "loadgroup"
    if option.dist == "loadgroup":
        option.loadscopereorder = False  # groups in collection order: the cluster's, the longest, first


def pytest_configure(config):
    """Before the workers start, the loader's _jpegcrop is built in the checkout where it can be, as CI's `invoke
    setup` leaves it: otherwise the README walk-through's `invoke setup` compiles it into the checkout in one worker
    while a job of the other trains with the loader (a pipeline's local job hung in its DataLoader right after)."""
    if hasattr(config, "workerinput") or config.getoption("dist", "no") == "no":
        return
    from doeks.workload import jpegcrop_build

    if not jpegcrop_build.missing() and not jpegcrop_build.up_to_date():
        jpegcrop_build.build(quiet=True)


@pytest.hookimpl(optionalhook=True)  # `-p no:xdist`: no such hook
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` here: the cluster's modules are one group (one worker, in file order), every other module
    a group of its own (its module fixtures made once, its tests in file order: they share job and container names).
    By module name, not xdist_group marks: xdist 3.8 drops those on pytest 9.2 (pytest-xdist issue 1386)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope(nodeid)

    return ByModule(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Tests marked `cluster_down` stop the run's one cluster: they run right after every other cluster test (so
    the tests after them run on a machine with no cluster idling), in their own order. In an xdist worker the
    cluster's modules come first (the scheduler above hands out groups in this order)."""
    for item in items:
        if (item.get_closest_marker("kubernetes") or item.get_closest_marker("cluster_down")) and \
                not in_cluster_group(item.path.name):
            raise pytest.UsageError(f"{item.nodeid} uses the cluster: name its module in tests/conftest.py's "
                                    "CLUSTER_MODULES (one worker runs all of those)")
    down = [item for item in items if item.get_closest_marker("cluster_down")]
    if down:
        rest = [item for item in items if not item.get_closest_marker("cluster_down")]
        cluster = [i for i, item in enumerate(rest) if item.get_closest_marker("kubernetes")]
        at = cluster[-1] + 1 if cluster else len(rest)
        items[:] = rest[:at] + down + rest[at:]
    if hasattr(config, "workerinput"):
        items[:] = [i for i in items if in_cluster_group(i.path.name)] + \
                   [i for i in items if not in_cluster_group(i.path.name)]
