"""The hybrid KFP v2 pipeline (no `from __future__ import annotations`: kfp reads real annotations): one runtime parameter, `training_runtime`, picks where the same training script runs.

kubernetes -> a TrainJob (Trainer v2) or a fixed-size PyTorchJob (training operator v1), by PIPELINE_JOB_KIND, in the
profile namespace KFP_NAMESPACE; sagemaker -> a SageMaker training job; local -> torchrun in the pipeline's own pod
(the training image) or, with kfp.local, on this machine. `dsl.If/Elif/Else` (not the deprecated dsl.Condition);
kfp >= 2.17, whose local runner really executes the taken branch.

Every task runs as KFP_SERVICE_ACCOUNT (multi-user KFP: `default-editor` of the profile), which
`kubeflow.pipeline.deploy` gives RBAC on the jobs (a Role in the profile namespace) and a Pod Identity role for the
SageMaker calls (doeks.identity row `pipeline-runner`). Each run names its job after the KFP run id, so a second run
never meets the first one's name (409) nor its checkpoints; `steps` reaches the script as `--max-steps`.
Nothing account-specific is made up at compile time: the training image must resolve (TRAIN_IMAGE, REGISTRY or AWS
credentials), and the SageMaker execution role's ARN is read from IAM, or left empty, and then the sagemaker branch
fails with one clear line.
"""

import base64
import json
from pathlib import Path
from typing import Any

from kfp import compiler, dsl

RUNTIMES = ("kubernetes", "sagemaker", "local")
# The kubernetes and sagemaker branches only submit and wait: a small image and one client library. boto3 >= 1.34.41
# reads EKS Pod Identity credentials (the container provider's AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE).
SUBMIT_IMAGE = "python:3.11-slim"
KUBERNETES_PACKAGES = ["kubernetes>=27,<31"]
SAGEMAKER_PACKAGES = ["boto3>=1.34.41"]
NAME = "doeks-hybrid-training"


def train_local(script: str, data_dir: str, arch: str, steps: int, model: dsl.Output[dsl.Model]):
    """Train a few steps with torchrun where this task runs (1 node, 1 process) and keep the model."""
    import os
    import subprocess
    import sys
    import tempfile

    os.makedirs(model.path, exist_ok=True)
    # checkpoints and metrics in a folder removed at the end: KFP's local runner runs this on the user's machine
    with tempfile.TemporaryDirectory(prefix="doeks-kfp-") as work:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", script,
                "--data", data_dir, "--arch", arch, "--max-steps", str(steps), "--epochs", "1", "--batch-size", "16",
                "--workers", "0",  # a few steps: the data loads in the rank itself, no DataLoader worker processes
                "--checkpoint-dir", os.path.join(work, "ckpt"), "--metrics-dir", os.path.join(work, "metrics"),
                "--model-dir", model.path]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        result = subprocess.run(argv, env=env, capture_output=True, text=True)
        print(result.stdout[-3000:])
        if result.returncode != 0:
            raise RuntimeError(f"local training failed: {result.stderr[-2000:]}")
        model.metadata["runtime"] = "local"
        with open(os.path.join(work, "metrics", "final.json")) as f:
            model.metadata["final"] = f.read()


