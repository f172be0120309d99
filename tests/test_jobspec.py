"""The elastic job's manifests: what `elasticjob.deploy` applies validates against upstream schemas."""
from __future__ import annotations

import jsonschema
import pytest
import yaml

from doeks import jobspec
from doeks import settings as S

from .conftest import ROOT, invoke, schema_path


def crd_schema(filename: str, version: str) -> dict:
    crd = yaml.safe_load(schema_path(filename).read_text())
    return next(v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v["name"] == version)


def k8s_validate(manifest: dict) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(manifest, "1.31", strict=True)


@pytest.mark.parametrize("env", [{}, {"RDZV_BACKEND": "c10d"}, {"RDZV_BACKEND": "etcd-v2", "GPU_EFA": "false"},
                                 {"GPU_INSTANCE_TYPE": "p5.48xlarge", "NPROC_PER_NODE": "8", "NODE_LABELS": "team=ml"}])
def test_manifests_validate_against_upstream_schemas(env):
    s = S.load(environ=env, path=ROOT / ".env")
    manifests = jobspec.manifests(s)
    kinds = [m["kind"] for m in manifests]
    assert kinds[-1] == "PyTorchJob"
    assert ("Deployment" in kinds) == s.rdzv_backend.startswith("etcd")
    schema = crd_schema("kubeflow.org_pytorchjobs.crd.yaml", "v1")
    for manifest in manifests:
        if manifest["kind"] == "PyTorchJob":
            jsonschema.validate(manifest, schema)
        else:
            k8s_validate(manifest)
    job = manifests[-1]
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    k8s_validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}, "spec": pod})
    assert_shm_in_memory(pod)
    elastic = job["spec"]["elasticPolicy"]
    assert (elastic["minReplicas"], elastic["maxReplicas"]) == (s.min_replicas, s.max_replicas)
    assert job["spec"]["nprocPerNode"] == str(s.nproc_per_node)
    assert ":latest" not in s.etcd_image


def assert_shm_in_memory(pod: dict) -> None:
    """The training container's /dev/shm is a RAM-backed emptyDir (the DataLoader's workers pass batches through
    shared memory, NCCL's transport too; the container runtime's default is 64 MiB), as the MPIJob's workers
    (test_first_run) and the TrainJob's node (test_trainjob) have theirs."""
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm")
    assert next(v for v in pod["volumes"] if v["name"] == mount["name"])["emptyDir"] == {"medium": "Memory"}


