"""TARGET=kubernetes on doeks' own single-node cluster, as a user types it, asserted through the API server.

The run's first cluster module (kubernetes-sigs e2e style, one cluster per run: conftest's cluster_state): `invoke
up` starts it and deploys every unit, the job trains to the end in pods of the training image, the network guard
counted nothing; then, marked `cluster_down` so they run after every other test of the run, `invoke down` twice
leaves no process, mount, network namespace, iptables chain, bridge or cgroup, and `up` after `down` finds nothing
doeks made. Needs `invoke setup --kubernetes` (the README's test command runs it); in CI a missing build fails,
elsewhere the module is skipped.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from .conftest import invoke

pytestmark = [pytest.mark.kubernetes, pytest.mark.slow]

JOB = "k8sjob"


def _built() -> bool:
    from doeks.cluster import build

    return not build.missing()


# a small elastic job: 2 nodes (1 to 3) of 1 process, little data
SMALL_JOB = {"REPLICAS": "2", "MIN_REPLICAS": "1", "MAX_REPLICAS": "3", "NPROC_PER_NODE": "1", "EPOCHS": "1",
             "DATA_TRAIN_PER_CLASS": "64", "DATA_VAL_PER_CLASS": "16"}


def own_cluster(request, values: dict, built: bool | None = None,
                fail: str = "CI must have doeks' cluster built: `invoke setup --kubernetes` should have built it",
                skip: str = "doeks' cluster is not built (invoke setup --kubernetes)"):
    """A cluster module's settings on the run's one cluster (TARGET=kubernetes, KUBECONFIG empty, the run's state
    folder: see conftest's cluster_state), yielded; then its job deleted. Without the build: a failure in CI, a skip
    elsewhere."""
    if not (_built() if built is None else built):
        if os.environ.get("CI"):
            pytest.fail(fail)
        pytest.skip(skip)
    state = request.getfixturevalue("cluster_state")
    values = {"TARGET": "kubernetes", "STATE_DIR": str(state), "KUBECONFIG": "", **values}
    yield values
    if "JOB_NAME" in values:  # nothing of this module's keeps training into the next one
        invoke("elasticjob.delete", env=values, timeout=600)


@pytest.fixture(scope="module")
def env(request):
    yield from own_cluster(request, {"JOB_NAME": JOB, **SMALL_JOB})


def kubectl(env, *args: str, input: str | None = None) -> subprocess.CompletedProcess:
    from doeks import kube
    from doeks.cluster import versions

    return subprocess.run([kube.wheel_kubectl() or kube.kubectl(), f"--kubeconfig={versions.kubeconfig()}", *args],
                          capture_output=True, text=True, timeout=120, input=input)


def trainer_client():
    """Kubeflow's SDK (kubeflow 0.5.0) on doeks' cluster, as a user makes it: KUBECONFIG, namespace default."""
    from doeks.cluster import versions
    from kubeflow.common.types import KubernetesBackendConfig
    from kubeflow.trainer import TrainerClient

    return TrainerClient(KubernetesBackendConfig(config_file=str(versions.kubeconfig()), namespace="default"))


def training_client():
    """The training operator's SDK (kubeflow-training 1.9.4) on doeks' cluster."""
    from doeks.cluster import versions
    from kubeflow.training import TrainingClient

    return TrainingClient(config_file=str(versions.kubeconfig()), namespace="default")


def holder_pod(claim: str) -> str:
    """A pod that is not doeks', mounting `claim` and sleeping (as a user's notebook would hold the shared volume)."""
    from doeks.cluster import operators

    return json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "holder", "namespace": "default"},
                       "spec": {"terminationGracePeriodSeconds": 0,
                                "containers": [{"name": "sleep", "image": operators.INIT_CONTAINER_IMAGE,
                                                "imagePullPolicy": "Never", "command": ["sleep", "600"],
                                                "volumeMounts": [{"name": "shared", "mountPath": "/shared"}]}],
                                "volumes": [{"name": "shared", "persistentVolumeClaim": {"claimName": claim}}]}})


def test_up_starts_the_cluster_deploys_every_unit_and_prints_the_kubeconfig(env):
    result = invoke("up", env=env, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    from doeks.cluster import versions

    assert f"export KUBECONFIG={versions.kubeconfig()}" in result.stdout.splitlines()
    nodes = json.loads(kubectl(env, "get", "nodes", "-o", "json").stdout)["items"]
    assert [n["metadata"]["name"] for n in nodes] == [versions.NODE_NAME]
    ready = {c["type"]: c["status"] for c in nodes[0]["status"]["conditions"]}
    assert ready["Ready"] == "True"
    assert nodes[0]["status"]["nodeInfo"]["kubeletVersion"] == f"v{versions.KUBERNETES}"
    # the training operator doeks built runs, and its webhook is registered with the CA its cert controller made
    operator = json.loads(kubectl(env, "-n", "kubeflow", "get", "deployment", "training-operator", "-o", "json").stdout)
    assert operator["status"].get("availableReplicas") == 1
    from .conftest import wait_for

    bound = lambda: kubectl(env, "get", "pvc", "fsx-pvc", "-n", "default", "-o",  # noqa: E731
                            "jsonpath={.status.phase}").stdout == "Bound"
    wait_for(bound, 60, "the claim bound to its volume on this machine", poll=1)


def test_the_job_trains_to_the_end_in_pods_of_the_training_image(env):
    result = invoke("elasticjob.deploy", "--fresh", "--follow", "--epochs", "1", env=env, timeout=1800)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    assert "succeeded: final validation accuracy" in result.stderr
    pods = json.loads(kubectl(env, "get", "pods", "-n", "default", "-l", f"doeks/job={JOB}", "-o", "json").stdout)["items"]
    workers = [p for p in pods if "worker" in p["metadata"]["name"]]
    assert len(workers) == 2
    for pod in workers:
        assert pod["spec"]["containers"][0]["image"].startswith("doeks-train:")
        assert pod["status"]["phase"] == "Succeeded"
        # a healthy run logs no traceback (the image's torchrun: no etcd lease thread dying in every pod)
        log = kubectl(env, "logs", "-n", "default", pod["metadata"]["name"]).stdout
        assert "step=" in log and "Traceback" not in log and "Exception in thread" not in log
    # the training operator's own SDK (kubeflow-training 1.9.4) reads the job as upstream documents it (issue 35)
    client = training_client()
    job = client.wait_for_job_conditions(JOB, wait_timeout=60, polling_interval=2)
    assert client.is_job_succeeded(JOB) and job.spec.elastic_policy.max_replicas == 3
    assert "Succeeded" in [c.type for c in client.get_job_conditions(JOB) if c.status == "True"]
    assert JOB in [j.metadata.name for j in client.list_jobs()]
    names = sorted(client.get_job_pod_names(JOB))
    assert names == sorted(p["metadata"]["name"] for p in workers)
    logs, _ = client.get_job_logs(JOB, is_master=False)  # Workers only: the elastic job has no Master
    assert sorted(logs) == names and all("step=" in text for text in logs.values()), list(logs)


def test_a_deploy_reads_the_image_again_only_when_the_node_no_longer_holds_it(env):
    """The training image's files are read on each node at a deploy (a pod's first start from cold layers took 63 s)
    only when the kernel says most of its largest files' pages are gone: a warm deploy re-read 3.6 GiB per node."""
    import hashlib

    from doeks import settings
    from doeks.cluster import images, node
    from doeks.trainimage import reference

    from .conftest import ROOT

    ref = reference(settings.load(environ={**os.environ, **env}, path=ROOT / ".env"), True)
    read, _ = images.warm(ref)  # after the job: read or found in memory, and its largest files noted
    again, took = images.warm(ref)
    assert again == 0 and took < 2, (read, again, took)
    name = images._stored_name(ref, node.NODE0)
    key = hashlib.sha256(name.encode()).hexdigest()[:12]
    sample = json.loads((node.NODE0.run_dir / "warm" / f"{key}.json").read_text())
    mount = node.NODE0.run_dir / "warm" / "evict"
    mount.mkdir(parents=True, exist_ok=True)
    assert node.ctr("images", "mount", name, str(mount), node=node.NODE0).returncode == 0
    try:  # the largest files' pages dropped from memory (no container of the image runs: nothing maps them)
        for path in sample:
            fd = os.open(mount / path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        assert images._resident([str(mount / path) for path in sample]) < images.WARM_ENOUGH
    finally:
        node.ctr("images", "unmount", "--rm", str(mount), node=node.NODE0)
    size, _ = images.warm(ref)
    assert size > 1 << 30, size  # read again, all of it


def test_a_deploy_with_another_state_dir_than_the_clusters_volume_is_refused_in_one_line(env, tmp_path):
    """The shared volume is a folder under the STATE_DIR `up` ran with: a job deployed with another STATE_DIR would
    write the first one's folder, and --fresh would have cleared the second's (seen: a --fresh run resumed from the
    checkpoint it should have removed)."""
    other = {**env, "STATE_DIR": str(tmp_path / "other"), "JOB_NAME": "elsewhere"}
    result = invoke("elasticjob.deploy", "--fresh", env=other, timeout=300)
    assert result.returncode == 1, (result.stdout[-2000:], result.stderr[-2000:])
    said = result.stderr.strip().splitlines()
    assert said[-1].startswith("error: doeks' cluster keeps its shared volume on ") and "Traceback" not in result.stderr
    assert f"STATE_DIR back to {env['STATE_DIR']}" in said[-1], said[-1]
    assert kubectl(env, "get", "pytorchjob", "elsewhere", "--ignore-not-found", "-o", "name").stdout.strip() == ""


def _wait_for(env, kind: str, name: str, done: str, timeout: int = 900, stuck=None) -> dict:
    """The object once its `done` or Failed condition is True (read every 2 s); `stuck()`, when given, is asked every
    15 s for a reason it will never get there (an AssertionError at once instead of the timeout): for a TrainJob it is
    a whole `invoke` start-up, CPU taken from the job's pods."""
    import time

    deadline = time.monotonic() + timeout
    asked = float("-inf")  # the first poll asks at once
    while time.monotonic() < deadline:
        got = kubectl(env, "get", kind, name, "-n", "default", "-o", "json")
        if got.returncode == 0:
            obj = json.loads(got.stdout)
            true = {c["type"] for c in obj.get("status", {}).get("conditions", []) if c.get("status") == "True"}
            if done in true or "Failed" in true:
                return obj
        if stuck is not None and time.monotonic() - asked >= 15:
            asked = time.monotonic()
            if why := stuck():
                raise AssertionError(f"{kind}/{name} will not finish: {why}")
        time.sleep(2)
    raise AssertionError(f"{kind}/{name} not finished after {timeout}s")


def _trainjob_reason(values) -> str:
    """The reason line `kubeflow.trainjob.status` gives, or empty."""
    said = invoke("kubeflow.trainjob.status", env=values, timeout=120)
    return next((line for line in (said.stdout + said.stderr).splitlines() if line.startswith("reason: ")), "")


def _said(result) -> str:
    return result.stdout + result.stderr


def _gone(env, kind: str, name: str, selector: str) -> bool:
    """Neither the job nor any pod of it is left (the API server's word)."""
    job = kubectl(env, "get", kind, name, "-n", "default", "--ignore-not-found", "-o", "name").stdout.strip()
    pods = kubectl(env, "get", "pods", "-n", "default", "-l", selector, "-o", "name").stdout.strip()
    return not job and not pods


def test_a_fixed_size_pytorchjob_runs_master_and_worker_with_the_injected_init_container_twice(env):
    """--no-elastic: 1 Master + 1 Worker; the operator injects its init container (alpine:3.10, built here) into
    the Worker, which waits for the Master's name through CoreDNS. The user's verbs, twice in a row: submit, status,
    logs, delete twice (nothing left), then the same again with --fresh (trains from scratch)."""
    from .conftest import wait_for

    values = {**env, "JOB_NAME": "fixedjob", "EPOCHS": "1"}
    selector = "training.kubeflow.org/job-name=fixedjob"
    kubectl(env, "delete", "pytorchjob", "fixedjob", "-n", "default", "--ignore-not-found", "--wait=true")
    for again in (False, True):
        # again under the same name it would resume from its checkpoint and only say it had finished: --fresh
        result = invoke("kubeflow.pytorchjob.submit", "--no-elastic", "--replicas", "2", *(["--fresh"] if again else []),
                        env=values, timeout=900)
        assert result.returncode == 0, result.stderr[-3000:]
        job = _wait_for(env, "pytorchjob", "fixedjob", "Succeeded")
        states = {c["type"] for c in job["status"]["conditions"] if c.get("status") == "True"}
        assert "Succeeded" in states, job["status"]
        worker = json.loads(kubectl(env, "get", "pod", "fixedjob-worker-0", "-n", "default", "-o", "json").stdout)
        assert [c["image"] for c in worker["spec"]["initContainers"]] == ["alpine:3.10"]
        status = invoke("kubeflow.pytorchjob.status", env=values, timeout=120)
        assert status.returncode == 0 and "fixedjob" in _said(status) and "Succeeded" in _said(status), _said(status)
        logs = invoke("kubeflow.pytorchjob.logs", env=values, timeout=120)
        # every line of every pod: the script's first line too (with a selector kubectl shows only each pod's last 10)
        said = _said(logs)
        assert logs.returncode == 0 and "[pod/fixedjob-master-0/" in said and "start host=" in said, said[-2000:]
        assert "step=" in said and "done final_val_acc=" in said, said[-2000:]
        for _ in range(2):
            deleted = invoke("kubeflow.pytorchjob.delete", env=values, timeout=300)
            assert deleted.returncode == 0, deleted.stderr[-2000:]
        wait_for(lambda: _gone(env, "pytorchjob", "fixedjob", selector), 120, "the PyTorchJob and its pods gone", poll=2)


def test_a_trainjob_runs_to_completion_on_trainer_v2_3_and_jobset_twice(env):
    """The user's verbs on Trainer v2.3.0 + JobSet, twice in a row: submit, the TrainJob Complete with nothing wrong
    to say (status), its pods' logs, delete twice (the JobSet and pods go with it), then the same again with --fresh."""
    from doeks import trainjob

    from .conftest import wait_for

    result = invoke("kubeflow.trainer.deploy", env=env, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    values = {**env, "JOB_NAME": "trainjob1", "EPOCHS": "1"}
    kubectl(env, "delete", "trainjob", "trainjob1", "-n", "default", "--ignore-not-found", "--wait=true")
    for again in (False, True):
        result = invoke("kubeflow.trainjob.submit", "--replicas", "2", *(["--fresh"] if again else []), env=values,
                        timeout=900)
        assert result.returncode == 0, result.stderr[-3000:]
        job = _wait_for(env, "trainjob", "trainjob1", "Complete", stuck=lambda: _trainjob_reason(values))
        states = {c["type"] for c in job["status"]["conditions"] if c.get("status") == "True"}
        assert "Complete" in states, job["status"]
        assert _trainjob_reason(values) == ""  # a job that ran to the end has nothing wrong to say
        logs = invoke("kubeflow.trainjob.logs", env=values, timeout=120)
        said = _said(logs)  # every line of every pod: the script's first line too
        assert logs.returncode == 0 and "[pod/trainjob1-node-0-" in said and "start host=" in said, said[-2000:]
        assert "step=" in said and "done final_val_acc=" in said, said[-2000:]
        if not again:  # Kubeflow's own SDK (kubeflow 0.5.0) reads doeks' TrainJob as upstream documents it (issue 35)
            client = trainer_client()
            read = client.get_job("trainjob1")
            assert read.status == "Complete" and read.runtime.name == "torch-distributed" and read.num_nodes == 2
            assert sorted(step.name for step in read.steps) == ["node-0", "node-1"]
            assert "trainjob1" in [j.name for j in client.list_jobs()]
            assert "done final_val_acc=" in "\n".join(client.get_job_logs("trainjob1"))
            assert any(e.involved_object_kind == "Pod" for e in client.get_job_events("trainjob1"))
        for _ in range(2):
            deleted = invoke("kubeflow.trainjob.delete", env=values, timeout=300)
            assert deleted.returncode == 0, deleted.stderr[-2000:]
        wait_for(lambda: _gone(env, "trainjob", "trainjob1", trainjob.selector("trainjob1")), 120,
                 "the TrainJob, its JobSet's pods gone", poll=2)


def test_a_trainjob_whose_pods_the_api_server_refuses_is_named_with_the_refusal(env):
    """A TrainJob whose runtime patch mounts a volume it never declares (doeks' own TrainJob with its dshm volume
    taken out, as a user's patch might): the Trainer makes the JobSet, the API server refuses JobSet's Job, and
    JobSet records JobCreationFailed; `kubeflow.trainjob.status` names it with the API server's words at once."""
    from doeks import trainjob
    from doeks.runner import to_yaml_stream
    from doeks.settings import load

    values = {**env, "JOB_NAME": "badpatch", "EPOCHS": "1"}
    from doeks import targets

    settings = load({**os.environ, **values})
    job = trainjob.trainjob(settings, placement=targets.get(settings).placement())  # as the target submits it
    pod = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    volumes = pod["template"]["spec"]["template"]["spec"]["volumes"]
    volumes[:] = [v for v in volumes if v["name"] != "dshm"]
    try:
        applied = kubectl(env, "apply", "--server-side", "--field-manager=doeks", "-f", "-", input=to_yaml_stream([job]))
        assert applied.returncode == 0, applied.stderr
        from .conftest import wait_for

        line = wait_for(lambda: _trainjob_reason(values), 120, "trainjob.status naming the refusal", poll=3)
        assert line.startswith("reason: the JobSet cannot create its Jobs: "), line
        assert "dshm" in line and "not found" in line.lower(), line
    finally:
        kubectl(env, "delete", "trainjob", "badpatch", "-n", "default", "--ignore-not-found", "--wait=true")


def test_a_deletion_that_cannot_finish_ends_within_its_limit_in_one_line(env, tmp_path, monkeypatch):
    """kube.delete_from (the MPI operator's manifest, the trainer's and the operator's kustomizations on `down`): kubectl
    waits for ever by default, and on a fresh machine `down` waited 13 min on a pod that never ended (CI). An object
    held by a finalizer nobody removes: the deletion ends in about its limit, in one line naming the file."""
    import time

    from doeks import kube
    from doeks.cluster import versions
    from doeks.errors import DoeksError
    from doeks.runner import Runner

    held = tmp_path / "held.yaml"
    held.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: doeks-held\n  namespace: default\n"
                    "  finalizers: [doeks.test/held]\n")
    assert kubectl(env, "apply", "-f", str(held)).returncode == 0
    monkeypatch.setenv("KUBECONFIG", str(versions.kubeconfig()))
    began = time.monotonic()
    try:
        with pytest.raises(DoeksError) as refused:
            kube.delete_from(Runner(echo=False), "-f", str(held), timeout=5)
        assert time.monotonic() - began < 30
        said = str(refused.value)
        assert said.startswith(f"waited 5 s for what {held} names to be gone") and "\n" not in said, said
    finally:
        kubectl(env, "patch", "configmap", "doeks-held", "-n", "default", "--type=merge", "-p",
                '{"metadata":{"finalizers":null}}')
    kube.delete_from(Runner(echo=False), "-f", str(held), timeout=5)  # gone already is fine


def test_the_network_guard_counted_nothing_after_the_job(env):
    from doeks.cluster import guard

    assert guard.installed()
    assert guard.dropped() == 0, guard.listing()
    # an address of the cluster's range that no node has is refused by the routing table, never routed to the default
    # interface (where only the guard stops it); a node's own range still goes to the bridge
    nowhere = subprocess.run(["ip", "route", "get", "10.244.77.1"], capture_output=True, text=True)
    assert nowhere.returncode != 0 and "no route to host" in nowhere.stderr.lower(), (nowhere.stdout, nowhere.stderr)
    pods = subprocess.run(["ip", "route", "get", "10.244.0.77"], capture_output=True, text=True)
    assert pods.returncode == 0 and "dev doeks0" in pods.stdout, pods.stdout


def test_the_bridge_keeps_its_own_mac_while_ports_come_and_go(env):
    """The pods' and nodes' gateway (doeks0) has a MAC of its own: a port with a lower MAC joining and leaving (as a
    pod's veth does) leaves it as every neighbour resolved it. A bridge without one takes its lowest port's MAC, and a
    node's kubelet lost the API server for 60 s after `up` when that port went (the ARP entry pointed at nothing)."""
    from doeks.cluster import versions

    def mac() -> str:
        return open(f"/sys/class/net/{versions.BRIDGE}/address").read().strip()

    before = mac()
    assert before == versions.bridge_mac(0)
    try:
        subprocess.run(["ip", "link", "add", "dkmac0", "address", "00:00:00:00:00:01", "type", "veth", "peer", "name",
                        "dkmac1"], check=True)
        subprocess.run(["ip", "link", "set", "dkmac0", "master", versions.BRIDGE, "up"], check=True)
        joined = mac()
    finally:
        subprocess.run(["ip", "link", "delete", "dkmac0"], capture_output=True)
    assert (joined, mac()) == (before, before)


def test_cluster_dns_answers_cluster_names_and_forwards_nothing(env):
    """From a pod: the API server's Service name resolves through CoreDNS; a name outside the cluster does not (no
    upstream forwarding), and nothing left by the default interface (the guard still counts zero)."""
    from doeks.cluster import guard, operators

    name = "dns-probe"
    kubectl(env, "delete", "pod", name, "--ignore-not-found", "--wait=true")
    run = kubectl(env, "run", name, "--restart=Never", f"--image={operators.INIT_CONTAINER_IMAGE}",
                  "--image-pull-policy=Never", "--command", "--", "sh", "-c",
                  "nslookup kubernetes.default.svc.cluster.local; echo ---; nslookup pypi.org; echo rc=$?")
    assert run.returncode == 0, run.stderr
    wait = kubectl(env, "wait", f"pod/{name}", "--for=jsonpath={.status.phase}=Succeeded", "--timeout=120s")
    assert wait.returncode == 0, wait.stderr
    out = kubectl(env, "logs", name).stdout
    inside, outside = out.split("---", 1)
    assert "10.96.0.1" in inside
    assert "203.0.113" not in outside and "rc=1" in outside
    kubectl(env, "delete", "pod", name, "--wait=false")
    assert guard.dropped() == 0, guard.listing()


@pytest.mark.cluster_down
def test_down_twice_leaves_nothing_behind_even_with_a_job_running_and_its_claim_in_use(env):
    """`down` with the job training and a pod that is not doeks' holding the claim: the job goes first (its pods
    with it), the held claim is named and asked to go without waiting (claim protection would wait for ever), and
    stopping the cluster ends the rest. Then nothing is left, twice."""
    import time

    from doeks.cluster import node

    running = invoke("elasticjob.deploy", "--fresh", env={**env, "EPOCHS": "50"}, timeout=900)
    assert running.returncode == 0, running.stderr[-3000:]
    assert kubectl(env, "apply", "-f", "-", input=holder_pod("fsx-pvc")).returncode == 0
    ready = kubectl(env, "wait", "pod/holder", "-n", "default", "--for=condition=Ready", "--timeout=120s")
    assert ready.returncode == 0, ready.stderr
    began = time.monotonic()
    first = invoke("down", "--yes", env=env, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    assert time.monotonic() - began < 300
    said = first.stdout + first.stderr
    held = next((line for line in said.splitlines() if "claim default/fsx-pvc is in use by pod " in line), "")
    assert "holder" in held and "asked to go without waiting" in held, said[-3000:]
    assert node.leftovers() == {"processes": [], "mounts": [], "network namespaces": [], "iptables chains": [],
                                "bridge": [], "routes": [], "cgroups": []}
    second = invoke("down", "--yes", env=env, timeout=900)
    assert second.returncode == 0, second.stderr[-3000:]
    assert node.leftovers() == {"processes": [], "mounts": [], "network namespaces": [], "iptables chains": [],
                                "bridge": [], "routes": [], "cgroups": []}


@pytest.mark.cluster_down
def test_up_after_down_starts_a_cluster_with_nothing_doeks_made_left(env):
    """After `down`, a new cluster (eks.create: the node alone) holds nothing of the last one: no CRD, webhook, cluster
    role or binding, namespace, PV or pod that doeks or its operators made (down removed the etcd data with the rest)."""
    created = invoke("eks.create", env=env, timeout=600)
    assert created.returncode == 0, created.stderr[-3000:]
    try:
        listed = kubectl(env, "get", "crd,validatingwebhookconfigurations,mutatingwebhookconfigurations,clusterroles,"
                         "clusterrolebindings,namespaces,pv,pods,pvc", "-A", "-o", "json")
        assert listed.returncode == 0, listed.stderr
        names = [f"{item['kind']}/{item['metadata']['name']}" for item in json.loads(listed.stdout)["items"]]
        left = [n for n in names if n.startswith(("CustomResourceDefinition/", "ValidatingWebhookConfiguration/",
                                                  "MutatingWebhookConfiguration/", "PersistentVolume",
                                                  "Pod/", "PersistentVolumeClaim/"))
                or (n.startswith(("ClusterRole", "Namespace/")) and any(k in n for k in ("kubeflow", "training",
                                                                                         "trainer", "jobset", "doeks")))]
        assert [n for n in left if not n.startswith("Pod/coredns")] == [], left
    finally:
        deleted = invoke("down", "--yes", env=env, timeout=900)
        assert deleted.returncode == 0, deleted.stderr[-3000:]
    from doeks.cluster import node

    assert node.leftovers() == {"processes": [], "mounts": [], "network namespaces": [], "iptables chains": [],
                                "bridge": [], "routes": [], "cgroups": []}