def train_sagemaker(request: str, role_arn: str, steps: int, run_id: str, source_tar_b64: str, region: str,
                    endpoint_url: str, model: dsl.Output[dsl.Model], poll_seconds: int = 30):
    """Upload the script, create this run's SageMaker training job, wait for it, record the model artifact."""
    import base64
    import hashlib
    import json
    import time
    import uuid

    import boto3

    if not role_arn:
        raise RuntimeError("sagemaker_role_arn is empty: create the execution role (`invoke sagemaker.role`), then compile "
                           "or run the pipeline again with AWS credentials (doeks reads the role's ARN), or pass sagemaker_role_arn")
    job = json.loads(request)
    if not job.get("TrainingJobName"):
        raise RuntimeError("sagemaker_request is empty: compile the pipeline with `invoke kubeflow.pipeline.compile`")
    base = job["TrainingJobName"]
    # one job per run: named after the KFP run id (a retried task finds its own job), or random without one
    resolved = bool(run_id) and "{{" not in run_id
    name = f"{base}-{hashlib.sha256(run_id.encode()).hexdigest()[:8] if resolved else uuid.uuid4().hex[:8]}"
    job = json.loads(json.dumps(job).replace(f"/doeks/{base}/", f"/doeks/{name}/"))  # source and output under the run
    job["TrainingJobName"] = name
    job["RoleArn"] = role_arn
    if steps:
        job["HyperParameters"]["max-steps"] = str(steps)
    kwargs = {"region_name": region}
    if endpoint_url:  # an AWS-API stand-in (moto) answers any credentials
        kwargs.update(endpoint_url=endpoint_url, aws_access_key_id="testing", aws_secret_access_key="testing")
    source = job["HyperParameters"]["sagemaker_submit_directory"]
    bucket, key = source[len("s3://"):].split("/", 1)
    boto3.client("s3", **kwargs).put_object(Bucket=bucket, Key=key, Body=base64.b64decode(source_tar_b64))
    sm = boto3.client("sagemaker", **kwargs)
    try:
        sm.create_training_job(**job)
        print(f"created training job {name}")
    except sm.exceptions.ResourceInUse:
        print(f"training job {name} exists (this run's task was retried): following it")
    while True:
        described = sm.describe_training_job(TrainingJobName=name)
        status = described["TrainingJobStatus"]
        if status in ("Completed", "Failed", "Stopped"):
            break
        time.sleep(poll_seconds)
    if status != "Completed":
        raise RuntimeError(f"training job {name} ended {status}: {described.get('FailureReason', '')}")
    model.uri = described["ModelArtifacts"]["S3ModelArtifacts"]
    model.metadata["runtime"] = "sagemaker"
    model.metadata["training_job"] = name


def train_kubernetes(job: str, namespace: str, steps: int, run_id: str, model: dsl.Output[dsl.Model],
                     poll_seconds: int = 30):
    """Create this run's TrainJob or PyTorchJob in the profile namespace (the pod's own service account) and wait
    until it completes; a failed job fails the task."""
    import hashlib
    import json
    import time
    import uuid

    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException

    manifest = json.loads(job)
    kind = manifest.get("kind", "")
    kinds = {"TrainJob": ("trainer.kubeflow.org", "v1alpha1", "trainjobs", "Complete"),
             "PyTorchJob": ("kubeflow.org", "v1", "pytorchjobs", "Succeeded")}
    if kind not in kinds:
        raise RuntimeError(f"job is {kind or 'empty'}, not a TrainJob or PyTorchJob: compile the pipeline with "
                           "`invoke kubeflow.pipeline.compile`")
    group, version, plural, done = kinds[kind]
    base = manifest["metadata"]["name"]
    # one job per run: named after the KFP run id (a retried task finds its own job), or random without one
    resolved = bool(run_id) and "{{" not in run_id
    suffix = hashlib.sha256(run_id.encode()).hexdigest()[:8] if resolved else uuid.uuid4().hex[:8]
    name = f"{base[:40].rstrip('-')}-{suffix}"
    if not name[0].isalpha():  # TrainJob names are RFC 1035 labels (a letter first)
        name = f"r{name}"
    manifest["metadata"].update(name=name, namespace=namespace)

    def run_args(args):
        """The run's own checkpoint and metrics folders (an earlier run's would make this one 'already finished'),
        and `steps` as --max-steps."""
        args = list(args)
        for i in range(len(args) - 1):
            if args[i] in ("--checkpoint-dir", "--metrics-dir") and args[i + 1].rsplit("/", 1)[-1] == base:
                args[i + 1] = f"{args[i + 1].rsplit('/', 1)[0]}/{name}"
        return args + (["--max-steps", str(steps)] if steps else [])

    if kind == "TrainJob":
        manifest["spec"]["trainer"]["args"] = run_args(manifest["spec"]["trainer"].get("args", []))
    else:
        for replica in manifest["spec"]["pytorchReplicaSpecs"].values():
            container = replica["template"]["spec"]["containers"][0]
            container["args"] = run_args(container.get("args", []))
    config.load_incluster_config()
    api = client.CustomObjectsApi()
    try:
        api.create_namespaced_custom_object(group, version, namespace, plural, manifest)
        print(f"created {kind} {namespace}/{name}")
    except ApiException as error:
        if error.status != 409:
            raise
        print(f"{kind} {namespace}/{name} exists (this run's task was retried): following it")
    while True:
        current = api.get_namespaced_custom_object(group, version, namespace, plural, name)
        true = {c["type"]: c for c in current.get("status", {}).get("conditions", []) if c.get("status") == "True"}
        if done in true:
            break
        if "Failed" in true:
            raise RuntimeError(f"{kind} {namespace}/{name} failed: {true['Failed'].get('message', '')}")
        time.sleep(poll_seconds)
    model.metadata.update(runtime="kubernetes", kind=kind, name=name, namespace=namespace)


