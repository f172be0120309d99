"""TARGET=local: the PyTorchJob interpreted as processes on this machine (doeks.local.jobs): one torchrun agent per
replica, a local etcd for rendezvous, a folder as the shared volume, a supervisor that restarts replicas like pods."""
from __future__ import annotations

import shlex
import time
from pathlib import Path
from typing import Callable, Iterator

from .. import elastic, jobpaths, ui
from ..errors import DoeksError
from ..local import jobs as local_jobs
from ..local import runtime
from ..services import etcd, free_port
from .base import FAILED, PENDING, RESTARTING, RUNNING, STOPPED, SUCCEEDED, Job, JobStatus, Plan, ReplicaStatus, Step, Target
from .follow import FileCursor, follow_until_done
from ..pod.reasons import Reason


class OnThisMachine:
    """The units where the cloud is stood in for on this machine (TARGET=local and docker): the local runtime (etcd,
    the moto AWS-API endpoint) for the cluster, a folder for the shared volume, a sampler for GPU metrics, a local
    all-reduce sweep for EFA, no operators. Mixed into LocalTarget and DockerTarget."""

    settings: object
    name: str
    say: Callable
    HERE = "TARGET=local/docker"

    def status_rows(self) -> list[list]:
        return [[f"local {name}", state, endpoint, pid] for name, state, endpoint, pid in runtime.rows(self.settings)]

    # eks
    def cluster_create(self, runner) -> None:
        self.say(f"{self.HERE}: no cluster; {'the plan for' if runner.dry_run else 'starting'} the local runtime "
                 "(etcd, AWS-API endpoint, volume folder)")
        runtime.up(self.settings, runner)

    def cluster_delete(self, runner, yes: bool = False) -> None:
        self.say(f"{self.HERE}: stopping the local runtime (jobs, etcd, AWS-API endpoint); volumes are kept")
        runtime.down(self.settings, runner)

    def cluster_status(self) -> None:
        ui.table(f"local runtime ({self.HERE})", ["server", "state", "endpoint", "pid"], runtime.rows(self.settings))

    # csi
    def volume_deploy(self, runner) -> None:
        folder = runtime.shared_volume(self.settings)
        runner.step(f"create shared volume folder {folder}", folder.mkdir, parents=True, exist_ok=True)

    def volume_delete(self, runner, force: bool = False) -> None:
        self.say(f"{self.HERE}: keeping {runtime.shared_volume(self.settings)} (data and checkpoints); remove it by "
                 "hand if unwanted")

    def aws_storage(self, what: str) -> None:
        raise DoeksError(f"{what} attach to a cluster: set TARGET=eks (on local the shared volume is the folder "
                         "STATE_DIR/volumes/SHARED_PVC, made by `invoke csi.deploy`)")

    def stage_data(self, runner, source: str, relayout_val: bool) -> None:
        """S3 -> this machine's volume folder with doeks' stager (AWS calls to the moto endpoint or AWS itself)."""
        from .. import aws, datastage

        s = self.settings
        destination = runtime.shared_volume(s) / "data"
        if runner.dry_run:
            runner.step(f"stage {source} -> {destination} with {s.stage_threads} requests in flight", lambda: None)
            return
        with ui.progress() as bar:
            task_id = bar.add_task(f"staging {source}", total=None)
            result = datastage.stage(source, destination, region=s.aws_region, credentials=aws.credentials_of(s),
                                     endpoint_url=aws.endpoint_url(s), concurrency=s.stage_threads,
                                     progress=lambda done, total: bar.update(task_id, completed=done, total=total))
        ui.say(f"staged {result.files} files ({result.bytes / 1e6:.1f} MB) into {destination} in {result.seconds:.1f} s: "
               f"{result.downloaded} downloaded, {result.skipped} already there; verified")
        if relayout_val:
            ui.say(f"val re-layout: {datastage.relayout_val(destination)} files moved into class folders")

    # efa
    def efa_deploy(self, runner) -> None:
        self.say(f"{self.HERE}: no EFA devices here; nothing to deploy (efa.test runs a local all-reduce sweep)")

    def efa_test(self, runner, nodes: int | None, end: str | None) -> None:
        """The same message-size sweep as nccl-tests, with torch.distributed all_reduce across local processes."""
        import os
        import subprocess
        import sys

        from .. import nccl, plots

        s = self.settings
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(s.nproc_per_node),
                "--standalone", str(Path(__file__).resolve().parents[1] / "workload" / "allreduce.py"),
                "-b", "8", "-e", end or "64M", "-f", "2"]
        if runner.dry_run:
            runner.run(argv)
            return
        ui.say(f"{self.HERE}: all_reduce sweep with {s.nproc_per_node} processes (gloo on CPU, nccl on GPUs)")
        result = subprocess.run(argv, capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", **os.environ})
        if result.returncode != 0:
            raise DoeksError(f"the all-reduce sweep failed: {(result.stderr.strip().splitlines() or ['?'])[-1]}")
        out_dir = s.state_dir / "efa"
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "allreduce-local.txt").write_text(result.stdout)
        ui.say(f"log: {out_dir / 'allreduce-local.txt'}")
        nccl.report(result.stdout, plots.plot_path(s, "allreduce-local-busbw.png"),
                    f"all_reduce, {s.nproc_per_node} local processes", require_efa=False)

    # gpu-metrics
    def metrics_deploy(self, runner, interval: int, agent: bool) -> None:
        """The local sampler: nvidia-smi when present, else CPU and memory, put to the AWS-API endpoint."""
        from .. import aws, gpumetrics
        from .. import services

        s = self.settings
        endpoint = "AWS_ENDPOINT_URL" if runner.dry_run else aws.endpoint_url(s)
        sampler = services.gpu_sampler(s.state_dir, endpoint, s.aws_region, s.cluster_name, interval)
        if sampler.info():
            ui.say(f"local GPU-metrics sampler already running (pid {sampler.info()['pid']})")
            return
        runner.step(f"start local GPU-metrics sampler every {interval}s -> {endpoint} (namespace {gpumetrics.NAMESPACE})",
                    sampler.start)

    def metrics_delete(self, runner) -> None:
        from .. import services

        sampler = services.gpu_sampler(self.settings.state_dir)
        if sampler.info() is None:
            ui.say("local GPU-metrics sampler is not running")
            return
        runner.step("stop local GPU-metrics sampler", sampler.stop)

    def metrics_status(self) -> None:
        from .. import services

        info = services.gpu_sampler(self.settings.state_dir).info()
        ui.table("gpu-metrics (local)", ["sampler", "pid"], [["running" if info else "stopped", info["pid"] if info else ""]])

    # kubeflow
    def on_cluster(self, step: Callable, here: str, runner) -> None:
        self.say(f"{self.HERE}: {here}")


