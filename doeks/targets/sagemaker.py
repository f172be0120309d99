"""TARGET=sagemaker: the same script and data as a SageMaker training job (CreateTrainingJob built with boto3, see
doeks.sagemaker), or, with SAGEMAKER_LOCAL=true, that same request run here the way SageMaker runs it.

Local mode: one container of the training image per instance ("algo-1".."algo-N"), each with SageMaker's training
contract: the script unpacked in /opt/ml/code, the channel in /opt/ml/input/data/training (the local volume's data
folder, as SageMaker local mode's file:// inputs), /opt/ml/input/config/{hyperparameters,resourceconfig,
inputdataconfig}.json, /opt/ml/model, /opt/ml/output, the SM_* environment the sagemaker-training toolkit sets, and
the command it runs with torch_distributed enabled (torchrun --nnodes N --node_rank i --master_addr algo-1 ...
train.py --<hyperparameter> <value> ...). When every host exits 0 the model directory of algo-1 becomes
output/model.tar.gz, as SageMaker uploads it.
"""
from __future__ import annotations

import io
import json
import os
import shlex
import tarfile
import time
from pathlib import Path
from typing import Any, Iterator

from .. import elastic, sagemaker, trainimage
from ..errors import DoeksError
from ..services import free_port
from .eks import OnAws
from .base import (FAILED, PENDING, RUNNING, STOPPED, SUCCEEDED, Job, JobStatus, NotSupported, Plan, ReplicaStatus,
                   Step, Target)
from .follow import ContainerCursor, follow_until_done, wait_with_progress
from ..pod import reasons
from .base import check_train_args

_STATES = {"InProgress": RUNNING, "Completed": SUCCEEDED, "Failed": FAILED, "Stopping": RUNNING, "Stopped": STOPPED}
LABEL = "doeks/target"
LOCAL_LABEL = "sagemaker-local"


hyperparameters_from_args = sagemaker.hyperparameters_from_args


def script_args(hyperparameters: dict[str, str]) -> list[str]:
    """What the sagemaker-training toolkit passes the entry point: every hyperparameter but sagemaker_* as --k v."""
    argv = []
    for key, value in hyperparameters.items():
        if not key.startswith("sagemaker_"):
            argv += [f"--{key}", str(value)]
    return argv


