"""The one interface for where a job runs, cut like TorchX's `Scheduler` and the Kubeflow SDK's runtime backends.

`plan(job)` returns a `Plan`: the dry-run *value* (the manifests, the API requests, the commands and steps). Showing
it is the dry run; `submit(plan)` executes it. After that every verb asks the target: `describe()` -> `JobStatus` in
one state vocabulary for every target, `logs()` -> lines, `scale(n)`, `cancel()` (idempotent), `artifacts()`. A verb
a target cannot do raises `NotSupported`, which the tasks show as one line.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ..errors import DoeksError

# One state vocabulary for jobs and replicas on every target.
PENDING, RUNNING, RESTARTING, SUCCEEDED, FAILED, STOPPED = "Pending", "Running", "Restarting", "Succeeded", "Failed", "Stopped"
STATES = (PENDING, RUNNING, RESTARTING, SUCCEEDED, FAILED, STOPPED)
FINAL = (SUCCEEDED, FAILED, STOPPED)
DRY_RUN_ID = "dry-run"  # a shown plan's run id: each deploy gets a fresh one (jobspec.run_id)


class NotSupported(DoeksError):
    """A verb this target cannot do (the caller should not retry; another target may do it)."""

    def __init__(self, target: str, verb: str, hint: str = ""):
        self.target, self.verb = target, verb
        super().__init__(f"{verb} is not supported on TARGET={target}" + (f": {hint}" if hint else ""))


@dataclass(frozen=True)
class World:
    """How many processes a job starts with: nodes x processes per node, and why it is not REPLICAS x
    NPROC_PER_NODE where a target counts otherwise (SageMaker: its instances, one process per GPU)."""

    nodes: int
    nproc: int
    why: str = ""

    @property
    def size(self) -> int:
        return self.nodes * self.nproc

    def line(self) -> str:
        return f"world {self.size} = {self.nodes} nodes x {self.nproc} processes" + (f" ({self.why})" if self.why else "")


@dataclass
class Job:
    """The job as one value, resolved once (`Target.job`) and handed to the target's verbs: its settings (flags
    applied, its name among them), its code (doeks.code.resolve: the script, its folder, TRAIN_ARGS), the extra
    script arguments, the image its processes run, its world, and whether to start from scratch. `run` names this
    submission (a fresh rendezvous id per deploy); a plan that is only shown (`dry_run`) names it DRY_RUN_ID, so the
    same inputs print the same plan."""

    settings: Any
    train_args: list[str] = field(default_factory=list)
    fresh: bool = False
    run: str = ""
    dry_run: bool = False
    code: Any = None      # doeks.code.Code
    image: str = ""       # the training image, as this target names it ("" until a target resolves it)
    world: World | None = None

    def __post_init__(self):
        if not self.run:
            from ..jobspec import run_id

            self.run = DRY_RUN_ID if self.dry_run else run_id()
        if self.code is None:
            from ..code import resolve

            self.code = resolve(self.settings)

    @property
    def name(self) -> str:
        return self.settings.job_name

    @property
    def args(self) -> list[str]:
        """The script's arguments: the built-in workload's flags (only for it), TRAIN_ARGS, then --train-args."""
        from ..jobspec import train_args

        return train_args(self.settings, code=self.code) + list(self.train_args)


@dataclass
class Step:
    """One thing a submission does, in order: `what` is its line in the dry run, `run` does it."""

    what: str
    run: Callable[[], Any] | None = None


@dataclass
class Plan:
    """The dry-run value: what a submission would create, apply, call and start, in order."""

    target: str
    job: Job
    manifests: list[dict[str, Any]] = field(default_factory=list)   # applied or interpreted (YAML on stdout)
    requests: list[dict[str, Any]] = field(default_factory=list)    # API requests ({"service", "operation", "params"})
    steps: list[Step] = field(default_factory=list)
    image: str = ""
    context: dict[str, Any] = field(default_factory=dict)   # what steps hand on to later steps at run time
    warnings: list[str] = field(default_factory=list)       # shown before the steps, by a dry run and a submission
    interprets: bool = False  # the target runs the manifests itself (local, docker): its steps are the plan to show
    world: World | None = None

    @property
    def shown_manifests(self) -> list[dict[str, Any]]:
        """What a dry run and a submission print on stdout: the manifests a cluster gets; none where the target
        interprets them on this machine (the cluster's GPUs, EFA and node types do not apply: its steps say what
        runs, and `TARGET=kubernetes invoke elasticjob.deploy --dry-run` prints the manifests)."""
        return [] if self.interprets else self.manifests

    def warn(self) -> None:
        from .. import ui

        for warning in self.warnings:
            ui.say(warning, style="yellow")

    def describe(self) -> list[str]:
        """Every step's line, in order (what a dry run prints on stderr)."""
        return [step.what for step in self.steps]

    def show(self, runner) -> None:
        """Print the plan: manifests as one YAML stream and requests as JSON on stdout, each step on stderr."""
        import json

        if self.shown_manifests:
            runner.emit(self.shown_manifests)
        for request in self.requests:
            sys.stdout.write(runner.mask(json.dumps(request, indent=2, default=str)) + "\n")
        sys.stdout.flush()
        self.warn()
        if self.world is not None:
            runner.note(self.world.line())
        for step in self.steps:
            runner.step(step.what, lambda: None)