def test_schema_catches_a_broken_job():
    """The schema check itself can fail: a wrong type is rejected."""
    s = S.load(environ={}, path=ROOT / ".env")
    job = jobspec.pytorchjob(s)
    job["spec"]["elasticPolicy"]["minReplicas"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(job, crd_schema("kubeflow.org_pytorchjobs.crd.yaml", "v1"))


def test_on_a_cluster_the_watchdog_gets_its_account_and_the_ranks_publish_their_pod_ip():
    s = S.load(environ={"TARGET": "kubernetes", "HANG_TIMEOUT": "60"}, path=ROOT / ".env")
    docs = jobspec.manifests(s, image="doeks-train:x", account=True)
    assert [d["kind"] for d in docs] == ["Deployment", "Service", "ServiceAccount", "Role", "RoleBinding",
                                         "ClusterRole", "ClusterRoleBinding", "PyTorchJob"]
    pod = jobspec.worker_pod(docs[-1])
    assert pod["serviceAccountName"] == f"{s.job_name}-watchdog"
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["PET_LOCAL_ADDR"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["DOEKS_HANG_TIMEOUT"]["value"] == "60"
    off = S.load(environ={"TARGET": "kubernetes", "HANG_TIMEOUT": "0"}, path=ROOT / ".env")
    assert "serviceAccountName" not in jobspec.worker_pod(jobspec.manifests(off, image="x", account=True)[-1])


def test_pet_env_matches_what_the_operator_sets():
    s = S.load(environ={"MIN_REPLICAS": "1", "MAX_REPLICAS": "3"}, path=ROOT / ".env")
    env = jobspec.pet_env(jobspec.pytorchjob(s), "127.0.0.1:2379")
    assert env["PET_NNODES"] == "1:3" and env["PET_RDZV_BACKEND"] == "etcd"
    assert env["PET_RDZV_ENDPOINT"] == "127.0.0.1:2379" and env["PET_NPROC_PER_NODE"] == "2"
    assert "last_call_timeout=" in env["PET_RDZV_CONF"]


@pytest.mark.parametrize("policy", [{}, {"rdzvId": "run-7", "maxRestarts": 9, "nProcPerNode": 4}])
def test_torchrun_reads_the_pet_env_as_its_own_arguments(policy, monkeypatch):
    """The local and docker targets give each node the PET_* variables the training operator would: torchrun's own
    parser (torch.distributed.run, whose defaults come from PET_<ARG>) reads them as the job's elastic policy."""
    from torch.distributed.run import get_args_parser

    s = S.load(environ={"MIN_REPLICAS": "1", "MAX_REPLICAS": "3"}, path=ROOT / ".env")
    job = jobspec.pytorchjob(s)
    elastic = job["spec"]["elasticPolicy"]
    for key in ("rdzvId", "maxRestarts"):
        elastic.pop(key, None)
    elastic.update(policy)
    if "nProcPerNode" in policy:
        del job["spec"]["nprocPerNode"]
    env = jobspec.pet_env(job, "etcd-service:2379")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = get_args_parser().parse_args(["train.py"])
    assert (args.nnodes, args.rdzv_backend, args.rdzv_endpoint) == ("1:3", "etcd", "etcd-service:2379")
    assert args.nproc_per_node == str(policy.get("nProcPerNode", s.nproc_per_node))
    assert args.rdzv_id == policy.get("rdzvId", job["metadata"]["name"])  # the operator's default: the job's name
    assert int(args.max_restarts) == policy.get("maxRestarts", 3)
    assert dict(kv.split("=", 1) for kv in args.rdzv_conf.split(",")) == {c["key"]: c["value"] for c in elastic["rdzvConf"]}


def test_the_rendezvous_etcd_is_one_server_its_service_reaches_with_the_v2_api():
    """What the API server's schema cannot refuse: the Service selects the Deployment's pods, one etcd (two would be
    two clusters, agents split between them), the v2 API torch's etcd rendezvous needs, and the Service's own URL
    advertised (tests/test_kubernetes_jobs.py deletes the etcd pod on the real cluster)."""
    s = S.load(environ={}, path=ROOT / ".env")
    deployment, service = jobspec.etcd_manifests(s)
    name = jobspec.etcd_name(s)
    assert name == f"{s.job_name}-etcd" and deployment["metadata"]["name"] == service["metadata"]["name"] == name
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["selector"] == {"app": "etcd", "doeks/job": s.job_name} and deployment["metadata"]["labels"]["app"] == "etcd"
    container = pod["spec"]["containers"][0]
    assert container["name"] == "etcd" and container["image"] == s.etcd_image
    assert container["ports"] == [{"name": "client", "containerPort": jobspec.ETCD_PORT}]
    assert service["spec"]["ports"][0]["targetPort"] == jobspec.ETCD_PORT
    command = container["command"]
    assert command[0] == "/usr/local/bin/etcd" and "--enable-v2" in command and "--initial-cluster-state=new" in command
    data = command[command.index("--data-dir") + 1]
    assert {"name": "data", "mountPath": data} in container["volumeMounts"]
    assert f"--advertise-client-urls=http://{name}:{jobspec.ETCD_PORT}" in command
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": jobspec.ETCD_PORT}  # etcd's own
    for manifest in (deployment, service):
        assert_the_api_server_would_take(manifest)
    # another job in the namespace: its own etcd, which this job's Service never selects
    theirs, their_service = jobspec.etcd_manifests(S.load(environ={"JOB_NAME": "other"}, path=ROOT / ".env"))
    assert their_service["metadata"]["name"] == "other-etcd" != name and theirs["metadata"]["name"] == "other-etcd"
    assert not service["spec"]["selector"].items() <= theirs["spec"]["template"]["metadata"]["labels"].items()


def assert_the_api_server_would_take(manifest: dict) -> None:
    """What kubernetes-validate's schema lets through and the API server refuses: a mount of an undeclared volume, a
    port or volume name that is no DNS label, a quantity that does not parse (kubernetes' own parser)."""
    import re

    from kubernetes.utils import parse_quantity

    label = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
    pod = manifest["spec"]["template"]["spec"] if "template" in manifest["spec"] else None
    for port in manifest["spec"].get("ports", []):
        assert label.fullmatch(port["name"]), port
    if pod is None:
        return
    declared = {v["name"] for v in pod.get("volumes", [])}
    assert all(label.fullmatch(name) for name in declared), declared
    for container in pod["containers"]:
        assert {m["name"] for m in container.get("volumeMounts", [])} <= declared
        assert all(label.fullmatch(p["name"]) for p in container.get("ports", []))
        for kind in ("requests", "limits"):
            for resource, quantity in container.get("resources", {}).get(kind, {}).items():
                assert resource in ("cpu", "memory", "nvidia.com/gpu", "vpc.amazonaws.com/efa"), resource
                parse_quantity(quantity)


def test_deploy_dry_run_prints_the_local_plan_and_starts_nothing(state_dir):
    """On TARGET=local the plan is processes and folders (a local deploy printed a 172-line cluster manifest asking for
    nvidia.com/gpu, EFA and p4d nodes); the cluster targets' dry run is their manifests."""
    result = invoke("elasticjob.deploy", "--dry-run", "--replicas", "3")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and "nvidia.com/gpu" not in result.stderr and "p4d" not in result.stderr
    assert "would start node 2:" in result.stderr and "doeks.local.agent" in result.stderr
    assert "would start etcd" in result.stderr and "checkpoints in " in result.stderr and "model in " in result.stderr
    assert not (state_dir / "jobs").exists() and not (state_dir / "services").exists()
    cluster = invoke("elasticjob.deploy", "--dry-run", "--replicas", "3", env={"TARGET": "kubernetes"})
    docs = list(yaml.safe_load_all(cluster.stdout))
    # etcd, the hang watchdog's account (a cluster's API server is where it acts), the job
    assert [d["kind"] for d in docs] == ["Deployment", "Service", "ServiceAccount", "Role", "RoleBinding", "ClusterRole",
                                         "ClusterRoleBinding", "PyTorchJob"], cluster.stderr
    assert docs[-1]["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3


def test_what_the_caller_gives_reaches_the_job():
    """The extra arguments, the run and the image the target resolved reach the PyTorchJob (elastic and fixed-size),
    and the run id is a fresh, sortable one; runPolicy keeps the training operator's own key (the CRD schema lets an
    unknown key through)."""
    import re

    s = S.load(environ={"REPLICAS": "2", "MAX_REPLICAS": "3"}, path=ROOT / ".env")
    job = jobspec.manifests(s, ["--max-steps", "3"], run="r1", image="registry.example/train:7")[-1]
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert container["args"][-2:] == ["--max-steps", "3"] and container["image"] == "registry.example/train:7"
    assert "--data" in container["args"]  # the built-in script's own arguments, on the shared volume
    assert job["spec"]["elasticPolicy"]["rdzvId"] == f"{s.job_name}-r1"
    fixed = jobspec.pytorchjob_fixed(s, ["--max-steps", "3"], run="r2")
    replicas = fixed["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["template"]["spec"]["containers"][0]["args"][-2:] == ["--max-steps", "3"]
    assert replicas["Worker"]["template"]["spec"]["containers"][0]["env"] == \
        replicas["Master"]["template"]["spec"]["containers"][0]["env"]
    assert any(e.get("value", "").endswith("-r2") for e in replicas["Master"]["template"]["spec"]["containers"][0]["env"])
    assert fixed["spec"]["runPolicy"] == {"cleanPodPolicy": "None", "backoffLimit": 3}
    replicas["Master"]["template"]["spec"]["containers"][0]["args"].append("--only-master")
    assert "--only-master" not in replicas["Worker"]["template"]["spec"]["containers"][0]["args"]  # copies, not one
    assert re.fullmatch(r"\d{8}-\d{6}-[0-9a-f]{4}", jobspec.run_id())