def _runs_as(task, service_account: str):
    """The task's pod runs as this service account (kfp-kubernetes' use_service_account writes the same field)."""
    task.platform_config.setdefault("kubernetes", {})["serviceAccount"] = service_account
    return task


def _mounts(task, claim: str, path: str):
    """The shared volume in the task's pod; the form kfp-kubernetes' mount_pvc writes (kubeflow/pipelines
    kubernetes_platform/python/test/unit/test_volume.py: constant + pvcNameParameter + mountPath)."""
    task.platform_config.setdefault("kubernetes", {}).setdefault("pvcMount", []).append(
        {"constant": claim, "pvcNameParameter": {"runtimeValue": {"constant": claim}}, "mountPath": path})
    return task


def build(image: str, service_account: str, claim: str = "fsx-pvc", mount: str = "/fsx-shared"):
    """The pipeline with the local branch in `image` (the training image: torch, the script at /workspace) with the
    shared volume `claim` at `mount` (its data), and every task running as `service_account`."""
    local_op = dsl.component(func=train_local, base_image=image)
    kubernetes_op = dsl.component(func=train_kubernetes, base_image=SUBMIT_IMAGE, packages_to_install=KUBERNETES_PACKAGES)
    sagemaker_op = dsl.component(func=train_sagemaker, base_image=SUBMIT_IMAGE, packages_to_install=SAGEMAKER_PACKAGES)

    @dsl.pipeline(name=NAME, description="Same script and data on Kubernetes, SageMaker or in the pipeline's own pod")
    def hybrid(training_runtime: str = "local", script: str = "/workspace/train.py", data_dir: str = "/fsx-shared/data",
               arch: str = "resnet18", steps: int = 5, namespace: str = "", job: str = "{}", sagemaker_request: str = "{}",
               sagemaker_role_arn: str = "", source_tar_b64: str = "", aws_region: str = "us-west-2",
               aws_endpoint_url: str = ""):
        with dsl.If(training_runtime == "kubernetes"):
            _runs_as(kubernetes_op(job=job, namespace=namespace, steps=steps, run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER),
                     service_account)
        with dsl.Elif(training_runtime == "sagemaker"):
            _runs_as(sagemaker_op(request=sagemaker_request, role_arn=sagemaker_role_arn, steps=steps,
                                  run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, source_tar_b64=source_tar_b64,
                                  region=aws_region, endpoint_url=aws_endpoint_url), service_account)
        with dsl.Else():
            _mounts(_runs_as(local_op(script=script, data_dir=data_dir, arch=arch, steps=steps), service_account), claim, mount)

    return hybrid


def training_image(settings, here: bool = False) -> str:
    """The training image for the local branch's pod; on a cluster it must name a real registry (no `<account>`)."""
    from . import trainimage

    ref = trainimage.reference(settings, on_this_machine=here)
    return ref if here else trainimage.require_resolved(ref)


def for_settings(settings, here: bool = False):
    return build(training_image(settings, here), settings.kfp_service_account, settings.shared_pvc, settings.shared_mount)


def cluster_job(settings) -> dict[str, Any]:
    """The kubernetes branch's job (PIPELINE_JOB_KIND), fixed size, in KFP_NAMESPACE, as the target answers it
    (doeks.targets: `pipeline_job`): compiled on this machine (TARGET=local/docker) it is EKS's job; on
    TARGET=kubernetes the plain cluster's (no instance-type selector, KUBE_GPUS, the image as that cluster has it).
    The elastic PyTorchJob is not used here: it needs the etcd Deployment beside it, which a pipeline task does not
    manage."""
    from . import targets

    return targets.get(settings).pipeline_job()