@dataclass
class ReplicaStatus:
    name: str
    state: str
    restarts: int = 0
    step: int | None = None
    samples_per_s: float | None = None
    world: int | None = None
    detail: str = ""     # pid, container id, pod name, host ...
    total: int | None = None  # the steps the run will take, when the script said so (doeks.report total=)
    productive: float | None = None  # seconds of step time its model state holds (goodput's numerator)


@dataclass
class JobStatus:
    target: str
    name: str
    state: str
    run: str = ""
    replicas: list[ReplicaStatus] = field(default_factory=list)
    desired: int | None = None
    restarts: int = 0
    reason: str = ""       # why it is not training (doeks.pod.reasons), "" when nothing is wrong
    fix: str = ""          # what to do about it
    permanent: bool = False  # a restart cannot help (bad arguments, missing data, import error)
    queue: str = ""        # a queued job: its queue and admission, as Kueue says (doeks.kueue.Admission.line)
    # what the job went through, one line each, oldest first: the hang watchdog's steps (doeks.pod.watchdog), a lost node
    notes: list[str] = field(default_factory=list)
    ended: float | None = None  # when a final job ended (time.time()), where the target tells
    # pods that cannot start, by name: (reason, the kubelet's words) (doeks.kube.stuck); a wait ends on them
    stuck: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.state in FINAL

    def rows(self) -> list[list[Any]]:
        return [[r.name, r.state, r.restarts, "" if r.step is None else r.step,
                 "" if r.samples_per_s is None else r.samples_per_s, "" if r.world is None else r.world, r.detail]
                for r in self.replicas]


COLUMNS = ["replica", "state", "restarts", "step", "samples/s", "world", "where"]


