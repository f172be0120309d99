"""The hybrid KFP v2 pipeline (no `from __future__ import annotations`: kfp reads real annotations): one runtime parameter, `training_runtime`, picks where the same training script runs.

kubernetes -> a PyTorchJob on the cluster (training operator), sagemaker -> a SageMaker training job,
local -> torchrun on the machine running the pipeline. `dsl.If/Elif/Else` (not the deprecated dsl.Condition);
kfp >= 2.17, whose local runner really executes the taken branch.
"""

import base64
import json
from pathlib import Path
from typing import Any

from kfp import compiler, dsl

RUNTIMES = ("kubernetes", "sagemaker", "local")
COMPONENT_IMAGE = "python:3.11-slim"


@dsl.component(base_image=COMPONENT_IMAGE)
def train_local(script: str, data_dir: str, arch: str, steps: int, model: dsl.Output[dsl.Model]):
    """Train a few steps with torchrun on this machine (1 node, 1 process) and keep the model."""
    import os
    import subprocess
    import sys
    import tempfile

    work = tempfile.mkdtemp(prefix="doeks-kfp-")
    os.makedirs(model.path, exist_ok=True)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", script,
            "--data", data_dir, "--arch", arch, "--max-steps", str(steps), "--epochs", "1", "--batch-size", "16",
            "--checkpoint-dir", os.path.join(work, "ckpt"), "--metrics-dir", os.path.join(work, "metrics"),
            "--model-dir", model.path]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    result = subprocess.run(argv, env=env, capture_output=True, text=True)
    print(result.stdout[-3000:])
    if result.returncode != 0:
        raise RuntimeError(f"local training failed: {result.stderr[-2000:]}")
    model.metadata["runtime"] = "local"
    model.metadata["final"] = open(os.path.join(work, "metrics", "final.json")).read()


@dsl.component(base_image=COMPONENT_IMAGE, packages_to_install=["boto3"])
def train_sagemaker(request: str, source_tar_b64: str, region: str, endpoint_url: str, model: dsl.Output[dsl.Model]):
    """Upload the script, create the SageMaker training job, wait for it, record the model artifact."""
    import base64
    import json
    import time

    import boto3

    kwargs = {"region_name": region}
    if endpoint_url:
        kwargs.update(endpoint_url=endpoint_url, aws_access_key_id="testing", aws_secret_access_key="testing")
    job = json.loads(request)
    source = job["HyperParameters"]["sagemaker_submit_directory"]
    bucket, key = source[len("s3://"):].split("/", 1)
    boto3.client("s3", **kwargs).put_object(Bucket=bucket, Key=key, Body=base64.b64decode(source_tar_b64))
    sm = boto3.client("sagemaker", **kwargs)
    sm.create_training_job(**job)
    while True:
        described = sm.describe_training_job(TrainingJobName=job["TrainingJobName"])
        status = described["TrainingJobStatus"]
        if status in ("Completed", "Failed", "Stopped"):
            break
        time.sleep(30)
    if status != "Completed":
        raise RuntimeError(f"training job {job['TrainingJobName']} ended {status}: {described.get('FailureReason', '')}")
    model.uri = described["ModelArtifacts"]["S3ModelArtifacts"]
    model.metadata["runtime"] = "sagemaker"
    model.metadata["training_job"] = job["TrainingJobName"]


@dsl.component(base_image=COMPONENT_IMAGE, packages_to_install=["kubernetes<31"])
def train_kubernetes(pytorchjob: str, model: dsl.Output[dsl.Model]):
    """Create the PyTorchJob in the cluster (in-cluster credentials) and wait until it succeeds."""
    import json
    import time

    from kubernetes import client, config

    config.load_incluster_config()
    job = json.loads(pytorchjob)
    api = client.CustomObjectsApi()
    namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
    api.create_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", job)
    while True:
        conditions = api.get_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", name) \
            .get("status", {}).get("conditions", [])
        states = {c["type"] for c in conditions if c.get("status") == "True"}
        if "Succeeded" in states:
            break
        if "Failed" in states:
            raise RuntimeError(f"PyTorchJob {name} failed")
        time.sleep(30)
    model.metadata["runtime"] = "kubernetes"
    model.metadata["pytorchjob"] = name


@dsl.pipeline(name="doeks-hybrid-training", description="Same script and data on Kubernetes, SageMaker or locally")
def hybrid(training_runtime: str = "local", script: str = "/workspace/train.py", data_dir: str = "/fsx-shared/data",
           arch: str = "resnet18", steps: int = 5, sagemaker_request: str = "{}", source_tar_b64: str = "",
           aws_region: str = "us-west-2", aws_endpoint_url: str = "", pytorchjob: str = "{}"):
    with dsl.If(training_runtime == "kubernetes"):
        train_kubernetes(pytorchjob=pytorchjob)
    with dsl.Elif(training_runtime == "sagemaker"):
        train_sagemaker(request=sagemaker_request, source_tar_b64=source_tar_b64, region=aws_region,
                        endpoint_url=aws_endpoint_url)
    with dsl.Else():
        train_local(script=script, data_dir=data_dir, arch=arch, steps=steps)


def arguments(settings, runtime: str, steps: int = 5, endpoint_url: str = "", role_arn: str = "") -> dict[str, Any]:
    """Pipeline arguments for a runtime, from the plan of the target it maps onto (doeks.targets.RUNTIMES: the seed's
    kubernetes -> eks, sagemaker -> sagemaker, local -> local): the same job spec and request the tasks submit."""
    from . import targets
    from .errors import DoeksError

    if runtime not in RUNTIMES:
        raise DoeksError(f"--runtime {runtime!r}: expected one of {', '.join(RUNTIMES)}")
    target = targets.for_runtime(settings, runtime)
    plan = target.plan(targets.Job(target.settings, ["--max-steps", str(steps)]))
    args: dict[str, Any] = {"training_runtime": runtime, "arch": settings.arch, "steps": steps,
                            "aws_region": settings.aws_region, "aws_endpoint_url": endpoint_url}
    if runtime == "local":
        from . import sagemaker
        from .local import runtime as local_runtime

        args.update(script=str(sagemaker.WORKLOAD / "train.py"), data_dir=str(local_runtime.shared_volume(settings) / "data"))
    elif runtime == "sagemaker":
        request = plan.requests[0]["params"]
        if role_arn:
            request["RoleArn"] = role_arn
        from . import sagemaker

        args.update(sagemaker_request=json.dumps(request), source_tar_b64=base64.b64encode(sagemaker.source_archive()).decode())
    else:
        args.update(pytorchjob=json.dumps(plan.manifests[-1]), data_dir=f"{settings.shared_mount}/data")
    return args


def compile_to(out: Path, defaults: dict[str, Any] | None = None) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(hybrid, str(out), pipeline_parameters=defaults or None)
    return out


def run_local(settings, args: dict[str, Any]):
    """Execute the pipeline here with kfp.local (subprocesses in this Python environment)."""
    import kfp.local

    root = settings.state_dir / "kfp"
    root.mkdir(parents=True, exist_ok=True)
    kfp.local.init(runner=kfp.local.SubprocessRunner(use_venv=False), pipeline_root=str(root), raise_on_error=True)
    return hybrid(**args)
