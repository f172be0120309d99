"""TARGET=eks: the kubernetes target on an EKS cluster. What AWS adds: the training image in REGISTRY or this
account's ECR (resolved before anything is applied), the GPU and EFA requests of the node type (doeks.jobspec), and
artifacts copied to S3."""
from __future__ import annotations

from typing import Callable

from .. import kube, trainimage
from ..errors import DoeksError
from .kubernetes import KubernetesTarget


class OnAws:
    """The units on AWS: an EKS cluster made by eksctl, FSx (and EFS) through their CSI drivers, the EFA device plugin
    and the MPI operator, the CloudWatch observability add-on (or agent), each with its Pod Identity role. Mixed into
    EksTarget and SageMakerTarget (SageMaker trains outside the cluster, but `up` on TARGET=sagemaker stands up the
    same EKS side: the pipelines and the shared volume run there)."""

    settings: object
    name: str
    say: Callable
    asks_before_down = True

    def connect(self) -> None:
        """kubectl uses the kubeconfig `eks.connect` wrote for CLUSTER_NAME in AWS_REGION alone (kube.eks_kubeconfig),
        never the user's current context, which may be another cluster's (the user's own kubeconfig is untouched)."""
        kube.use_only(kube.eks_kubeconfig(self.settings))

    def after_up(self, dry_run: bool) -> None:
        return None

    def cluster_running(self) -> bool:
        return True

    def status_rows(self) -> list:
        return []

    # eks
    def cluster_create(self, runner) -> None:
        from .. import eks

        eks.create(self.settings, runner)

    def cluster_delete(self, runner, yes: bool = False) -> None:
        from .. import eks

        s = self.settings
        if not runner.dry_run and not yes:
            import sys

            if not sys.stdin.isatty():
                raise DoeksError(f"eks.delete removes cluster {s.cluster_name} and all it runs: pass --yes to confirm")
            answer = input(f"Delete cluster {s.cluster_name} in {s.aws_region}? Type its name to confirm: ")
            if answer.strip() != s.cluster_name:
                raise DoeksError("not confirmed: nothing deleted")
        eks.delete(s, runner)

    def cluster_status(self) -> None:
        from .. import eks, ui

        s = self.settings
        head, groups = eks.status_rows(s)
        ui.table(f"EKS cluster ({s.aws_region})", ["cluster", "status", "version", "endpoint", "platform"], head)
        if groups:
            ui.table("node groups", ["node group", "status", "instance types", "min/desired/max", "capacity", "processor"], groups)
        try:
            ui.table("nodes", ["node", "instance type", "ready", "nvidia.com/gpu", "vpc.amazonaws.com/efa"], eks.node_rows())
        except Exception as error:  # noqa: BLE001 - the cluster API may be unreachable from here
            ui.say(f"nodes: Kubernetes API not reachable ({type(error).__name__}): run `invoke eks.connect`")

    # csi
    def volume_deploy(self, runner) -> None:
        """FSx for Lustre, the default for training data: the CSI driver, its role, the Lustre security group, fsx-sc
        and the claim."""
        from .. import storage

        storage.fsx_deploy(self.settings, runner)

    def volume_delete(self, runner, force: bool = False) -> None:
        """Reverse volume_deploy (refused while pods use the claim, unless --force), then an EFS that csi.efs.create
        made: its driver, mount targets, file system and security group."""
        from .. import storage

        s = self.settings
        storage.fsx_delete(s, runner, force=force)
        if runner.dry_run or storage.find_efs(s):
            storage.efs_delete(s, runner)
            storage.efs_destroy(s, runner)

    def aws_storage(self, what: str) -> None:
        return None

    def stage_data(self, runner, source: str, relayout_val: bool) -> None:
        from .. import storage

        storage.stage_on_cluster(self.settings, runner, source, relayout_val, session=self.pod_session)

    def pod_session(self, runner, workload) -> str | None:
        """The Secret a workload's pods read their AWS session from (envFrom), or None where EKS Pod Identity's agent
        gives it to them (EKS itself: the eks target, and sagemaker's cluster)."""
        return None

    # efa
    def efa_deploy(self, runner) -> None:
        """The EFA device plugin DaemonSet (EFA instance types only) and the MPI operator (server-side apply). One
        plugin, one owner: eksctl's efaEnabled installs its own DaemonSet (`aws-efa-k8s-device-plugin`, before
        eksctl v0.204.0 doeks' name: efa.EKSCTL_DAEMONSETS), which tolerates no GPU taint; doeks deletes it under
        either name rather than run two plugins or merge into one, and efa.delete removes doeks' own."""
        from .. import efa, kube

        for argv in efa.replace_eksctl_plugin_argvs():
            kube.run(runner, argv)
        kube.apply(runner, efa.device_plugin(self.settings))
        efa.mpi_operator_deploy(runner)

    def efa_delete(self, runner) -> None:
        from .. import efa, kube

        efa.mpi_operator_delete(runner)
        kube.delete(runner, efa.device_plugin(self.settings))

    def efa_status(self) -> None:
        from .. import efa, eks, kube, ui
        from ..runner import Runner

        kube.show(Runner(), ["daemonset", "-n", "kube-system", efa.DAEMONSET])
        ui.table("nodes", ["node", "instance type", "ready", "nvidia.com/gpu", "vpc.amazonaws.com/efa"], eks.node_rows())

    def efa_test(self, runner, nodes: int | None, end: str | None) -> None:
        """nccl-tests all_reduce_perf across GPU nodes, every GPU and EFA adapter of each; fails if NCCL fell back
        to TCP."""
        from .. import efa, jobspec

        s = self.settings
        placement = jobspec.node_type_placement(s)
        if jobspec.idle_gpus_warning(s):  # the test uses every GPU of a node; the job would not
            self.say(jobspec.idle_gpus_warning(s) + "; efa.test measures all of them", style="yellow")
        job = efa.nccl_mpijob(s, nodes, end=end or efa.default_end(placement), placement=placement)
        self.grow_nodes(runner, nodes or max(2, s.gpu_nodes))  # efa.nccl_mpijob's node count
        efa.run_test(s, runner, job, placement.cpu)

    def grow_nodes(self, runner, nodes: int) -> None:
        """The GPU node group grown to `nodes` where it has fewer (eks.scale_for_job): GPU nodes start at GPU_NODES (0)
        and bill once a job needs them."""
        from .. import eks

        if self.settings.gpu_nodes_max > 0 and not self.settings.eks_yaml:
            eks.scale_for_job(self.settings, runner, nodes)

    # gpu-metrics
    def metrics_deploy(self, runner, interval: int, agent: bool) -> None:
        """The amazon-cloudwatch-observability add-on (Container Insights + DCGM exporter), or with `agent` the
        CloudWatch agent DaemonSet on GPU nodes; each with a Pod Identity role; one copy per node (the add-on's agent
        and the DaemonSet would both collect and put the same GPUs)."""
        from .. import aws, gpumetrics, identity, kube, storage, ui

        s = self.settings
        if agent:
            storage.delete_addon(s, runner, gpumetrics.ADDON)
            identity.ensure(s, runner, identity.get("cloudwatch-agent-gpu"))
            kube.apply(runner, gpumetrics.manifests(s, interval))
            return
        kube.delete(runner, [m for m in gpumetrics.manifests(s, interval) if m["kind"] in ("DaemonSet", "ConfigMap")])
        associations = identity.addon_associations(s, runner, identity.get("cloudwatch-observability"))
        if not runner.dry_run and storage.addon_exists(s, gpumetrics.ADDON):
            ui.say(f"add-on {gpumetrics.ADDON} exists")
            return
        runner.call(aws.client(s, "eks"), "create_addon", clusterName=s.cluster_name, addonName=gpumetrics.ADDON,
                    resolveConflicts="OVERWRITE", podIdentityAssociations=associations, tags={storage.TAG: s.cluster_name})

    def metrics_delete(self, runner) -> None:
        from .. import gpumetrics, identity, kube, storage

        s = self.settings
        storage.delete_addon(s, runner, gpumetrics.ADDON)
        identity.remove(s, runner, identity.get("cloudwatch-observability"))
        kube.delete(runner, gpumetrics.delete_manifests(s))
        identity.remove(s, runner, identity.get("cloudwatch-agent-gpu"))

    def metrics_status(self) -> None:
        from .. import gpumetrics, kube
        from ..runner import Runner

        kube.show(Runner(), ["daemonset", "-n", gpumetrics.K8S_NAMESPACE, "-o", "wide"])  # add-on's and agent's

    # kueue
    def queue_deploy(self, runner) -> None:
        """Kueue's release manifests (v0.19.2, with doeks' Configuration) and the queue: a ResourceFlavor of the GPU
        node group's type (EKS' network-topology labels where the type has them; the group's taint tolerated), the
        ClusterQueue's quotas sized by what GPU_NODES_MAX nodes of the type have (EC2's DescribeInstanceTypes)."""
        from .. import kueue

        kueue.deploy(self.settings, runner, kueue.RELEASE_MANIFESTS, [self.gpu_flavor(runner)], own=False)

    def gpu_flavor(self, runner=None):
        """The GPU node group as a Kueue flavor: its type's GPUs, EFA, vCPUs and memory (EC2's answer; offline, doeks'
        tables), GPU_NODES_MAX nodes, the toleration of its taint."""
        from .. import instancetypes, kueue
        from ..jobspec import GPU_TOLERATION

        s = self.settings
        facts = instancetypes.node_facts(s, s.gpu_instance_type, runner)
        return kueue.node_type_flavor(s.gpu_instance_type, tolerations=[dict(GPU_TOLERATION)], facts=facts,
                                      nodes=s.gpu_nodes_max)

    def queue_delete(self, runner) -> None:
        from .. import kueue

        kueue.delete(self.settings, runner, kueue.RELEASE_MANIFESTS, own=False)

    def queue_status(self) -> None:
        from .. import kueue

        kueue.status_tables(self.settings)

    # kubeflow
    def on_cluster(self, step: Callable, here: str, runner) -> None:
        step(self.settings, runner)

    def require_cluster(self, what: str, hint: str) -> None:
        return None

    def placement(self):
        """The GPU node group's instance type: its GPUs (NPROC_PER_NODE) and EFA adapters per pod."""
        from .. import jobspec

        return jobspec.node_type_placement(self.settings)