class Place:
    """Where things run: what each unit folder's tasks do on this target (`eks/`: the cluster; `csi/`: the shared
    volume and data; `efa-device-plugin/`: EFA and the MPI operator; `gpu-metrics/`: the metrics agent; `kubeflow/`:
    the operators on the cluster; `kueue/`: queues and quotas; `elasticjob/`: what the job needs before it is
    deployed). The defaults answer with one line saying there is nothing to do here, so a target overrides only what
    it has (kind's Provider)."""

    @classmethod
    def store_defaults(cls, settings) -> dict[str, str]:
        """Where the job's checkpoints and final model go on this target when CHECKPOINT_URI / MODEL_URI are left
        empty ({key: value}; doeks.targets.settled fills them in). The base: nothing, the shared volume (a folder
        here, the cluster's claim), which outlives the job."""
        return {}

    def say(self, line: str, **kwargs) -> None:
        from .. import ui

        ui.say(line, **kwargs)

    def nothing(self, what: str) -> None:
        """One line: this target has nothing of a unit's (the default answer of every unit verb)."""
        self.say(f"TARGET={self.name}: {what}")

    # -- root tasks -------------------------------------------------------------------------------------------------
    def connect(self) -> None:
        """Point this process's kubectl and Kubernetes client at the target's cluster (every task calls it first)."""

    def after_up(self, dry_run: bool) -> None:
        """What `up` prints last (TARGET=kubernetes: the `export KUBECONFIG=...` line)."""

    def teardown_what(self) -> str:
        """What `down` deletes, in the one question it asks when `asks_before_down`."""
        s = self.settings
        return f"cluster {s.cluster_name} in {s.aws_region} and everything doeks made for it"

    def status_rows(self) -> list[list[Any]]:
        """Rows (what, state, detail, id/pid) the root `status` adds for what runs here for this target."""
        return []

    # -- unit eks: the cluster, or what stands in for it -------------------------------------------------------------
    def cluster_create(self, runner) -> None:
        self.nothing("no cluster to create")

    def cluster_delete(self, runner, yes: bool = False) -> None:
        self.nothing("no cluster to delete")

    def cluster_status(self) -> None:
        self.nothing("no cluster")

    def cluster_running(self) -> bool:
        """False when the target's cluster is one doeks runs here and it is stopped (its units have nothing on it)."""
        return True

    # -- unit csi: the shared volume, its data -----------------------------------------------------------------------
    def volume_deploy(self, runner) -> None:
        self.nothing("no shared volume to make")

    def volume_delete(self, runner, force: bool = False) -> None:
        self.nothing("no shared volume to delete")

    def aws_storage(self, what: str) -> None:
        """Raise unless EFS/FSx can attach to this target's cluster (csi.efs.*, csi.fsx.*)."""
        raise DoeksError(f"{what} attach to an EKS cluster: set TARGET=eks (TARGET={self.name} makes its shared volume "
                         "with `invoke csi.deploy`)")

    def stage_data(self, runner, source: str, relayout_val: bool) -> None:
        raise NotSupported(self.name, "csi.data.stage")

    # -- unit efa: EFA, the MPI operator, the all-reduce test --------------------------------------------------------
    def efa_deploy(self, runner) -> None:
        self.nothing("no EFA device plugin to deploy")

    def efa_delete(self, runner) -> None:
        self.nothing("no EFA device plugin was deployed; nothing to delete")

    def efa_status(self) -> None:
        self.nothing("no EFA devices")

    def efa_test(self, runner, nodes: int | None, end: str | None) -> None:
        raise NotSupported(self.name, "efa.test")

    # -- unit gpu-metrics ---------------------------------------------------------------------------------------------
    def metrics_deploy(self, runner, interval: int, agent: bool) -> None:
        self.nothing("no GPU-metrics agent to deploy")

    def metrics_delete(self, runner) -> None:
        self.nothing("no GPU-metrics agent was deployed; nothing to delete")

    def metrics_status(self) -> None:
        self.nothing("no GPU-metrics agent")

    # -- unit kubeflow: what runs on the target's cluster ------------------------------------------------------------
    def on_cluster(self, step: Callable, here: str, runner) -> None:
        """Run `step(settings, runner)` on the target's cluster; a target without one says `here` instead."""
        self.nothing(here)

    def grow_nodes(self, runner, nodes: int) -> None:
        """Make room for a job of `nodes` nodes where nodes are started for jobs (EKS' GPU node group); nothing here."""
        return None

    def require_cluster(self, what: str, hint: str) -> None:
        """Raise when `what` (TrainJobs, PyTorchJobs) cannot run on this target: it has no Kubernetes cluster."""
        raise DoeksError(f"TARGET={self.name}: {what} run on a cluster (TARGET=kubernetes or eks); here {hint}")

    def placement(self):
        """What each training pod asks for and its node selector on this target's nodes (a doeks.jobspec.Placement:
        GPUs, EFA, CPU). The base: EKS's GPU node type, as the manifests a target on this machine interprets say."""
        from ..jobspec import node_type_placement

        return node_type_placement(self.settings)

    def pipeline_job(self) -> dict[str, Any]:
        """The job the KFP pipeline's kubernetes branch submits. Compiled where there is no cluster of the target's
        own (this machine, SageMaker), it is EKS's."""
        from . import get

        return get(self.settings.with_overrides(target="eks")).pipeline_job()

    def ensure_images(self, runner, refs: list[str]) -> None:
        """Make the images `refs` available to the target's nodes (doeks' own cluster imports them; elsewhere a
        registry serves them)."""

    def fresh_step(self, job_name: str) -> Step:
        """--fresh on a cluster's job: the step removing its checkpoints and metrics, or a refusal saying why not."""
        raise DoeksError(f"--fresh removes checkpoints/{job_name} from the shared claim, which is not on this machine "
                         f"on TARGET={self.name}: use another JOB_NAME to start over")

    def identity_ensure(self, runner, workload: str, missing: str = "") -> None:
        """The AWS role of `workload` (doeks.identity) for its pods; a target without Pod Identity says `missing`."""
        if missing:
            self.nothing(missing)

    def identity_remove(self, runner, workload: str) -> None:
        """Remove what identity_ensure made (nothing where there is no Pod Identity)."""

    def without_identity(self, settings):
        """`settings` for a job whose pods get no AWS identity of their own (kubeflow.pytorchjob.submit and
        trainjob.submit, the pipeline's kubernetes branch): where this target's own defaults put checkpoints or the
        model in S3, they stay on the shared volume instead. The same settings where nothing needs one."""
        return settings

    def save_model(self, runner, destination: str | None) -> None:
        """csi.data.save-model: the job's checkpoints (and final model) copied to S3 under a dated prefix, from where
        this target keeps them on this machine (default s3://S3_BUCKET/models/JOB_NAME/<date>)."""
        import time

        from .. import aws, datastage, ui

        s = self.settings
        folder = self.local_artifact("checkpoints", "csi.data.save-model", "the checkpoints are in {where}, not on "
                                     "this machine (SageMaker keeps the model in S3 already)")
        if not folder.is_dir() or not any(folder.iterdir()):
            raise DoeksError(f"no checkpoints in {folder}: train first (invoke elasticjob.deploy)")
        uri = f"{(destination or f's3://{s.s3_bucket}/models/{s.job_name}').rstrip('/')}/{time.strftime('%Y-%m-%d-%H%M%S')}"
        datastage.split_s3(uri)
        if runner.dry_run:
            runner.step(f"upload {folder} -> {uri}", lambda: None)
            return
        client = datastage.s3_client(aws.endpoint_url(s), s.aws_region, 16, aws.credentials_of(s))
        count = datastage.upload_tree(client, folder, uri)
        ui.say(f"uploaded {count} files to {uri}")

    def job_identity_delete(self, runner) -> None:
        """Remove the AWS identity a deploy gave the training pods (`down`'s elasticjob step); nothing where the pods
        have none."""

    def before_down(self, runner, force: bool = False) -> None:
        """Before `down` deletes anything: where each job's model and last checkpoint are; raise when `down` would
        delete the only copy of a model (unless `force`). Nothing where `down` deletes no job's outputs."""

    # -- unit kueue: queues, quotas, topology ------------------------------------------------------------------------
    def queue_deploy(self, runner) -> None:
        self.nothing("no cluster for Kueue: jobs here start at once, with no queue")

    def queue_delete(self, runner) -> None:
        self.nothing("no Kueue was deployed; nothing to delete")

    def queue_status(self) -> None:
        self.nothing("no queue (Kueue runs on a cluster)")

    # -- unit elasticjob: what the job needs before it is deployed ---------------------------------------------------
    def image_push(self, runner, build: bool = True) -> str:
        """The training image built (unless `build` is False: elasticjob.push) for where the cluster runs it and
        pushed to REGISTRY or this account's ECR (`up`'s elasticjob step on a cluster); returns the reference the
        manifests name."""
        from .. import trainimage

        if build:
            trainimage.build(self.settings, runner, on_this_machine=False)
        return trainimage.push(self.settings, runner, on_this_machine=False)

    def job_needs(self, build: Callable[[], Any], data: Callable[[], Any], cluster: Callable[[], Any]) -> None:
        """`up`'s elasticjob step before the deploy: `build()` the training image where this target runs it, then
        the data where the job reads it: `data()` (made if missing) on this machine's volume, else `cluster()` (the
        image pushed and the data staged from S3 into the cluster's claim)."""
        if self.builds_image:
            build()
        if self.on_this_machine:
            data()
        else:
            cluster()

    # -- preflight --------------------------------------------------------------------------------------------------
    def checks(self) -> list[tuple[str, bool, str, bool]]:
        """What `invoke doctor` shows: (check, ok, detail or fix, needed) for this target."""
        raise NotSupported(self.name, "checks")


