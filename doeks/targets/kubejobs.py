"""Jobs on any Kubernetes cluster, the job half of TARGET=kubernetes (and so of eks): the job's manifests (PyTorchJob,
TrainJob, MPIJob) applied with kubectl, its status from the job's conditions, pods and events, its logs, scale, cancel
and artifacts. KubernetesTarget mixes it in beside the cluster's verbs (doeks.targets.kubernetes)."""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, Iterator

from .. import jobspec, kube, trainimage
from ..cluster import volume as own
from ..local.jobs import parse_progress, restarting
from ..errors import DoeksError
from .base import (FAILED, PENDING, RESTARTING, RUNNING, STOPPED, SUCCEEDED, Job, JobStatus, Plan, ReplicaStatus,
                   Step)
from ..pod import reasons

_CONDITIONS = {"Created": PENDING, "Running": RUNNING, "Restarting": RESTARTING, "Succeeded": SUCCEEDED,
               "Failed": FAILED, "Suspended": STOPPED}
_POD_PROBLEMS = ("CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "CreateContainerConfigError", "OOMKilled")


class KubernetesJobs:
    """The job verbs of a Kubernetes target (self is the target: settings, own, cluster_running come from it)."""

    def placement(self):
        """KUBE_GPUS GPUs (or a CPU share where it trains on CPU, as on doeks' own cluster), KUBE_MEMORY, NODE_LABELS;
        on doeks' own cluster the extra nodes' taint tolerated (they are for training pods: versions.WORKER_TAINT)."""
        placement = jobspec.cluster_placement(self.settings)
        if self.own:
            from ..cluster import versions

            placement.tolerations.append({"key": versions.WORKER_TAINT["key"], "operator": "Exists",
                                          "effect": versions.WORKER_TAINT["effect"]})
        return placement

    def ensure_images(self, runner, refs: list[str]) -> None:
        """doeks' own cluster pulls nothing: the images (built here) are imported into the node first."""
        if self.own:
            from ..cluster import images

            images.ensure(runner, refs)

    def fresh_step(self, job_name: str) -> Step:
        if not self.own:
            return super().fresh_step(job_name)
        from .. import elastic

        s = self.settings
        return Step(f"remove checkpoints, metrics and model.pt of {job_name} (in the claim's folder)",
                    lambda: elastic.clear_outputs(s))

    def pipeline_job(self) -> dict[str, Any]:
        """The pipeline's kubernetes branch's job (PIPELINE_JOB_KIND), fixed size, in KFP_NAMESPACE, as this cluster
        runs it (no instance-type selector, KUBE_GPUS, the image as the cluster has it)."""
        from .. import trainjob

        s = self.without_identity(self.settings.with_overrides(namespace=self.settings.kfp_namespace))
        if s.pipeline_job_kind == "trainjob":
            return trainjob.trainjob(s, placement=self.placement())
        return jobspec.pytorchjob_fixed(s, placement=self.placement())

    @property
    def on_this_machine(self) -> bool:
        """doeks' own cluster runs here: the image is built and imported here, the claim's folder is on this disk."""
        return self.settings.own_cluster

    def manifests(self, job: Job) -> list[dict]:
        """The base's, with the hang watchdog's service account (it acts through this cluster's API server)."""
        return jobspec.manifests(job.settings, job.train_args, job.run,
                                 image=job.image or trainimage.reference(job.settings, self.on_this_machine, job.code),
                                 placement=self.placement(), code=job.code, account=True)

    def plan(self, job: Job) -> Plan:
        """Every step a submission takes, in order, and nothing outside them (`--dry-run` lists exactly these): the
        image built and imported where doeks' own cluster runs it, a previous job of the name replaced, the claim's
        outputs cleared (--fresh, where they are on this machine), the manifests applied."""
        from ..runner import Runner, to_yaml_stream

        s = job.settings
        plan = self.manifest_plan(job)
        build = self.image_step(job)  # doeks' own cluster: built here, then imported
        if build is not None:
            plan.context["builds"] = build
            plan.steps.append(build)
        if self.on_this_machine:
            etcd = f" and {s.etcd_image}" if s.rdzv_backend.startswith("etcd") else ""
            plan.steps.append(Step(f"import {plan.image}{etcd} into doeks' cluster's nodes where missing",
                                   lambda: self.check_image(plan.image, Runner(secrets=s.secrets()))))
        plan.steps.append(Step(f"delete a previous PyTorchJob {s.job_name} that has ended (a running one only with "
                               "--fresh) and its pods", lambda: self._replace_previous(plan, Runner(secrets=s.secrets()))))
        if job.fresh and self.on_this_machine:  # doeks' own cluster: the claim's folder is here
            plan.steps.append(self.fresh_step(job.name))
        elif job.fresh:  # the claim is storage of that cluster: nothing here can clear it
            plan.warnings.append(f"--fresh replaces a running {job.name}, but its checkpoints on claim "
                                 f"{s.shared_pvc} are not on this machine: the job resumes from them; "
                                 "use another JOB_NAME to start over")
        kinds = ", ".join(f"{m['kind']}/{m['metadata']['name']}" for m in plan.manifests)
        apply = ["apply", "--server-side", "--field-manager=doeks", "--force-conflicts", "-f", "-"]
        plan.steps.append(Step(f"kubectl {' '.join(apply)} ({kinds} in namespace {s.namespace})",
                               lambda: kube.run(Runner(secrets=s.secrets()), apply, input=to_yaml_stream(plan.manifests))))
        return plan

    def run_name(self, plan: Plan) -> str:
        """What describe() reports as the run: the PyTorchJob's rendezvous id."""
        return plan.manifests[-1]["spec"].get("elasticPolicy", {}).get("rdzvId") or plan.job.run

    def refuse(self, plan: Plan) -> None:
        """Before anything is printed: the image (doeks' own cluster: built here; eks: resolved to a registry) and a
        job of the same name still running without --fresh."""
        if not plan.context.get("builds"):
            self.refuse_image(plan.image)
        if own.stopped(self.settings):
            raise DoeksError("doeks' cluster is not running: `TARGET=kubernetes invoke up` starts it")
        from .. import kueue

        kueue.require_local_queue(self.settings)
        elsewhere = own.volume_elsewhere(self.settings)
        if elsewhere:
            raise DoeksError(f"doeks' cluster keeps its shared volume on {elsewhere} (it was brought up with another "
                             f"STATE_DIR), not under this STATE_DIR ({self.settings.state_dir}): the job would read and "
                             f"write there; `TARGET=kubernetes invoke up` with this STATE_DIR moves it, or set "
                             f"STATE_DIR back to {Path(elsewhere).parent.parent}")
        self._previous(plan)

    def refuse_image(self, image: str) -> None:
        if self.on_this_machine:
            trainimage.require_image(image, self.settings)

    def _previous(self, plan: Plan) -> str | None:
        """The state of a PyTorchJob of the same name already on the cluster (None: there is none); a running one is
        refused unless the plan is --fresh."""
        s = self.settings
        if self._get(["pytorchjob", s.job_name, "-n", s.namespace]) is None:
            return None
        state = self.describe().state
        if state not in (SUCCEEDED, FAILED, STOPPED) and not plan.job.fresh:
            raise DoeksError(f"job {s.job_name} is already on the cluster ({state}): `invoke elasticjob.status` to "
                             "watch it, `invoke elasticjob.delete` to stop it, or deploy --fresh to replace it")
        return state

    def _replace_previous(self, plan: Plan, runner) -> None:
        """A previous PyTorchJob of the same name is deleted first (a running one only with --fresh): applying over a
        finished one would change its spec and never train again."""
        state = None if runner.dry_run else self._previous(plan)
        if state is None:
            return
        job = [m for m in plan.manifests if m["kind"] == "PyTorchJob"]
        runner.step(f"delete the previous PyTorchJob {self.settings.job_name} ({state}) and its pods",
                    lambda: kube.delete(runner, job))

    def check_image(self, image: str, runner) -> None:
        """On doeks' own cluster the image must be built and imported here (no registry to pull from)."""
        if self.on_this_machine and not runner.dry_run:
            from ..cluster import images

            refs = [image]
            if self.settings.rdzv_backend.startswith("etcd"):
                images.etcd_job_image(self.settings)
                refs.append(self.settings.etcd_image)
            images.ensure(runner, refs, warmed=(image,))

    def _get(self, args: list[str]) -> dict[str, Any] | None:
        return kube.get_json(args)

    def describe(self) -> JobStatus:
        """The job's state from its conditions, each replica's from its pod and log, and the reason when something is
        wrong. The reads that do not depend on each other go at once (the job, its pods, its Workload in a queue, and
        for a large job the Kubernetes client that reads its logs): at 256 replicas one after another took twice as
        long (bench/scale.py)."""
        from concurrent.futures import ThreadPoolExecutor

        from .. import kueue


        s = self.settings
        with ThreadPoolExecutor(3) as pool:
            pods_read = pool.submit(self._pods, True)
            job = self._get(["pytorchjob", s.job_name, "-n", s.namespace])
            if job is None:
                return self._kept() or JobStatus(self.name, s.job_name, STOPPED,
                                                 reason=f"no PyTorchJob {s.job_name} in namespace {s.namespace}")
            if (job["spec"]["pytorchReplicaSpecs"]["Worker"].get("replicas") or 0) > KUBECTL_BURST:
                pool.submit(kube.log_client)  # imported while the pods and the Workload are read
            # a job of a queue: Kueue's Workload says whether it is admitted, or why not
            queue_read = pool.submit(kueue.admission, job)
            every = pods_read.result()
            queued = queue_read.result()
        conditions = [c for c in job.get("status", {}).get("conditions", []) if c.get("status") == "True"]
        state = _CONDITIONS.get(conditions[-1]["type"], RUNNING) if conditions else PENDING
        reason = conditions[-1].get("message", "") if conditions and state == FAILED else ""
        pods = [p for p in every if not _is_etcd(p)]
        by_pod = self._pod_logs(names=[p["metadata"]["name"] for p in every]) if pods else {}
        replicas = []
        signals: list[str] = []     # container waiting / terminated reasons (CrashLoopBackOff, OOMKilled, ...)
        exit_codes: list[int] = []
        messages: list[str] = [reason] if reason else []
        last_words: list[str] = []  # the failed lives' last log lines the kubelet kept (terminationMessagePolicy)
        for pod in pods:
            statuses = pod.get("status", {}).get("containerStatuses", [])
            restarts = sum(c.get("restartCount", 0) for c in statuses)
            waiting = next((c["state"]["waiting"].get("reason") for c in statuses if "waiting" in c.get("state", {})), "")
            for c in statuses:
                for when in ("lastState", "state"):
                    ended = c.get(when, {}).get("terminated") or {}
                    if ended.get("exitCode"):
                        last_words += ended.get("message", "").splitlines()
                # lastState stays after a recovery: it only explains a container that is not running again
                for when in ("state", "lastState") if "running" not in c.get("state", {}) else ("state",):
                    ended = c.get(when, {}).get("terminated")
                    if ended and ended.get("exitCode"):
                        exit_codes.append(ended["exitCode"])
                        signals.append(ended.get("reason", ""))
                        messages.append(ended.get("message", ""))
            signals.append(waiting)
            phase = pod.get("status", {}).get("phase", "Pending")
            replica_state = {"Pending": PENDING, "Running": RUNNING, "Succeeded": SUCCEEDED, "Failed": FAILED}.get(phase, PENDING)
            if waiting in _POD_PROBLEMS:
                replica_state = RESTARTING if waiting == "CrashLoopBackOff" else PENDING
                reason = reason or f"{pod['metadata']['name']}: {waiting}"
            logged = by_pod.get(pod["metadata"]["name"], [])
            progress = parse_progress("\n".join(logged)) or {}
            restarts += sum(1 for line in logged if reasons.WORKER_RESTART.search(line))  # torchrun's, in the pod
            if replica_state == RUNNING and restarting(logged):
                replica_state = RESTARTING
            replicas.append(ReplicaStatus(pod["metadata"]["name"], replica_state, restarts, step=progress.get("step"),
                                          samples_per_s=progress.get("samples_per_s"), world=progress.get("world"),
                                          detail=pod.get("spec", {}).get("nodeName", ""), total=progress.get("total"),
                                          productive=progress.get("productive")))
        desired = job["spec"]["pytorchReplicaSpecs"]["Worker"].get("replicas")
        restarts_of_pods = sum(c.get("restartCount", 0) for p in pods for c in p.get("status", {}).get("containerStatuses", []))
        fix, permanent = "", False
        if queued is not None and queued.admitted and state == STOPPED:
            state = PENDING  # admitted: the operator has not yet replaced its Suspended condition
        if queued is not None and not queued.admitted and state not in (SUCCEEDED, FAILED):
            return JobStatus(self.name, s.job_name, PENDING, run=job["spec"].get("elasticPolicy", {}).get("rdzvId", ""),
                             replicas=replicas, desired=desired, restarts=sum(r.restarts for r in replicas),
                             queue=queued.line(),
                             reason=f"waits in queue {queued.queue}" + (f" for {queued.kind}" if queued.kind in
                                                                       ("quota", "topology") else "")
                             + (f": {queued.why}" if queued.why else ""),
                             fix=kueue.waiting_fix(queued))
        recent = _since_last_step(by_pod)
        everything = [f"[{pod}] {line}" for pod in sorted(by_pod) for line in by_pod[pod]]
        said = reasons.tracebacks(everything).permanent() or reasons.from_lines(recent)
        earlier = reasons.from_lines(last_words) if last_words and not (said and said.permanent) else None
        if earlier is not None and earlier.permanent:  # an error no restart cures, said by a life whose log is gone
            said = earlier
        limit = job["spec"].get("elasticPolicy", {}).get("maxRestarts")
        over = [r for r in replicas if limit is not None and r.restarts > int(limit)]
        if over and (said is None or said.code in reasons.GENERIC):  # MAX_RESTARTS: the pod's and torchrun's in it
            said = reasons.restart_limit(over[0].name, over[0].restarts, int(limit), reasons.last_error(everything))
        if state == RUNNING and any(r.state == RESTARTING for r in replicas):
            state = RESTARTING
        wrong = state != SUCCEEDED and (state in (FAILED, PENDING) or any(signals) or (said and said.permanent))
        # the events are read only when something is wrong or happened (a restart, a replaced pod, a watchdog line):
        # a healthy job costs two kubectl calls
        events = self._events([p["metadata"]["name"] for p in pods]) if pods and (
            wrong or restarts_of_pods or any(r.restarts for r in replicas) or _replaced(job, pods)
            or _watchdog_notes([], by_pod)) else []
        notes = _watchdog_notes(events, by_pod) + self._lost_nodes(pods, replicas)
        if wrong:
            # what the kubelet and the operator said, then the pods' last log lines (only when something is wrong)
            signals += [e.get("reason", "") for e in events]
            found = said if said and said.permanent else reasons.classify(
                messages + [e.get("message", "") for e in events] + recent, exit_codes, signals,
                sum(1 for line in recent if reasons.WORKER_RESTART.search(line)) + restarts_of_pods,
                failed=state == FAILED, total=sum(r.restarts for r in replicas))
            if found is not None:
                reason, fix, permanent = found.text, found.fix, found.permanent
        held = {p["metadata"]["name"]: found for p in pods if (found := kube.stuck(p, events))} \
            if state not in (SUCCEEDED, FAILED) else {}
        return JobStatus(self.name, s.job_name, state, run=job["spec"].get("elasticPolicy", {}).get("rdzvId", ""),
                         replicas=replicas, desired=desired, restarts=sum(r.restarts for r in replicas), reason=reason, fix=fix,
                         permanent=permanent, queue=queued.line() if queued else "", notes=notes,
                         ended=_when(job.get("status", {}).get("completionTime")) if state in (SUCCEEDED, FAILED) else None,
                         stuck=held)

    def _lost_nodes(self, pods: list[dict[str, Any]], replicas: list[ReplicaStatus]) -> list[str]:
        """A node of the job's pods that the API server says is not Ready: named, with its pods (asked only when a
        pod is not Ready: the node controller marks them so once their node stops reporting)."""
        unready = [p for p in pods if p.get("spec", {}).get("nodeName") and not any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in p.get("status", {}).get("conditions", []))]
        if not unready:
            return []
        try:
            nodes = {n["metadata"]["name"]: n for n in (self._get(["nodes"]) or {}).get("items", [])}
        except DoeksError:  # nodes cannot be read (a user's cluster may not allow it): nothing said of them
            return []
        out = []
        for name in sorted({p["spec"]["nodeName"] for p in unready}):
            ready = next((c for c in nodes.get(name, {}).get("status", {}).get("conditions", [])
                          if c.get("type") == "Ready"), None)
            if name in nodes and (ready is None or ready.get("status") == "True"):
                continue
            on_it = [p["metadata"]["name"] for p in pods if p.get("spec", {}).get("nodeName") == name]
            for replica in replicas:
                if replica.name in on_it:
                    replica.detail = f"{name} (lost)"
            since = (ready or {}).get("lastTransitionTime", "")
            why = (ready or {}).get("message") or (ready or {}).get("reason") or "gone from the API server"
            out.append(f"node {name} lost: NotReady" + (f" since {since}" if since else "") + f" ({why}); on it: "
                       + ", ".join(on_it))
        return out

    def _kept(self) -> JobStatus | None:
        """The status end_failed kept when it deleted the failed job (doeks.targets.runs), None when there is none."""
        from . import runs

        ended = runs.kept_end(self.settings, self.name)
        if ended is None:
            return None
        fields = {f for f in ReplicaStatus.__dataclass_fields__}
        replicas = [ReplicaStatus(**{k: v for k, v in r.items() if k in fields}) for r in ended.get("replicas", [])]
        return JobStatus(self.name, self.settings.job_name, ended.get("state", FAILED), run=ended.get("run", ""),
                         replicas=replicas, desired=ended.get("desired"), restarts=ended.get("restarts", 0),
                         reason=ended.get("reason", ""), fix=ended.get("fix", ""), permanent=ended.get("permanent", False),
                         notes=list(ended.get("notes") or []), ended=ended.get("ended"))

    def _pods(self, etcd: bool = False) -> list[dict[str, Any]]:
        """The job's worker pods by name (`etcd`: its etcd pod too)."""
        s = self.settings
        pods = (kube.get_raw(kube.list_path(s.namespace, "pods", f"doeks/job={s.job_name}")) or {}).get("items", [])
        return [p for p in sorted(pods, key=lambda p: p["metadata"]["name"]) if etcd or not _is_etcd(p)]

    def _events(self, pods: list[str]) -> list[dict[str, Any]]:
        """The namespace's events about the PyTorchJob and its pods, oldest first (kubectl get events -o json)."""
        s = self.settings
        try:
            items = (kube.get_raw(kube.list_path(s.namespace, "events")) or {}).get("items", [])
        except DoeksError:
            return []
        names = set(pods) | {s.job_name}
        mine = [e for e in items if e.get("involvedObject", {}).get("name") in names]
        return sorted(mine, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")

    def _pod_logs(self, tail: int = 200, names: list[str] | None = None) -> dict[str, list[str]]:
        """Each pod's last lines, by pod name (best effort: a pod may have no log yet). One request per pod (the API
        has no log request for several pods). Up to KUBECTL_BURST pods in one `kubectl logs -l`; more concurrently
        from this process (doeks.kube.pod_logs): kubectl sends them one after another and throttles itself to client-
        go's default of 5 requests a second after a burst of 10, which took 50 s for 256 pods (bench/scale.py)."""
        s = self.settings
        if names is not None and len(names) > KUBECTL_BURST:
            return kube.pod_logs(s.namespace, names, tail)
        argv = [kube.kubectl(), "logs", "-n", s.namespace, "-l", f"doeks/job={s.job_name}", "--prefix",
                f"--tail={tail}", "--max-log-requests=64"]
        result = subprocess.run(argv, capture_output=True, text=True)
        by_pod: dict[str, list[str]] = {}
        for line in result.stdout.splitlines() if result.returncode == 0 else []:
            prefix, _, text = line.partition("] ") if line.startswith("[") else ("", "", line)
            by_pod.setdefault(prefix[1:].split("/")[1] if prefix.count("/") >= 2 else prefix, []).append(text)
        return by_pod

    def events(self) -> list[str]:
        s = self.settings
        if self._get(["pytorchjob", s.job_name, "-n", s.namespace]) is None:
            from . import runs

            ended = runs.kept_end(s, self.name)
            if ended is not None:  # the failed job's, kept when end_failed deleted it
                return list(ended.get("events", []))
        events = self._events([p["metadata"]["name"] for p in self._pods()])
        return [f"{e.get('lastTimestamp') or e.get('eventTime') or ''} {e.get('type', '')} {e.get('reason', '')} "
                f"{e.get('involvedObject', {}).get('kind', '')}/{e.get('involvedObject', {}).get('name', '')}: "
                f"{e.get('message', '')}" + (f" (x{e['count']})" if e.get("count", 1) > 1 else "") for e in events]

    def logs(self, follow: bool = False, replica: int | None = None, run: str | None = None, tail: int | None = None,
             since: float | None = None) -> Iterator[str]:
        """The pods' lines (`[pod/<name>/<container>] ...`); --follow until the job is final, through pods made
        again and containers restarted, and from before the first pod exists (right after a deploy)."""
        from . import runs
        from .follow import check_run, follow_until_done, window

        s = self.settings
        wanted = check_run(self, run)  # the cluster holds the current run's pods; a failed run's were kept
        kept = runs.kept_logs(s, wanted) if wanted else None
        if kept is not None:  # its PyTorchJob was deleted when it failed (end_failed): the lines kept then
            mine = f"{s.job_name}-worker-{replica}/"
            if replica is not None and not any(line.startswith(f"[pod/{mine}") for line in kept):
                raise DoeksError(f"--replica {replica}: run {wanted} of job {s.job_name} has no such replica")
            return iter(window([line for line in kept if replica is None or line.startswith(f"[pod/{mine}")],
                               tail, since))
        if replica is not None:
            names = [r.name for r in self.describe().replicas]
            if not any(n.endswith(f"-worker-{replica}") for n in names):
                raise DoeksError(f"--replica {replica}: job {s.job_name} has pods {', '.join(names) or 'none'}")
        only = f"{s.job_name}-worker-{replica}" if replica is not None else None
        return follow_until_done(self, PodCursor(self, only), follow, poll=2, tail=tail, since=since)

    def runs(self) -> list[str]:
        """The failed runs whose pods' logs were kept when their job was deleted (end_failed), oldest first."""
        from . import runs

        return runs.kept_runs(self.settings)

    def _cursor(self) -> "PodCursor":
        return PodCursor(self)

    def wait(self, timeout: float | None = None, quiet: bool = False, poll: float = 3) -> JobStatus:
        """Until the PyTorchJob is final: its pods' new log lines as they come and a progress bar of steps; a
        permanent reason (bad arguments, missing data) ends the job at once, as on the other targets."""
        from .follow import wait_with_progress

        return wait_with_progress(self, self._cursor(), timeout, quiet, poll=poll)

    def scale(self, replicas: int, runner) -> None:
        self.validate_scale(replicas)
        kube.patch_replicas(runner, self.settings, replicas)

    def cancel(self, runner) -> bool:
        from . import runs

        s = self.settings
        if not runner.dry_run:
            runs.forget_end(s)  # a failed run's kept status goes with the job (its logs stay for `logs --run`)
        if not runner.dry_run and own.stopped(s):
            from .. import ui

            ui.say(f"doeks' cluster is not running: job {s.job_name} is not on it")
            return False
        existed = False if runner.dry_run else self._get(["pytorchjob", s.job_name, "-n", s.namespace]) is not None
        kube.delete(runner, list(reversed(jobspec.manifests(s, image="-", account=True))))
        return existed

    def end_failed(self, runner, status: JobStatus | None = None) -> None:
        """A job that failed for good is deleted (its PyTorchJob, pods and etcd: nothing crash-loops on, and on EKS no
        GPU node is billed for it), as cancel does; first its pods' logs, its events and `status` (what --follow
        reported) are kept under STATE_DIR (doeks.targets.runs.keep_end), and `status`, `describe` and `logs
        [--errors]` show them while no job of its name is on the cluster (until `elasticjob.delete` or the next
        deploy), as the docker target's stopped containers and the local target's job folder show theirs."""
        from dataclasses import asdict

        from . import runs

        lines: list[str] = []
        events: list[str] = []
        try:
            status = status or self.describe()
            if not runner.dry_run:
                lines, events = self._all_logs(), self.events()
        except (DoeksError, OSError):  # what cannot be read now is not kept; the job is deleted all the same
            pass
        self.cancel(runner)
        if runner.dry_run or status is None or not status.run:
            return
        ended = asdict(status)
        ended["state"] = FAILED
        for replica in ended["replicas"]:
            if replica["state"] not in (SUCCEEDED, FAILED):
                replica["state"] = STOPPED  # doeks deleted its pod when the job failed
            replica["detail"] = " ".join(filter(None, [replica["detail"], "(pod deleted; logs kept)"]))
        runs.keep_end(self.settings, self.name, ended, lines, events)

    def _all_logs(self) -> list[str]:
        """Every pod's whole log, each line prefixed `[pod/<name>/<container>]` (as `kubectl logs --prefix`): a
        restarted container's previous life first, then its current one."""
        s = self.settings
        lines: list[str] = []
        for pod in self._pods():
            name = pod["metadata"]["name"]
            for c in pod.get("status", {}).get("containerStatuses", []):
                lives = (["--previous"] if c.get("restartCount", 0) else []) + [None]
                for previous in lives:
                    argv = [kube.kubectl(), "logs", "-n", s.namespace, name, "-c", c.get("name", "pytorch")]
                    result = subprocess.run(argv + ([previous] if previous else []), capture_output=True, text=True)
                    said = result.stdout.splitlines() if result.returncode == 0 else []
                    if previous and (not said or said[0].startswith("unable to retrieve container logs")):
                        # the kubelet removed that life's container and its log: the last lines it kept in status
                        said = (c.get("lastState", {}).get("terminated") or {}).get("message", "").splitlines()
                    lines += [f"[pod/{name}/{c.get('name', 'pytorch')}] {line}" for line in said]
        return lines

    def artifacts(self) -> dict[str, str]:
        s = self.settings
        if self.on_this_machine:  # doeks' own cluster: the claim's volume is a folder of this machine
            from .. import elastic

            return {"metrics": str(elastic.metrics_dir(s)), "checkpoints": elastic.checkpoint_uri(s),
                    "model": elastic.model_uri(s) + "/model.pt", "final": str(elastic.metrics_dir(s) / "final.json"),
                    "volume": f"pvc://{s.namespace}/{s.shared_pvc} (folder {s.state_dir / 'volumes' / s.shared_pvc})"}
        from ..jobpaths import checkpoint_uri, job_folder, model_uri

        base = f"pvc://{s.namespace}/{s.shared_pvc}"
        return {"metrics": job_folder(s, "metrics", base), "checkpoints": checkpoint_uri(s, base),
                "model": model_uri(s, base) + "/model.pt",
                "final": f"{job_folder(s, 'metrics', base)}/final.json",
                "copy": "kubectl cp from a pod that mounts the claim"}


KUBECTL_BURST = 9   # pods whose logs one `kubectl logs -l` reads within client-go's burst (10 requests, a list first)


def _is_etcd(pod: dict[str, Any]) -> bool:
    return "etcd" in pod["metadata"].get("labels", {}).get("app", "")


def _when(stamp: str | None) -> float | None:
    import datetime

    if not stamp:
        return None
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _replaced(job: dict[str, Any], pods: list[dict[str, Any]]) -> bool:
    """A pod made well after its job: one was replaced (deleted, evicted, or by the hang watchdog)."""
    made = _when(job.get("metadata", {}).get("creationTimestamp")) or 0
    return any((_when(p.get("metadata", {}).get("creationTimestamp")) or 0) > made + 60 for p in pods)


def _watchdog_notes(events: list[dict[str, Any]], by_pod: dict[str, list[str]]) -> list[str]:
    """The hang watchdog's steps (doeks.pod.watchdog): its Events (they outlive a replaced pod), then its lines in the
    pods' logs (an Event the pod could not record), once each, prefixed `watchdog: `."""
    from ..local.jobs import WATCHDOG_LINE

    said = [e.get("message", "") for e in events if e.get("reason") == "DoeksWatchdog"]
    said += [line.split("doeks: watchdog: ", 1)[1] for pod in sorted(by_pod) for line in by_pod[pod]
             if WATCHDOG_LINE.match(line)]
    return [f"watchdog: {line}" for line in dict.fromkeys(said)]


def _since_last_step(by_pod: dict[str, list[str]]) -> list[str]:
    """Each pod's lines since its last training step: an error that training went on after is no reason."""
    from ..local.jobs import STEP_LINE

    out = []
    for pod in sorted(by_pod):
        lines = by_pod[pod]
        last = next((i for i in range(len(lines) - 1, -1, -1) if STEP_LINE.search(lines[i])), -1)  # from the end
        out += lines[last + 1:]
    return out


class PodCursor:
    """New log lines of the job's pods, each prefixed `[pod/<name>/<container>]` as `kubectl logs --prefix` does; a
    pod made again (new uid) or a container restarted is read from its start."""

    def __init__(self, target: KubernetesJobs, only: str | None = None):
        self.target, self.only = target, only
        self.offsets: dict[str, tuple[tuple[str, int], int]] = {}  # pod -> ((uid, restarts), lines read)

    def __call__(self) -> list[str]:
        s = self.target.settings
        lines: list[str] = []
        for pod in self.target._pods():
            name = pod["metadata"]["name"]
            if self.only is not None and name != self.only:
                continue
            statuses = pod.get("status", {}).get("containerStatuses", [])
            if not statuses or not any("waiting" not in c.get("state", {}) for c in statuses):
                continue  # nothing started yet: no log to read
            key = (pod["metadata"].get("uid", ""), sum(c.get("restartCount", 0) for c in statuses))
            seen_key, count = self.offsets.get(name, (key, 0))
            if seen_key != key:
                count = 0
            result = subprocess.run([kube.kubectl(), "logs", "-n", s.namespace, name, "--all-containers"],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                continue
            new = result.stdout.splitlines()
            container = statuses[0].get("name", "pytorch")
            lines += [f"[pod/{name}/{container}] {line}" for line in new[count:]]
            self.offsets[name] = (key, max(count, len(new)))
        return lines