def role_arn(settings, required: bool) -> str:
    """The SageMaker execution role's ARN from IAM; "" when no AWS credentials are configured and it is not required."""
    from . import aws, trainimage
    from .errors import DoeksError

    if not required and not trainimage._credentials_configured(settings):
        return ""
    iam = aws.client(settings, "iam")
    try:
        return iam.get_role(RoleName=settings.sagemaker_role_name)["Role"]["Arn"]
    except iam.exceptions.NoSuchEntityException:
        if required:
            raise DoeksError(f"execution role {settings.sagemaker_role_name} does not exist: run `invoke sagemaker.role`") from None
        return ""
    except Exception as error:  # noqa: BLE001 - credentials that do not work: one line, or an empty ARN if optional
        if required:
            raise DoeksError(f"cannot read the execution role {settings.sagemaker_role_name}: {type(error).__name__}") from None
        return ""


def arguments(settings, runtime: str, steps: int = 5, endpoint_url: str = "", role: str = "",
              here: bool = False) -> dict[str, Any]:
    """Every pipeline parameter from the settings, so that any branch can be picked at run time: the cluster job
    (doeks.trainjob / doeks.jobspec), the CreateTrainingJob request (doeks.sagemaker; the run adds its suffix, role
    and steps), the script and data; `here`: paths of this machine for kfp.local."""
    from . import sagemaker
    from .errors import DoeksError

    from .code import resolve

    if runtime not in RUNTIMES:
        raise DoeksError(f"--runtime {runtime!r}: expected one of {', '.join(RUNTIMES)}")
    if not resolve(settings).builtin:  # a user's script: its own arguments alone (TRAIN_ARGS), no --max-steps
        if runtime == "local":
            raise DoeksError("--runtime local: the pipeline's local branch runs the built-in ImageNet workload only; "
                             "your TRAIN_SCRIPT runs on --runtime kubernetes or sagemaker")
        steps = 0
    request = sagemaker.training_request(settings, "", sagemaker.name_prefix(settings))
    del request["RoleArn"]
    args: dict[str, Any] = {"training_runtime": runtime, "arch": settings.arch, "steps": steps,
                            "namespace": settings.kfp_namespace, "job": json.dumps(cluster_job(settings)),
                            "sagemaker_request": json.dumps(request), "sagemaker_role_arn": role,
                            "source_tar_b64": base64.b64encode(sagemaker.source_archive(settings)).decode(),
                            "aws_region": settings.aws_region, "aws_endpoint_url": endpoint_url,
                            "script": "/workspace/train.py", "data_dir": f"{settings.shared_mount}/data"}
    if here:
        from .local import runtime as local_runtime

        args.update(script=str(sagemaker.WORKLOAD / "train.py"), data_dir=str(local_runtime.shared_volume(settings) / "data"))
    return args


# Which jobs the pipeline's service account may create in the profile namespace. The profile controller binds
# default-editor to the ClusterRole kubeflow-edit, which aggregates ClusterRoles labelled
# rbac.authorization.kubeflow.org/aggregate-to-kubeflow-edit. Trainer v2.3.0 ships one for trainjobs
# (kubeflow/trainer v2.3.0 manifests/overlays/kubeflow-platform/kubeflow-trainer-roles.yaml: kubeflow-trainer-edit,
# create/get/list/watch/delete), but only in its kubeflow-platform overlay, not in overlays/manager
# (`kubeflow.trainer.deploy`); the v1 operator's kubeflow-training-edit (pytorchjobs) is only in its overlays/kubeflow
# (kubeflow/trainer v1.9.4 manifests/overlays/kubeflow/kubeflow-training-roles.yaml), not in overlays/standalone,
# which doeks installs. So default-editor cannot create a PyTorchJob on a doeks cluster: this Role grants exactly
# what train_kubernetes does (create, then get until done) for both kinds, in KFP_NAMESPACE only.
RBAC_NAME = "doeks-pipeline-jobs"


def rbac(settings) -> list[dict[str, Any]]:
    ns, verbs = settings.kfp_namespace, ["create", "get", "list", "watch"]
    meta = {"name": RBAC_NAME, "namespace": ns, "labels": {"app.kubernetes.io/part-of": "doeks"}}
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta, "rules": [
            {"apiGroups": ["trainer.kubeflow.org"], "resources": ["trainjobs"], "verbs": verbs},
            {"apiGroups": ["kubeflow.org"], "resources": ["pytorchjobs"], "verbs": verbs}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": dict(meta),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": RBAC_NAME},
         "subjects": [{"kind": "ServiceAccount", "name": settings.kfp_service_account, "namespace": ns}]},
    ]


def default_path(settings, runtime: str) -> Path:
    return settings.state_dir / "pipelines" / f"hybrid-{runtime}.yaml"