class JobBackend:
    """How a job runs on a target: the verbs the elasticjob tasks, the demo and the pipeline call, and nothing else
    (TorchX's Scheduler: a dozen). `submit` runs the plan's steps and nothing outside them."""

    VERBS = ("job", "plan", "refuse", "submit", "run_name", "describe", "logs", "runs", "events", "scale", "cancel",
             "end_failed", "artifacts", "wait")

    # -- submission -------------------------------------------------------------------------------------------------
    def job(self, train_args=(), fresh: bool = False, dry_run: bool = False, run: str = "") -> Job:
        """The job as one value, resolved once, here: its code, the image this target runs it in, its world. Every
        verb after this one reads it from the Job, none resolves it again."""
        from .. import trainimage
        from ..code import resolve

        code = resolve(self.settings)
        return Job(self.settings, list(train_args), fresh, run, dry_run, code=code,
                   image=trainimage.reference(self.settings, self.on_this_machine, code), world=self.world())

    def plan(self, job: Job) -> Plan:
        raise NotSupported(self.name, "plan")

    def refuse(self, plan: Plan) -> None:
        """Raise the DoeksError a submission of `plan` would meet (the job runs already, its image is not built or not
        resolved, its data is missing): called before anything of the plan is printed, so a refusal is the first and
        only thing said. The submission's own steps check again (another shell may have deployed meanwhile)."""

    def submit(self, plan: Plan, runner) -> None:
        """Execute a plan's steps in order (each through the runner, so secrets stay masked), and nothing else: what
        `--dry-run` lists is what runs (TorchX's submit is schedule(submit_dryrun())). Then record the run; a step
        that fails first has `abandon` undo what this submission started."""
        if not getattr(runner, "dry_run", False):
            plan.warn()
        try:
            for step in plan.steps:
                if step.run is not None:
                    runner.step(step.what, step.run)
        except BaseException:
            self.abandon(plan)
            raise
        if not getattr(runner, "dry_run", False):
            self.record_run(plan)

    def run_name(self, plan: Plan) -> str:
        """The id describe() will report for this submission's run (the rendezvous id; SageMaker: the job's name)."""
        return plan.job.run

    # -- after submission -------------------------------------------------------------------------------------------
    def describe(self) -> JobStatus:
        raise NotSupported(self.name, "describe")

    def logs(self, follow: bool = False, replica: int | None = None, run: str | None = None, tail: int | None = None,
             since: float | None = None) -> Iterator[str]:
        """Log lines of the current run (or `run`), prefixed by replica; `tail`: the last N lines first; `since`: a
        time.time() value, lines from then on."""
        raise NotSupported(self.name, "logs")

    def runs(self) -> list[str]:
        """The runs whose logs this target can still show, oldest first."""
        return []

    def events(self) -> list[str]:
        """What happened to the job's replicas, one line each, oldest first (starts, restarts, exits, k8s events)."""
        return []

    def scale(self, replicas: int, runner) -> None:
        raise NotSupported(self.name, "scale")

    def cancel(self, runner) -> bool:
        """Stop the job and everything it started; True if something was running. Safe to call twice."""
        raise NotSupported(self.name, "cancel")

    def end_failed(self, runner, status: JobStatus | None = None) -> None:
        """End a job whose reason is permanent (`--follow` does, as the local supervisor does by itself): nothing of it
        runs after, and what says why (`status`: what the follow saw, when it has it) stays for `status` and `logs`
        where the target can keep it."""
        self.cancel(runner)

    def artifacts(self) -> dict[str, str]:
        """Where the job's outputs live: metrics, checkpoints, model (paths, s3:// or pvc:// URIs)."""
        raise NotSupported(self.name, "artifacts")

    def wait(self, timeout: float | None = None, quiet: bool = False) -> JobStatus:
        """Stream logs with a progress bar until the job ends; returns the final status."""
        raise NotSupported(self.name, "wait")