class EksTarget(OnAws, KubernetesTarget):
    name = "eks"
    builds_image = False
    pod_identity = True

    @classmethod
    def store_defaults(cls, settings) -> dict[str, str]:
        """S3 (s3://S3_BUCKET/doeks/checkpoints and .../models, each job under its name): the FSx volume is deleted by
        `down` (its StorageClass reclaims it), so nothing that must outlive the cluster is kept only there."""
        from ..jobpaths import s3_store

        return s3_store(settings)

    def identity_ensure(self, runner, workload: str, missing: str = "") -> None:
        from .. import identity

        identity.ensure(self.settings, runner, identity.get(workload))

    def identity_remove(self, runner, workload: str) -> None:
        from .. import identity

        identity.remove(self.settings, runner, identity.get(workload))

    def checks(self):
        from .checks import eks_doctor_checks

        return eks_doctor_checks(self.settings)

    @property
    def on_this_machine(self) -> bool:
        return False

    def check_image(self, image: str, runner) -> None:
        trainimage.require_resolved(image)

    def refuse_image(self, image: str) -> None:
        """The image must name a registry; doeks' own content-tagged image must be in this account's ECR (a code
        edit is a new tag that no push has made yet: the pods would sit in ImagePullBackOff)."""
        trainimage.require_resolved(image)
        s = self.settings
        if s.train_image or ".dkr.ecr." not in image or image.split("/")[0] != trainimage.registry_host(s):
            return  # a prebuilt image, or another registry: the user's to push
        if trainimage.in_ecr(s, image.rsplit(":", 1)[1]):
            return
        raise DoeksError(f"training image {image} is not in ECR (the code changed since the last push): run "
                         "`invoke elasticjob.build elasticjob.push` (or `invoke up`), then deploy")

    def refuse(self, plan) -> None:
        self.refuse_image(plan.image)  # the cluster is read when the job is applied (a dry run needs no cluster)

    # -- the job's own AWS identity: its checkpoints and model in S3 ----------------------------------------------------
    def train_service_account(self, settings=None) -> dict | None:
        """The training pods' service account (doeks.identity's `train` row), where the job keeps anything in S3."""
        from .. import identity, jobpaths

        s = settings or self.settings
        return identity.service_account(s, identity.get("train")) if jobpaths.in_s3(s) else None

    def manifests(self, job):
        """The job's manifests as on a cluster, and where its checkpoints or model are in S3 (TARGET=eks's default):
        its pods run as the service account of its own role (Pod Identity) and know the region; the service account
        comes first."""
        from .. import jobpaths

        found = super().manifests(job)
        account = self.train_service_account(job.settings)
        if account is None:
            return found
        env = jobpaths.pod_env(job.settings)
        name = account["metadata"]["name"]
        for manifest in found:
            if manifest["kind"] != "PyTorchJob":
                continue
            for spec in manifest["spec"]["pytorchReplicaSpecs"].values():
                pod = spec["template"]["spec"]
                pod["serviceAccountName"] = name
                for container in pod["containers"]:
                    have = {e["name"] for e in container.setdefault("env", [])}
                    container["env"] += [{"name": k, "value": v} for k, v in env.items() if k not in have]
        return [account] + _watchdog_as(found, f"{job.settings.job_name}-watchdog", name)

    def without_identity(self, settings):
        """The jobs doeks submits besides elasticjob's (their pods run as other service accounts: the TrainJob's, the
        pipeline's default-editor) keep checkpoints and model on the claim, as before eks' S3 default: the S3 default
        is dropped; what the user named stays."""
        volume = {key.lower(): f"{settings.shared_mount.rstrip('/')}/{kind}"
                  for key, kind in (("CHECKPOINT_URI", "checkpoints"), ("MODEL_URI", "models")) if settings.filled(key)}
        return settings.with_overrides(**volume) if volume else settings

    def job_identity_step(self, job):
        """The plan's step giving the job's pods their AWS identity: S3_BUCKET (or the URIs' bucket) made if missing,
        the `train` role with its S3 policy, its Pod Identity association; None where nothing is in S3."""
        from .. import identity, jobpaths
        from .base import Step

        s = job.settings
        if not jobpaths.in_s3(s):
            return None
        workload = identity.get("train")
        policy = identity.train_policy(s)
        objects = [r for st in policy["Statement"] if st["Action"] != "s3:ListBucket" for r in st["Resource"]]
        what = (f"the job's own AWS identity: bucket {', '.join(jobpaths.s3_buckets(s))} (made if missing); role "
                f"{identity.role_name(s, workload)} allowing s3:ListBucket on its prefixes and "
                f"s3:GetObject/PutObject/DeleteObject/AbortMultipartUpload on {', '.join(objects)}; Pod Identity "
                f"association {workload.ns(s)}/{workload.sa(s)} -> that role")
        return Step(what, lambda: self.job_identity(job))

    def job_identity(self, job, runner=None) -> None:
        from .. import identity, jobpaths
        from ..aws import client
        from ..runner import Runner

        from ..quotas import require_own_bucket

        s = job.settings
        runner = runner or Runner(secrets=s.secrets())
        s3 = client(s, "s3")
        require_own_bucket(s, runner, jobpaths.s3_buckets(s))  # one line, not a create's BucketAlreadyExists
        for bucket in jobpaths.s3_buckets(s):
            try:
                s3.head_bucket(Bucket=bucket)
            except Exception:  # noqa: BLE001 - botocore's 404 (a 403 fails the create below with its own line)
                options = {} if s.aws_region == "us-east-1" else {
                    "CreateBucketConfiguration": {"LocationConstraint": s.aws_region}}
                runner.call(s3, "create_bucket", Bucket=bucket, **options)
        identity.ensure(s, runner, identity.get("train"))

    def job_identity_delete(self, runner) -> None:
        """What job_identity (and csi.data.save-model) made for the cluster's jobs: the associations and the roles (the
        bucket and what the jobs wrote there stay: the models and checkpoints outlive the cluster), and the service
        accounts."""
        from .. import identity

        s = self.settings
        for key in ("train", "save-model"):
            workload = identity.get(key)
            identity.remove(s, runner, workload)
            if runner.dry_run or self.cluster_running():
                try:
                    kube.delete(runner, [identity.service_account(s, workload)], wait=False)
                except DoeksError as error:  # the cluster may be out of reach; it goes with the cluster
                    self.say(f"service account {workload.ns(s)}/{workload.sa(s)}: {error}", style="yellow")

    # -- csi.data.save-model: a job's model and checkpoints on the claim, copied to S3 by a Job -------------------------
    SAVE_TIMEOUT = 3 * 3600  # a model and its checkpoints of hundreds of GB through one pod

    def save_model(self, runner, destination: str | None) -> None:
        """The job's model and checkpoints that are on the claim (MODEL_URI / CHECKPOINT_URI not in S3), copied to
        s3://S3_BUCKET/doeks/saved/<JOB_NAME>/<date>/{model,checkpoints}/ by a Job in the training image that mounts
        the claim, as the save-model role (PutObject there only); waited for, then deleted. What is in S3 already
        is said, not copied."""
        import time

        from .. import datastage, identity, jobpaths

        s = self.settings
        found = {"model": jobpaths.model_uri(s), "checkpoints": jobpaths.checkpoint_uri(s)}
        sources = {kind: path for kind, path in found.items() if not path.startswith("s3://")}
        if not sources:
            self.say(f"job {s.job_name}: its model and checkpoints are in S3 already ({found['model']}/model.pt, "
                     f"{found['checkpoints']}): nothing to copy")
            return
        base = jobpaths.saved_uri(s)
        if destination and not destination.rstrip("/").startswith(base):
            workload = identity.get("save-model")
            raise DoeksError(f"--destination {destination}: on TARGET=eks the copy runs as role "
                             f"{identity.role_name(s, workload)}, which writes under {base}/ only: leave --destination out")
        dest = f"{(destination or base).rstrip('/')}/{time.strftime('%Y-%m-%d-%H%M%S')}"
        datastage.split_s3(dest)
        workload = identity.get("save-model")
        identity.ensure(s, runner, workload)
        manifests = [identity.service_account(s, workload), _save_job(s, workload, sources, dest)]
        job = manifests[-1]
        if not runner.dry_run:
            kube.apply(runner, manifests[:1])
            secret = self.pod_session(runner, workload)
            for container in job["spec"]["template"]["spec"]["containers"]:
                if secret:
                    container["envFrom"] = [{"secretRef": {"name": secret}}]
        kube.delete(runner, [job])  # a Job's pod template cannot change: a previous copy's Job goes first
        kube.apply(runner, manifests)
        what = f"copying {', '.join(sources.values())} from claim {s.shared_pvc} to {dest}/"
        name = job["metadata"]["name"]
        if runner.dry_run:
            runner.step(f"wait for Job {s.namespace}/{name} ({what}; at most {self.SAVE_TIMEOUT // 3600} h), then "
                        "delete it (a finished pod keeps the claim)", lambda: None)
            return
        kube.wait_job(s.namespace, name, what, timeout=self.SAVE_TIMEOUT)
        kube.delete(runner, [job])
        for kind in sources:
            self.say(f"job {s.job_name}: {kind} saved to {dest}/{kind}/")

    def saved_copy(self, job: str) -> str | None:
        """The newest copy csi.data.save-model made of job `job` (its dated prefix), or None."""
        from .. import jobpaths
        from ..aws import client

        s = self.settings.with_overrides(job_name=job)
        bucket, _, prefix = jobpaths.saved_uri(s)[len("s3://"):].partition("/")
        try:
            answer = client(s, "s3").list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/", Delimiter="/")
        except Exception:  # noqa: BLE001 - no bucket, no credentials (a dry run): no copy known
            return None
        copies = sorted(p["Prefix"] for p in answer.get("CommonPrefixes", []))
        return f"s3://{bucket}/{copies[-1]}" if copies else None

    # -- down: what is kept, and the one copy of a model it would delete ------------------------------------------------
    def kept_outputs(self, job: str) -> tuple[list[str], str | None]:
        """(lines saying where job `job`'s model and last checkpoint are, the volume URI of its model when the model is
        on the shared volume instead of S3)."""
        from .. import jobpaths

        s = self.settings.with_overrides(job_name=job)
        volume = f"pvc://{s.namespace}/{s.shared_pvc}"
        mount = s.shared_mount.rstrip("/") + "/"

        def on_volume(uri: str) -> str:  # a folder in the pods under SHARED_MOUNT is on the claim
            return f"{volume}/{uri[len(mount):]}" if uri.startswith(mount) else uri

        model = on_volume(jobpaths.model_uri(s, volume)) + "/model.pt"
        checkpoints = on_volume(jobpaths.checkpoint_uri(s, volume))
        lines = [f"job {job}: model {_s3_state(s, model, 'model')}", f"job {job}: checkpoints {_s3_state(s, checkpoints, 'checkpoints')}"]
        return lines, None if model.startswith("s3://") else model

    def before_down(self, runner, force: bool = False) -> None:
        """Say where each job deployed from here (STATE_DIR's runs) keeps its model and last checkpoint; refuse, in one
        line, while a model is on the shared volume `down` deletes (MODEL_URI not in S3) and that volume exists,
        unless `force`. A dry run says the same."""
        from .. import storage
        from . import runs

        s = self.settings
        names = runs.jobs(s, self.name)
        if not names:
            self.say(f"no job was deployed to TARGET={self.name} from here ({s.state_dir / 'runs'}): no model or "
                     "checkpoint to name")
            return
        on_volume = []
        for job in names:
            lines, volume_model = self.kept_outputs(job)
            for line in lines:
                self.say(line)
            copy = self.saved_copy(job) if volume_model else None
            if copy:
                self.say(f"job {job}: a copy saved by csi.data.save-model at {copy} (kept)")
            elif volume_model:
                on_volume.append((job, volume_model))
        if not on_volume or force:
            if on_volume:
                self.say(f"--force: the model(s) on the shared volume go with it: {', '.join(m for _, m in on_volume)}",
                         style="yellow")
            return
        try:
            volume_there = bool(storage.tagged_file_systems(s))
        except Exception:  # noqa: BLE001 - no credentials (a dry run): assume it is there
            volume_there = True
        if not volume_there:
            return
        job, model = on_volume[0]
        more = f" (and {len(on_volume) - 1} more job(s)'s)" if len(on_volume) > 1 else ""
        raise DoeksError(f"the model of job {job}{more} is only on the shared volume that `down` deletes ({model}): copy "
                         f"it to S3 first with `invoke csi.data.save-model --job-name {job}`, or pass --force to delete it")

    def gpu_nodes_step(self, job):
        """The plan's step growing the GPU node group to the job's REPLICAS (eks.scale_for_job): GPU nodes start at
        GPU_NODES (0) and bill once a job needs them; None without a GPU group (GPU_NODES_MAX=0) or with EKS_YAML."""
        from .. import eks
        from ..runner import Runner
        from .base import Step

        s = job.settings
        if s.gpu_nodes_max <= 0 or s.eks_yaml:
            return None
        nodes = min(s.replicas, s.gpu_nodes_max)
        if s.replicas > s.gpu_nodes_max:
            job_warning = (f"warning: REPLICAS={s.replicas} > GPU_NODES_MAX={s.gpu_nodes_max}: the GPU node group "
                           f"grows to {s.gpu_nodes_max} nodes; the job trains on those (MIN_REPLICAS={s.min_replicas})")
            self.say(job_warning, style="yellow")
        return Step(f"grow node group {eks.GPU_GROUP} of cluster {s.cluster_name} to {nodes} {s.gpu_instance_type} "
                    f"nodes where it has fewer (EKS UpdateNodegroupConfig; GPU nodes bill from here)",
                    lambda: eks.scale_for_job(s, Runner(secrets=s.secrets()), nodes))

    def plan(self, job):
        plan = super().plan(job)
        step = self.job_identity_step(job)
        if step is not None:  # before the manifests are applied (the last step)
            plan.steps.insert(len(plan.steps) - 1, step)
        grow = self.gpu_nodes_step(job)
        if grow is not None:
            plan.steps.insert(len(plan.steps) - 1, grow)
        from .. import jobpaths

        checkpoints = jobpaths.checkpoint_uri(job.settings)
        if job.fresh and checkpoints.startswith("s3://"):  # in S3 this machine can clear them: a fresh start
            from .. import elastic
            from .base import Step

            plan.warnings = [w for w in plan.warnings if "--fresh replaces" not in w]
            plan.steps.insert(len(plan.steps) - 1, Step(
                f"remove the checkpoints of {job.name} in {checkpoints}/ (--fresh: the job would resume from them)",
                lambda: elastic.delete_s3_prefix(job.settings, checkpoints)))
        model = jobpaths.model_uri(job.settings)
        if job.fresh and model.startswith("s3://"):  # a model.pt found after this run is this run's
            from .. import elastic
            from .base import Step

            plan.steps.insert(len(plan.steps) - 1, Step(f"remove the previous run's {model}/model.pt (--fresh)",
                                                        lambda: elastic.remove_model(job.settings, model)))
        if not job.settings.train_image and trainimage.is_built(plan.image) is False:
            plan.warnings.append(f"warning: training image {plan.image} (this code's) is not built on this machine; "
                                 "unless it is in the registry already, the pods cannot pull it: "
                                 f"`{trainimage.command(job.settings, 'elasticjob.build elasticjob.push')}`")
        return plan

    def artifacts(self) -> dict[str, str]:
        found = super().artifacts()
        found["copy"] = "invoke csi.data.save-model copies checkpoints to S3"
        return found