def compile_to(out: Path, pipeline_func, defaults: dict[str, Any] | None = None) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(pipeline_func, str(out), pipeline_parameters=defaults or None)
    return out


# kubeflow/manifests 26.03 common/oauth2-proxy/base/oauth2_proxy.cfg: cookie_name = "oauth2_proxy_kubeflow"
SESSION_COOKIE = "oauth2_proxy_kubeflow"


def client(settings):
    """kfp.Client for a multi-user Kubeflow Pipelines, logged in one of the two ways kubeflow/manifests 26.03 offers
    (README "Connect to your Kubeflow Cluster", oauth2-proxy): a Kubernetes service-account token as a bearer token
    (KFP_TOKEN: the KFP API server checks it with a TokenReview; through the Istio gateway only with an m2m oauth2-proxy
    overlay, doeks' `example/` uses m2m-dex-only, so then port-forward svc/ml-pipeline), or the dashboard login's
    session cookie through the gateway (KFP_SESSION_TOKEN). Both are secrets: masked in every output."""
    import warnings

    import kfp

    from .errors import DoeksError

    if not settings.kfp_endpoint:
        raise DoeksError("KFP_ENDPOINT is empty: set it, e.g. http://localhost:8888 after `kubectl -n kubeflow port-forward "
                         "svc/ml-pipeline 8888:8888`, or http://localhost:8080/pipeline after `invoke kubeflow.expose`; "
                         "or use --local")
    if not (settings.kfp_token or settings.kfp_session_token):
        raise DoeksError(f"a multi-user Kubeflow Pipelines needs a login: set KFP_TOKEN (`kubectl -n {settings.kfp_namespace} "
                         f"create token {settings.kfp_service_account} --audience=pipelines.kubeflow.org`) or "
                         f"KFP_SESSION_TOKEN (the {SESSION_COOKIE} cookie after logging in) in .env.local")
    cookies = f"{SESSION_COOKIE}={settings.kfp_session_token}" if settings.kfp_session_token else None
    warnings.filterwarnings("ignore", category=FutureWarning, module="kfp")  # "only works with KFP v2.0.0-beta.2 and later"
    return kfp.Client(host=settings.kfp_endpoint, existing_token=settings.kfp_token or None, cookies=cookies,
                      namespace=settings.kfp_namespace)


def create_run(settings, args: dict[str, Any]) -> str:
    """Create a run of the pipeline on KFP_ENDPOINT in KFP_NAMESPACE as KFP_SERVICE_ACCOUNT; returns the run id.
    A refusal (401/403/404...) or an unreachable endpoint is one line; the login never appears in it."""
    import kfp_server_api
    import urllib3

    from .errors import DoeksError

    kfp_client = client(settings)
    try:
        run = kfp_client.create_run_from_pipeline_func(for_settings(settings), arguments=args, namespace=settings.kfp_namespace,
                                                       experiment_name="doeks", service_account=settings.kfp_service_account)
    except kfp_server_api.ApiException as error:
        raise DoeksError(f"Kubeflow Pipelines at {settings.kfp_endpoint} answered {error.status} {error.reason}"
                         + (": check KFP_TOKEN / KFP_SESSION_TOKEN and KFP_NAMESPACE" if error.status in (401, 403) else "")) from None
    except (OSError, urllib3.exceptions.HTTPError) as error:
        raise DoeksError(f"cannot reach Kubeflow Pipelines at {settings.kfp_endpoint}: {type(error).__name__}") from None
    return run.run_id


def run_local(settings, args: dict[str, Any]):
    """Execute the pipeline here with kfp.local (subprocesses in this Python environment)."""
    import kfp.local

    root = settings.state_dir / "kfp"
    root.mkdir(parents=True, exist_ok=True)
    kfp.local.init(runner=kfp.local.SubprocessRunner(use_venv=False), pipeline_root=str(root), raise_on_error=True)
    return for_settings(settings, here=True)(**args)


# -- the shared volume in the profile namespace --------------------------------------------------------------------
# The local branch mounts SHARED_PVC in KFP_NAMESPACE and the kubernetes branch's job does too, but the claim that
# csi.fsx/efs make lives in NAMESPACE. A claim binds one volume, so the profile namespace gets its own claim bound to a
# second PersistentVolume that names the same file system (volumeHandle): no second file system, Retain so that
# deleting it never deletes the data. On doeks' own cluster the volume is a folder of this machine (hostPath): the
# second PersistentVolume names the same folder.
_SHARED_SOURCES = ("csi", "hostPath", "nfs")  # volume sources two PersistentVolumes can name at once