class JobPlanning:
    """What a target builds its plans and answers from (the world, the manifests, the image step, the run record):
    called by the targets themselves, not by the tasks."""

    def world(self) -> World:
        """Nodes x processes the job starts with on this target (REPLICAS x NPROC_PER_NODE)."""
        return World(self.settings.replicas, self.settings.nproc_per_node)

    def image_step(self, job: Job) -> Step | None:
        """Where this target runs the training image built on this machine (docker, doeks' own cluster, SageMaker
        local mode): a step that builds it when none is built for the job's code, saying so (a deploy of a script
        named by a flag said "not built: run `invoke elasticjob.build`", and that command, without the flag, found
        another image up to date). None when it is there, or is TRAIN_IMAGE (never built here)."""
        from .. import trainimage
        from ..runner import Runner

        if not (self.builds_image and self.on_this_machine) or job.settings.train_image:
            return None
        if trainimage.is_built(job.image) is not False:
            return None
        s = job.settings
        return Step(f"build the training image {job.image}: none is built for this code ({job.code.shown()}); as "
                    f"`{trainimage.command(s, 'elasticjob.build')}` does (the first build makes the CPU torch base "
                    "too: minutes)", lambda: trainimage.build(s, Runner(secrets=s.secrets()), True, job.code))

    def manifests(self, job: Job) -> list[dict]:
        """The job's Kubernetes manifests (etcd, PyTorchJob) naming the training image as this target pulls it: from
        REGISTRY/ECR on eks, the local tag on this machine. The local target does not run the image (its script runs
        from this checkout's doeks/workload, which the image's /workspace holds), so there it need not be built."""
        from .. import jobspec, trainimage

        return jobspec.manifests(job.settings, job.train_args, job.run,
                                 image=job.image or trainimage.reference(job.settings, self.on_this_machine, job.code),
                                 placement=self.placement(), code=job.code)

    def manifest_plan(self, job: Job) -> Plan:
        """A plan's start for the targets that run the manifests (eks) or interpret them (local, docker): the training
        arguments checked against the script's own parser, the manifests, and the image their workers run."""
        from .. import jobspec

        if job.code.builtin:  # a user's script parses its own arguments
            check_train_args(job.train_args)
        manifests = self.manifests(job)
        plan = Plan(self.name, job, manifests=manifests, image=jobspec.worker_pod(manifests[-1])["containers"][0]["image"],
                    interprets=self.interprets, world=job.world or self.world())
        warning = "" if self.on_this_machine else jobspec.idle_gpus_warning(job.settings)
        if warning:  # GPUs per node follow the node: a setting that leaves some idle is a warning in the plan
            plan.warnings.append(warning)
        return plan

    def abandon(self, plan: Plan) -> None:
        """Undo what a failed submission of `plan` started (never a job already running); nothing by default."""

    def record_run(self, plan: Plan) -> None:
        """Every submission is a run in STATE_DIR/runs/<job>.json (`elasticjob.history`), whoever submits it: a task,
        the demo, the scaling runs, the pipeline."""
        from . import runs

        self.submitted = plan.job  # what `wait` follows
        runs.start(plan.job.settings, self.name, self.run_name(plan), plan.job.train_args, code=plan.job.code)

    def validate_scale(self, replicas: int) -> None:
        s = self.settings
        if not (s.min_replicas <= replicas <= s.max_replicas):
            raise DoeksError(f"--replicas {replicas} is outside MIN_REPLICAS:MAX_REPLICAS = {s.min_replicas}:{s.max_replicas}")

    def local_artifact(self, key: str, verb: str, hint: str):
        """An artifact folder when the target keeps it on this machine; else NotSupported for `verb`, with `hint`
        (formatted with `where`, the artifact's location) saying where it is."""
        from pathlib import Path

        where = self.artifacts().get(key, "")
        if not where or "://" in where:
            raise NotSupported(self.name, verb, hint.format(where=where or "the job"))
        return Path(where)