def _s3_state(settings, uri: str, what: str) -> str:
    """Where `uri` is and what is there: a model file (exists or not), checkpoints (the one `latest` names); a URI on
    the shared volume as it is (nothing here can read the volume)."""
    if not uri.startswith("s3://"):
        return f"{uri} (on the shared volume: deleted with it)"
    from ..aws import client
    from ..datastage import split_s3
    from ..workload.checkpoints import LATEST

    bucket, key = split_s3(uri)
    try:
        s3 = client(settings, "s3")
        if what == "model":
            s3.head_object(Bucket=bucket, Key=key)
            return f"{uri} (kept: `down` does not delete S3)"
        latest = s3.get_object(Bucket=bucket, Key=f"{key}/{LATEST}")["Body"].read().decode().strip()
        return f"{uri}, the last {uri}/{latest} (kept: `down` does not delete S3)"
    except Exception as error:  # noqa: BLE001 - 404 (none written), or no credentials (a dry run)
        code = getattr(error, "response", {}).get("Error", {}).get("Code", "")
        if code in ("404", "NoSuchKey", "NoSuchBucket", "403", "AccessDenied"):
            return f"{uri} (none written there yet)" if code in ("404", "NoSuchKey", "NoSuchBucket") else \
                f"{uri} (not readable here: {code})"
        return f"{uri} (not looked up: {type(error).__name__})"