def shared_claim_name(settings) -> str:
    return f"{settings.shared_pvc}-{settings.kfp_namespace}"[:253]


def shared_claim(settings, pv: dict[str, Any]) -> list[dict[str, Any]]:
    """PV + PVC in KFP_NAMESPACE for the file system behind `pv` (the PersistentVolume SHARED_PVC is bound to)."""
    from .errors import DoeksError

    spec = pv["spec"]
    source = next((key for key in _SHARED_SOURCES if key in spec), None)
    if source is None:
        raise DoeksError(f"SHARED_PVC {settings.shared_pvc} in namespace {settings.namespace} is not a CSI (FSx, EFS), "
                         f"NFS or host folder volume: create {settings.shared_pvc} in {settings.kfp_namespace} yourself")
    labels = {"app.kubernetes.io/part-of": "doeks"}
    name, capacity = shared_claim_name(settings), spec.get("capacity", {}).get("storage", "1Gi")
    volume = {"capacity": {"storage": capacity}, "volumeMode": "Filesystem",
              "accessModes": spec.get("accessModes", ["ReadWriteMany"]), "persistentVolumeReclaimPolicy": "Retain",
              "storageClassName": "",
              source: ({k: v for k, v in spec["csi"].items() if k in ("driver", "volumeHandle", "volumeAttributes")}
                       if source == "csi" else dict(spec[source])),
              "claimRef": {"namespace": settings.kfp_namespace, "name": settings.shared_pvc}}
    for key in ("mountOptions", "nodeAffinity"):
        if spec.get(key):
            volume[key] = spec[key]
    return [{"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name, "labels": labels}, "spec": volume},
            {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
             "metadata": {"name": settings.shared_pvc, "namespace": settings.kfp_namespace, "labels": labels},
             "spec": {"accessModes": volume["accessModes"], "storageClassName": "", "volumeName": name,
                      "resources": {"requests": {"storage": capacity}}}}]


def _get(runner, argv: list[str]) -> dict[str, Any] | None:
    from . import kube
    from .errors import MissingTool, NotConnected

    try:
        result = runner.run([kube.kubectl(), "get", *argv, "-o", "json"], mutating=False, check=False, capture=True)
    except (MissingTool, NotConnected):
        if runner.dry_run:
            return None
        raise
    try:
        return json.loads(result.stdout) if result and result.returncode == 0 and result.stdout.strip() else None
    except ValueError:
        return None


def ensure_shared_claim(settings, runner) -> list[dict[str, Any]]:
    """SHARED_PVC in KFP_NAMESPACE for the pipeline's local and kubernetes branches (see above); what it applies.
    Without SHARED_PVC in NAMESPACE there is nothing to share yet: one line says which step makes it."""
    from . import kube, ui

    if settings.kfp_namespace == settings.namespace:
        return []
    claim = _get(runner, ["pvc", settings.shared_pvc, "-n", settings.namespace])
    pv = _get(runner, ["pv", claim["spec"]["volumeName"]]) if claim and claim.get("spec", {}).get("volumeName") else None
    if pv is None and runner.dry_run:
        pv = {"spec": {"capacity": {"storage": "<capacity>"}, "accessModes": ["ReadWriteMany"],
                       "csi": {"driver": "<driver of SHARED_PVC>", "volumeHandle": f"<file system of {settings.namespace}/{settings.shared_pvc}>"}}}
    if pv is None:
        ui.say(f"no bound claim {settings.shared_pvc} in namespace {settings.namespace}: the pipeline's local and kubernetes "
               f"branches need it in {settings.kfp_namespace}; `invoke csi.fsx.deploy` (or csi.efs.deploy), then "
               f"`invoke kubeflow.pipeline.deploy` again", style="yellow")
        return []
    manifests = shared_claim(settings, pv)
    kube.apply(runner, manifests)
    return manifests


def shared_claim_refs(settings) -> list[dict[str, Any]]:
    """What kubeflow.pipeline.delete removes of the above (the claim first; the file system stays)."""
    if settings.kfp_namespace == settings.namespace:
        return []
    return [{"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": settings.shared_pvc, "namespace": settings.kfp_namespace}},
            {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": shared_claim_name(settings)}}]