class Target(Place, JobBackend, JobPlanning):
    """A place to run (Place: the units' verbs) with a way to run jobs there (JobBackend: the job's verbs); a subclass
    overrides what it can do. Constructed once from settings. A unit task parses its flags, asks the target and shows
    or runs what it answers; nothing outside doeks.targets asks which target it is on."""

    name = "?"
    on_this_machine = False       # the job's containers/processes run here (local image name, CPU base)
    builds_image = False          # it runs containers of the training image built here (`up` builds it first)
    interprets = False            # it runs the job's manifests itself, as processes or containers here
    asks_before_down = False      # `down` deletes something that costs money: it asks once (or --yes)
    pod_identity = False          # pods get AWS roles through EKS Pod Identity

    def __init__(self, settings):
        self.settings = settings


class TrainArgsError(Exception):
    pass


def check_train_args(train_args: list[str]) -> None:
    """Refuse arguments the training script would refuse, before anything starts: parse them with the script's own
    parser (doeks/workload/train.py is the file every target runs). Raises DoeksError with argparse's message."""
    from ..workload import train

    if not train_args:
        return
    parser = train.build_parser()

    def refuse(message):
        raise TrainArgsError(message)

    parser.error = refuse  # argparse would print usage and exit 2
    try:
        train.parse_args(list(train_args), parser)
    except TrainArgsError as error:
        raise DoeksError(f"--train-args {' '.join(train_args)!r}: train.py: error: {error} "
                         "(`python doeks/workload/train.py --help` lists its arguments)") from None
    except SystemExit:  # --help / --version
        raise DoeksError(f"--train-args {' '.join(train_args)!r}: not a training run (--help exits)") from None