def _save_job(settings, workload, sources: dict[str, str], destination: str) -> dict:
    """csi.data.save-model's Job: one container per folder (`python -m doeks.datastage --upload FOLDER s3://...`), in
    the training image (it holds doeks' stager), the claim mounted read-only, as the save-model service account."""
    from .. import trainimage

    s = settings
    image = trainimage.reference(s, on_this_machine=False)
    containers = [{"name": kind, "image": image,
                   "command": ["python", "-m", "doeks.datastage", "--upload", folder, f"{destination}/{kind}"],
                   "env": [{"name": "AWS_REGION", "value": s.aws_region}],
                   "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
                   "volumeMounts": [{"name": "shared", "mountPath": s.shared_mount, "readOnly": True}]}
                  for kind, folder in sources.items()]
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"{s.job_name}-save-model", "namespace": s.namespace,
                         "labels": {"app.kubernetes.io/part-of": "doeks"}},
            "spec": {"backoffLimit": 0, "ttlSecondsAfterFinished": 600, "template": {"spec": {
                "restartPolicy": "Never", "serviceAccountName": workload.sa(s), "containers": containers,
                "volumes": [{"name": "shared", "persistentVolumeClaim": {"claimName": s.shared_pvc}}]}}}}


def _watchdog_as(manifests: list[dict], watchdog: str, account: str) -> list[dict]:
    """The hang watchdog's rights (doeks.jobspec.watchdog_rbac) bound to `account`, the service account the job's
    pods run as where it has an AWS identity of its own (a pod has one service account): its own `watchdog` account,
    which no pod would then use, is left out."""
    kept = []
    for manifest in manifests:
        if manifest["kind"] == "ServiceAccount" and manifest["metadata"]["name"] == watchdog:
            continue
        for subject in manifest.get("subjects", []) if manifest["kind"] in ("RoleBinding", "ClusterRoleBinding") else []:
            if subject.get("kind") == "ServiceAccount" and subject.get("name") == watchdog:
                subject["name"] = account
        kept.append(manifest)
    return kept