class LocalTarget(OnThisMachine, Target):
    name = "local"
    on_this_machine = True
    interprets = True

    def checks(self):
        from .checks import local_checks

        return local_checks(self.settings)

    @property
    def home(self):
        return elastic.home(self.settings)

    def plan(self, job: Job) -> Plan:
        s = job.settings
        plan = self.manifest_plan(job)
        pytorchjob = plan.manifests[-1]
        ctx: dict = {"endpoint": None, "started_etcd": False}
        plan.context = ctx
        source = job.code.source
        plan.steps.append(Step(f"check that job {s.job_name} is not running and its data is in {elastic.data_root(s)}",
                               lambda: self._check(s, job.code)))
        etcd_server = etcd(s.state_dir)
        if s.rdzv_backend.startswith("etcd"):
            if s.etcd_endpoint:
                shown = s.etcd_endpoint.split("://", 1)[-1]
                plan.steps.append(Step(f"use etcd at {s.etcd_endpoint} (ETCD_ENDPOINT)", lambda: start_rendezvous(s, ctx)))
            elif etcd_server.info() is not None:
                shown = etcd_server.endpoint().split("://", 1)[-1]
                plan.steps.append(Step(f"use the running etcd at {shown}", lambda: start_rendezvous(s, ctx)))
            else:
                shown = f"127.0.0.1:{s.etcd_port or 'PORT'}"
                plan.steps.append(Step(f"start etcd (v2 API) on {shown if s.etcd_port else 'a free port of 127.0.0.1'}, data in {etcd_server.home}",
                                       lambda: start_rendezvous(s, ctx)))
        else:
            ctx["endpoint"] = f"127.0.0.1:{free_port()}"
            shown = "127.0.0.1:PORT" if job.dry_run else ctx["endpoint"]  # a shown plan is the same every time
        if jobpaths.in_s3(s):  # checkpoints or model in S3: doeks' moto server (or AWS_ENDPOINT_URL) for the processes
            plan.steps.append(Step(f"S3 for {', '.join(jobpaths.in_s3(s))}: {s.aws_endpoint_url or 'doeks moto server (started if need be; the bucket made there)'}",
                                   lambda: ctx.update(s3_env=elastic.prepare_s3(s))))
        argv, env = local_jobs.replica_command(pytorchjob, runtime.volumes_dir(s), shown, s.local_preload, source)
        for replica in range(s.replicas):
            line = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())) + f" DOEKS_REPLICA={replica}"
            plan.steps.append(Step(f"start node {replica}: {line} {shlex.join(argv)} (in {source})"))
        if job.fresh:
            plan.steps.append(Step(f"remove checkpoints, metrics and model.pt of {s.job_name}", lambda: elastic.clear_outputs(s)))
        plan.steps.append(Step(f"launch job supervisor for {s.job_name} ({s.replicas} nodes x {s.nproc_per_node} processes; "
                               f"checkpoints in {elastic.checkpoint_uri(s)}, model in {elastic.model_uri(s)}, "
                               f"logs in {local_jobs.run_dir(self.home, job.run)})",
                               lambda: self._launch(s, pytorchjob, ctx, job.run, source)))
        return plan

    def refuse_if_running(self) -> None:
        if local_jobs.is_active(self.home):
            raise DoeksError(f"job {self.settings.job_name} is already running: `invoke elasticjob.status`, or "
                             "`invoke elasticjob.delete` first")

    def _check(self, s, code=None) -> None:
        self.refuse_if_running()
        elastic.check_job_data(s, code)

    def refuse(self, plan: Plan) -> None:
        self.refuse_if_running()
        elastic.check_job_data(plan.job.settings, plan.job.code)

    def _launch(self, s, pytorchjob, ctx, run, source) -> None:
        local_jobs.launch(self.home, pytorchjob, runtime.volumes_dir(s), ctx["endpoint"], s.local_preload, run, source,
                          extra_env=ctx.get("s3_env"))

    def abandon(self, plan: Plan) -> None:
        if plan.context.get("started_etcd"):
            etcd(plan.job.settings.state_dir).stop()

    def describe(self) -> JobStatus:
        s = self.settings
        status = local_jobs.read_status(self.home)
        run = _read(self.home / "run")
        if not status:
            deployed = self.home.exists()
            return JobStatus(self.name, s.job_name, PENDING if local_jobs.is_active(self.home) else STOPPED, run=run,
                             reason="" if deployed else "not deployed", fix="" if deployed else "`invoke elasticjob.deploy`")
        state = status["state"]
        if state == "Running" and not local_jobs.is_active(self.home):
            state = STOPPED  # the supervisor is gone without a final word
        replicas = []
        for r in status["replicas"]:
            progress = r.get("progress") or {}
            replica_state = {"Removed": STOPPED}.get(r["state"], r["state"])
            # restarts = the node's (the supervisor restarted its agent) + its workers' (torchrun restarted them)
            replicas.append(ReplicaStatus(f"node-{r['replica']}", replica_state, r["restarts"] + r.get("worker_restarts", 0),
                                          progress.get("step"), progress.get("samples_per_s"), progress.get("world"),
                                          f"pid {r['pid']}" if r.get("pid") else "", progress.get("total"),
                                          progress.get("productive")))
        state = state if state in (RUNNING, SUCCEEDED, FAILED, STOPPED) else RUNNING
        if state == RUNNING and any(r.state == RESTARTING for r in replicas):
            state = RESTARTING  # a node, or torchrun's group in it, is being restarted: not training now
        found = status.get("reason") if state in (RUNNING, RESTARTING, FAILED) else None
        reason = Reason(found["code"], found["text"], found["fix"], found["permanent"]) if found else None
        return JobStatus(self.name, s.job_name, state, run=status.get("run") or run, replicas=replicas,
                         desired=status.get("desired"), restarts=sum(r.restarts for r in replicas),
                         reason=reason.text if reason else "", fix=reason.fix if reason else "",
                         permanent=bool(reason and reason.permanent), notes=[f"watchdog: {line}" for line in status.get("watchdog") or []],
                         ended=status.get("updated") if state in (SUCCEEDED, FAILED) else None)

    def _cursor(self, replica: int | None = None, run: str | None = None) -> FileCursor:
        return FileCursor(local_jobs.run_dir(self.home, run), "replicas/*/agent.log", replica)

    def runs(self) -> list[str]:
        return local_jobs.runs(self.home)

    def logs(self, follow: bool = False, replica: int | None = None, run: str | None = None, tail: int | None = None,
             since: float | None = None) -> Iterator[str]:
        from .follow import check_replica, check_run

        run = check_run(self, run)
        if not run:  # never deployed here: it printed nothing and exited 0
            raise DoeksError(f"job {self.settings.job_name} has no runs on {self.name} yet: `invoke elasticjob.deploy` "
                             "starts one")
        if run == local_jobs.current_run(self.home):
            check_replica(self, replica)
        elif replica is not None and not (local_jobs.run_dir(self.home, run) / "replicas" / str(replica)).is_dir():
            raise DoeksError(f"--replica {replica}: run {run} of job {self.settings.job_name} has no such replica")
        return follow_until_done(self, self._cursor(replica, run), follow and run == local_jobs.current_run(self.home),
                                 tail=tail, since=since)

    def events(self) -> list[str]:
        """The supervisor's record of the current run: starts, exits, restarts, scaling, the end."""
        try:
            return (local_jobs.run_dir(self.home) / "supervisor.log").read_text(errors="replace").splitlines()
        except OSError:
            return []

    def wait(self, timeout: float | None = None, quiet: bool = False) -> JobStatus:
        from .follow import wait_with_progress

        status = wait_with_progress(self, self._cursor(), timeout, quiet)
        deadline = time.monotonic() + 15  # the supervisor writes its last status, then exits
        while local_jobs.is_active(self.home) and time.monotonic() < deadline:
            time.sleep(0.1)
        return status

    def scale(self, replicas: int, runner) -> None:
        self.validate_scale(replicas)
        if not runner.dry_run and not local_jobs.is_active(self.home):
            raise DoeksError(f"job {self.settings.job_name} is not running: start it with `invoke elasticjob.deploy`")
        runner.step(f"scale job {self.settings.job_name} to {replicas} nodes", local_jobs.request_scale, self.home, replicas)

    def cancel(self, runner) -> bool:
        s = self.settings
        if not local_jobs.is_active(self.home):
            runner.note(f"job {s.job_name} is not running (checkpoints kept in {elastic.checkpoint_uri(s)})")
            return False
        runner.step(f"stop job {s.job_name} and all its processes (checkpoints kept)", local_jobs.stop, self.home)
        return True

    def artifacts(self) -> dict[str, str]:
        s = self.settings
        return {"metrics": str(elastic.metrics_dir(s)), "checkpoints": elastic.checkpoint_uri(s),
                "model": elastic.model_uri(s) + "/model.pt",
                "final": str(elastic.metrics_dir(s) / "final.json"), "logs": str(local_jobs.run_dir(self.home) / "replicas")}


def start_rendezvous(settings, ctx: dict) -> None:
    """A plan step of the targets that rendezvous through this machine's etcd (local, docker): ETCD_ENDPOINT or the
    toolkit's own server, started if need be; `ctx` records the endpoint and whether this submission started it."""
    from ..runner import Runner

    ctx["started_etcd"] = not settings.etcd_endpoint and etcd(settings.state_dir).info() is None
    ctx["endpoint"] = runtime.etcd_endpoint(settings, Runner(echo=False))


def _read(path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""