class SageMakerTarget(OnAws, Target):
    name = "sagemaker"

    def checks(self):
        from .checks import sagemaker_checks

        return sagemaker_checks(self.settings)

    def __init__(self, settings):
        super().__init__(settings)
        self.local = settings.sagemaker_local
        self.on_this_machine = self.builds_image = self.local

    @property
    def home(self) -> Path:
        return self.settings.state_dir / "sagemaker" / self.settings.job_name

    def _recorded(self) -> dict[str, Any]:
        try:
            return json.loads((self.home / "job.json").read_text())
        except (OSError, ValueError):
            return {}

    # -- submission ---------------------------------------------------------------------------------------------------
    def request(self, job: Job, role_arn: str) -> dict[str, Any]:
        s = job.settings
        name = sagemaker.job_name(s)
        request = sagemaker.training_request(s, role_arn, name, code=job.code)
        request["HyperParameters"].update(hyperparameters_from_args(job.train_args))
        return request

    def plan(self, job: Job) -> Plan:
        s = job.settings
        role = f"arn:aws:iam::<account>:role/{s.sagemaker_role_name}"
        request = self.request(job, role)
        if job.code.builtin:  # a user's script parses its own arguments
            check_train_args(job.train_args)  # after request(): its own one line for arguments that are not pairs
        source = request["HyperParameters"]["sagemaker_submit_directory"]
        bucket, key = source[len("s3://"):].split("/", 1)
        plan = Plan(self.name, job, requests=[{"service": "sagemaker", "operation": "CreateTrainingJob", "params": request}],
                    world=job.world or self.world())
        ctx: dict[str, Any] = {"request": request, "world": plan.world}
        plan.context = ctx
        if self.local:
            image = job.image or trainimage.reference(s, True, job.code)
            plan.image = image
            build = self.image_step(job)
            if build is not None:
                ctx["builds"] = True
                plan.steps.append(build)
            plan.steps.append(Step(f"check: docker daemon, training image {image}, data in {elastic.data_root(s)}",
                                   lambda: self._check_local(s, image, job.code)))
            for index in range(s.sagemaker_instance_count):
                plan.steps.append(Step(f"docker run algo-{index + 1} of {s.sagemaker_instance_count}: {image} "
                                       f"/opt/ml (SageMaker contract) {shlex.join(self._host_command(request, index, 'PORT', plan.world))}",
                                       None if index else (lambda: self._run_local(s, request, image, job.run, job.code,
                                                                                   plan.world))))
            return plan
        plan.image = request["AlgorithmSpecification"]["TrainingImage"]
        if s.efs_file_system_id and not s.sagemaker_subnets:
            raise DoeksError("EFS data needs VPC training: set SAGEMAKER_SUBNETS (and SAGEMAKER_SECURITY_GROUPS)")
        plan.steps.append(Step(f"iam.GetRole {s.sagemaker_role_name} (the execution role's ARN)", lambda: self._role(s, ctx)))
        plan.steps.append(Step(f"s3.PutObject s3://{bucket}/{key} (sourcedir.tar.gz of {job.code.source})",
                               lambda: self._upload(s, bucket, key, job.code)))
        plan.steps.append(Step(f"sagemaker.CreateTrainingJob {request['TrainingJobName']} "
                               f"({s.sagemaker_instance_count} x {s.sagemaker_instance_type})",
                               lambda: self._create(s, ctx, job.run)))
        return plan

    def _role(self, s, ctx) -> None:
        from ..aws import client

        iam = client(s, "iam")
        try:
            ctx["request"]["RoleArn"] = iam.get_role(RoleName=s.sagemaker_role_name)["Role"]["Arn"]
        except iam.exceptions.NoSuchEntityException:
            raise DoeksError(f"execution role {s.sagemaker_role_name} does not exist: run `invoke sagemaker.role`") from None

    def _upload(self, s, bucket: str, key: str, code=None) -> None:
        from ..aws import client

        client(s, "s3").put_object(Bucket=bucket, Key=key, Body=sagemaker.source_archive(s, code))

    def run_name(self, plan: Plan) -> str:
        if self.local or not plan.requests:
            return plan.job.run
        return plan.requests[0]["params"]["TrainingJobName"]

    def _create(self, s, ctx, run: str) -> None:
        from ..aws import client

        client(s, "sagemaker").create_training_job(**ctx["request"])
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "job.json").write_text(json.dumps({"name": ctx["request"]["TrainingJobName"], "run": run, "local": False}))

    # -- local mode -------------------------------------------------------------------------------------------------
    def _check_local(self, s, image: str, code=None) -> None:
        trainimage.require_image(image, s)
        if any(c.status in ("running", "created", "restarting") for c in self._containers()):
            raise DoeksError(f"a local SageMaker job of {s.job_name} is running: `invoke elasticjob.delete` first")
        for stale in self._containers():
            stale.remove(force=True)
        elastic.check_job_data(s, code)

    def _containers(self) -> list:
        from .docker import client

        from .docker import state_label

        found = client().containers.list(all=True, filters={"label": [f"{LABEL}={LOCAL_LABEL}", f"doeks/job={self.settings.job_name}",
                                                                      f"doeks/state={state_label(self.settings)}"]})
        return sorted(found, key=lambda c: c.labels.get("doeks/host", ""))

    def world(self):
        """SageMaker's world: SAGEMAKER_INSTANCE_COUNT hosts; in local mode NPROC_PER_NODE processes on each (as
        local and docker run), on SageMaker one per GPU of the instance type (its toolkit's torch_distributed)."""
        from ..catalog import GPUS
        from .base import World

        s = self.settings
        count = s.sagemaker_instance_count
        hosts = "" if count == s.replicas else (f"SAGEMAKER_INSTANCE_COUNT={count} hosts, where the other targets start "
                                                f"REPLICAS={s.replicas} nodes")
        if self.local:
            return World(count, s.nproc_per_node, hosts)
        gpus = GPUS.get(s.sagemaker_instance_type.removeprefix("ml."))
        why = (f"SageMaker runs one process per GPU of {s.sagemaker_instance_type}" if gpus else
               f"SageMaker runs one process per GPU of {s.sagemaker_instance_type}, a count doeks does not know: 1 shown")
        return World(count, gpus or 1, "; ".join(x for x in (hosts, why + ", not NPROC_PER_NODE") if x))

    def _host_command(self, request: dict[str, Any], index: int, port: Any, world=None) -> list[str]:
        count = request["ResourceConfig"]["InstanceCount"]
        nproc = world.nproc if world is not None else self.settings.nproc_per_node
        return ["torchrun", "--nnodes", str(count), "--nproc_per_node", str(nproc), "--node_rank", str(index),
                "--master_addr", "127.0.0.1", "--master_port", str(port),
                f"/opt/ml/code/{request['HyperParameters']['sagemaker_program']}"] + script_args(request["HyperParameters"])

    def _run_local(self, s, request: dict[str, Any], image: str, run: str, job_code=None, world=None) -> None:
        name = request["TrainingJobName"]
        root = self.home / name
        count = request["ResourceConfig"]["InstanceCount"]
        hosts = [f"algo-{i + 1}" for i in range(count)]
        code = root / "code"
        code.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(sagemaker.source_archive(s, job_code)), mode="r:gz") as tar:
            tar.extractall(code, filter="data")
        checkpoints = root / "checkpoints"
        checkpoints.mkdir(exist_ok=True)
        data = elastic.data_root(s)
        port = free_port()
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "job.json").write_text(json.dumps({"name": name, "run": run, "local": True, "root": str(root)}))
        try:
            self._start_hosts(s, request, image, run, root, hosts, code, checkpoints, data, port, world)
        except BaseException:
            for c in self._containers():  # a half-started job waits for its missing hosts forever
                if c.labels.get("doeks/run") == run:
                    c.remove(force=True)
            raise

    def _start_hosts(self, s, request, image, run, root, hosts, code, checkpoints, data, port, world=None) -> None:
        from .docker import client, state_label

        name = request["TrainingJobName"]
        hyper = request["HyperParameters"]
        for index, host in enumerate(hosts):
            ml = root / host
            config = ml / "input" / "config"
            config.mkdir(parents=True, exist_ok=True)
            (ml / "model").mkdir(exist_ok=True)
            (ml / "output" / "data").mkdir(parents=True, exist_ok=True)
            (config / "hyperparameters.json").write_text(json.dumps(hyper, indent=2))
            (config / "resourceconfig.json").write_text(json.dumps({"current_host": host, "hosts": hosts,
                                                                    "network_interface_name": "eth0"}))
            (config / "inputdataconfig.json").write_text(json.dumps({c["ChannelName"]: {"TrainingInputMode": "File"}
                                                                     for c in request["InputDataConfig"]}))
            env = {"SM_HOSTS": json.dumps(hosts), "SM_CURRENT_HOST": host, "SM_NUM_GPUS": "0", "SM_NUM_CPUS": "1",
                   "SM_MODEL_DIR": "/opt/ml/model", "SM_CHANNELS": json.dumps(["training"]),
                   "SM_CHANNEL_TRAINING": "/opt/ml/input/data/training", "SM_OUTPUT_DATA_DIR": "/opt/ml/output/data",
                   "SM_OUTPUT_DIR": "/opt/ml/output", "SM_INPUT_DIR": "/opt/ml/input",
                   "SM_INPUT_CONFIG_DIR": "/opt/ml/input/config", "SM_MODULE_DIR": hyper["sagemaker_submit_directory"],
                   "SM_USER_ENTRY_POINT": hyper["sagemaker_program"], "SM_HPS": json.dumps(script_hps(hyper)),
                   "SM_CURRENT_INSTANCE_TYPE": request["ResourceConfig"]["InstanceType"], "SM_TRAINING_ENV": "{}",
                   "TRAINING_JOB_NAME": name, "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                   "HOME": "/tmp", **request.get("Environment", {})}
            env.update({f"SM_HP_{k.upper().replace('-', '_')}": str(v) for k, v in script_hps(hyper).items()})
            volumes = {str(code): {"bind": "/opt/ml/code", "mode": "ro"},
                       str(data): {"bind": "/opt/ml/input/data/training", "mode": "ro"},
                       str(config): {"bind": "/opt/ml/input/config", "mode": "ro"},
                       str(ml / "model"): {"bind": "/opt/ml/model", "mode": "rw"},
                       str(ml / "output"): {"bind": "/opt/ml/output", "mode": "rw"},
                       str(checkpoints): {"bind": "/opt/ml/checkpoints", "mode": "rw"}}
            client().containers.run(image, self._host_command(request, index, port, world), name=f"{name}-{host}", detach=True,
                                    environment=env, volumes=volumes, network_mode="host", working_dir="/opt/ml/code",
                                    shm_size="1g", user=f"{os.getuid()}:{os.getgid()}",
                                    labels={"app.kubernetes.io/part-of": "doeks", LABEL: LOCAL_LABEL,
                                            "doeks/job": s.job_name, "doeks/run": run, "doeks/host": host,
                                            "doeks/training-job": name, "doeks/state": state_label(s)})

    def _describe_local(self, record: dict[str, Any]) -> JobStatus:
        from .docker import container_job_status

        status = container_job_status(self.name, self.settings.job_name, record.get("run", ""), self._containers(),
                                      lambda c: c.labels.get("doeks/host", c.name))
        if status.state == SUCCEEDED:
            self._package_model(record)
        return status

    def _package_model(self, record: dict[str, Any]) -> Path:
        """algo-1's /opt/ml/model as output/model.tar.gz (what SageMaker uploads), written once, atomically."""
        root = self._root(record)
        archive = root / "output" / "model.tar.gz"
        if not archive.exists():
            archive.parent.mkdir(parents=True, exist_ok=True)
            tmp = archive.with_name(f".model.tar.gz.{os.getpid()}.tmp")
            model = root / "algo-1" / "model"
            with tarfile.open(tmp, "w:gz") as tar:
                for path in sorted(model.rglob("*")):
                    tar.add(path, arcname=str(path.relative_to(model)), recursive=False)
            tmp.replace(archive)
        return archive

    def _root(self, record: dict[str, Any]) -> Path:
        if not record.get("root"):
            raise DoeksError(f"no local SageMaker job of {self.settings.job_name} recorded: submit one with "
                             "`TARGET=sagemaker SAGEMAKER_LOCAL=true invoke elasticjob.deploy`")
        return Path(record["root"])

    # -- after submission ---------------------------------------------------------------------------------------------
    def _name(self) -> str:
        recorded = self._recorded().get("name")
        return recorded or sagemaker.latest_job(self.settings)

    def describe(self) -> JobStatus:
        s = self.settings
        record = self._recorded()
        if self.local:
            return self._describe_local(record)
        if not record:
            try:
                name = sagemaker.latest_job(s)
            except DoeksError:
                return JobStatus(self.name, s.job_name, STOPPED, reason="no SageMaker training job submitted")
        else:
            name = record["name"]
        job = sagemaker.describe(s, name)
        status = job["TrainingJobStatus"]
        state = _STATES.get(status, RUNNING)
        if status == "InProgress" and job.get("SecondaryStatus") in ("Starting", "Pending", "Downloading", "LaunchingMLInstances"):
            state = PENDING
        count = job["ResourceConfig"]["InstanceCount"]
        replicas = [ReplicaStatus(f"algo-{i + 1}", state, 0, detail=job["ResourceConfig"]["InstanceType"]) for i in range(count)]
        # FailureReason carries the script's output: "AlgorithmError: ExecuteUserScriptError:\nExitCode 2\nErrorMessage
        # \"...\"\nCommand ..." (aws/sagemaker-training-toolkit src/sagemaker_training/errors.py, _CalledProcessError)
        found = reasons.classify(job.get("FailureReason", "").splitlines(), failed=True) if state == FAILED else None
        if found is not None and found.code != "failed":  # a known cause in SageMaker's FailureReason
            return JobStatus(self.name, s.job_name, state, run=name, replicas=replicas, desired=count,
                             reason=found.text, fix=found.fix, permanent=found.permanent)
        return JobStatus(self.name, s.job_name, state, run=name, replicas=replicas, desired=count,
                         reason=job.get("FailureReason", ""))

    def logs(self, follow: bool = False, replica: int | None = None, run: str | None = None, tail: int | None = None,
             since: float | None = None) -> Iterator[str]:
        from .follow import check_run

        check_run(self, run)  # one training job per run: only the current one's logs are read here
        if replica is not None:
            raise DoeksError(f"--replica {replica}: TARGET=sagemaker shows one training job's logs (all its hosts)")
        if self.local:
            return follow_until_done(self, self._local_cursor(), follow, tail=tail, since=since)

        def cursor():
            seen = getattr(cursor, "seen", 0)
            lines = sagemaker.logs(self.settings, self._name())
            cursor.seen = len(lines)
            return lines[seen:]

        return follow_until_done(self, cursor, follow, poll=10, tail=tail, since=since)

    def _local_cursor(self) -> ContainerCursor:
        return ContainerCursor(self._containers, lambda c: c.labels.get("doeks/host", c.name))

    def wait(self, timeout: float | None = None, quiet: bool = False) -> JobStatus:
        if self.local:
            return wait_with_progress(self, self._local_cursor(), timeout, quiet, poll=0.5)
        deadline = time.monotonic() + timeout if timeout else None
        while True:
            status = self.describe()
            if status.finished:
                return status
            if deadline and time.monotonic() > deadline:
                raise DoeksError(f"training job still running after {timeout:.0f}s")
            time.sleep(15)

    def end_failed(self, runner, status: JobStatus | None = None) -> None:
        if not self.local:
            return super().end_failed(runner, status)
        from .docker import stop_containers

        stop_containers(self._containers(), runner)

    def scale(self, replicas: int, runner) -> None:
        raise NotSupported(self.name, "scale", "a SageMaker training job keeps its instance count "
                                               "(SAGEMAKER_INSTANCE_COUNT); submit a new job to change it")

    def cancel(self, runner) -> bool:
        if self.local:
            containers = self._containers()
            for c in containers:
                runner.step(f"docker rm -f {c.name}", c.remove, force=True)
            if not containers:
                runner.note(f"no local SageMaker containers of {self.settings.job_name}: nothing to stop")
            return bool(containers)
        from ..aws import lookup

        try:  # a dry run without credentials plans the stop with the job unknown (`down --dry-run` exits 0)
            name = lookup(runner, f"SageMaker training job of {self.settings.job_name}", self._name)
        except DoeksError:
            runner.note("no SageMaker training job to stop")
            return False
        if name is None:
            runner.note(f"would stop the SageMaker training job of {self.settings.job_name} if it is InProgress")
            return False
        before = sagemaker.describe(self.settings, name)["TrainingJobStatus"]
        sagemaker.stop(self.settings, runner, name)
        return before == "InProgress"

    def artifacts(self) -> dict[str, str]:
        record = self._recorded()
        if self.local:
            if not record.get("root"):
                return {}
            root = Path(record["root"])
            if (root / "algo-1" / "model" / "model.pt").exists() and self.describe().state == SUCCEEDED:
                self._package_model(record)
            return {"model": str(root / "output" / "model.tar.gz"), "metrics": str(root / "algo-1" / "output" / "data"),
                    "final": str(root / "algo-1" / "output" / "data" / "final.json"), "checkpoints": str(root / "checkpoints")}
        job = sagemaker.describe(self.settings, self._name())
        result = {"model": job.get("ModelArtifacts", {}).get("S3ModelArtifacts", ""),
                  "output": job["OutputDataConfig"]["S3OutputPath"]}
        if job.get("CheckpointConfig"):
            result["checkpoints"] = job["CheckpointConfig"]["S3Uri"]
        return result


def script_hps(hyper: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in hyper.items() if not k.startswith("sagemaker_")}
