"""TARGET=docker: the cluster's own PyTorchJob run as containers of the training image on this machine.

It interprets the *same* PyTorchJob dict the eks target applies (no second spec): one container per Worker replica
from its pod template (image, command/args as Kubernetes maps them onto ENTRYPOINT/CMD, env plus the PET_* variables
the training operator injects, volumeMounts with each PersistentVolumeClaim mapped to its folder under
STATE_DIR/volumes, a memory emptyDir at /dev/shm as the container's shm), `restartPolicy: OnFailure` as docker's
`on-failure` restart policy with `runPolicy.backoffLimit` retries. Docker itself restarts a crashed container; etcd
rendezvous goes to the local etcd server (standing in for the etcd Deployment, whose image cannot be pulled here).
Networking: the host's (one machine, so every agent advertises 127.0.0.1). Containers carry the job's labels, so
`cancel` and `down` find and remove every one of them.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from .. import elastic, jobpaths, jobspec, trainimage
from ..errors import DoeksError
from ..local import runtime
from ..local.jobs import GROUP_FAILED, parse_progress, restarting
from ..services import etcd, free_port
from ..runner import to_yaml_stream
from .local import OnThisMachine
from .base import (FAILED, PENDING, RESTARTING, RUNNING, STOPPED, SUCCEEDED, Job, JobStatus, Plan, ReplicaStatus,
                   Step, Target)
from .follow import ContainerCursor, wait_with_progress
from .local import start_rendezvous
from ..pod import reasons

from ..local.containers import JOB, PART_OF, REPLICA, RUN, STATE, TARGET, client, remove_all, state_label  # noqa: F401

SHM_SIZE = "2g"


def container_name(job_name: str, replica: int) -> str:
    return f"{job_name}-worker-{replica}"  # the training operator's pod name


def _restart_policy(pytorchjob: dict[str, Any]) -> dict[str, Any]:
    """docker's restart policy for a Worker: OnFailure as `on-failure`, retried up to runPolicy.backoffLimit, and no
    more often than the node may restart (elasticPolicy.maxRestarts, MAX_RESTARTS: torchrun's restarts of its workers
    count too, which `describe` adds up); 0 is `no` (docker's `on-failure:0` retries for ever)."""
    worker = pytorchjob["spec"]["pytorchReplicaSpecs"]["Worker"]
    policy = worker.get("restartPolicy", "OnFailure")
    limit = int(pytorchjob["spec"].get("runPolicy", {}).get("backoffLimit", 6))
    node = pytorchjob["spec"].get("elasticPolicy", {}).get("maxRestarts")
    limit = min(limit, int(node)) if node is not None else limit
    if policy in ("OnFailure", "ExitCode"):
        return {"Name": "on-failure", "MaximumRetryCount": limit} if limit > 0 else {"Name": "no"}
    if policy == "Always":
        return {"Name": "always"}
    return {"Name": "no"}


def container_spec(pytorchjob: dict[str, Any], replica: int, rdzv_endpoint: str, volumes_dir, run: str,
                   state: str = "") -> dict[str, Any]:
    """docker SDK `containers.run` arguments for one Worker replica, interpreted from the PyTorchJob's pod template."""
    name = pytorchjob["metadata"]["name"]
    pod = jobspec.worker_pod(pytorchjob)
    container = pod["containers"][0]
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod.get("volumes", []) if "persistentVolumeClaim" in v}
    memory_dirs = {v["name"] for v in pod.get("volumes", []) if v.get("emptyDir", {}).get("medium") == "Memory"}
    volumes: dict[str, dict[str, str]] = {}
    tmpfs: dict[str, str] = {}
    shm = None
    for mount in container.get("volumeMounts", []):
        if mount["name"] in claims:
            folder = volumes_dir / claims[mount["name"]]
            volumes[str(folder)] = {"bind": mount["mountPath"], "mode": "ro" if mount.get("readOnly") else "rw"}
        elif mount["name"] in memory_dirs:
            if mount["mountPath"] == "/dev/shm":
                shm = SHM_SIZE
            else:
                tmpfs[mount["mountPath"]] = ""
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    env.update(jobspec.pet_env(pytorchjob, rdzv_endpoint))
    env["PET_LOCAL_ADDR"] = "127.0.0.1"  # every "pod" shares the host's network here
    env["SM_CURRENT_HOST"] = container_name(name, replica)  # the pod's name, which the downward API gives on a cluster
    env["SM_NUM_GPUS"] = "0"  # the training base here is CPU torch
    labels = {PART_OF: "doeks", JOB: name, RUN: run, REPLICA: str(replica), TARGET: "docker", STATE: state}
    spec: dict[str, Any] = {
        "image": container["image"], "name": container_name(name, replica), "detach": True, "labels": labels,
        "environment": env, "volumes": volumes, "network_mode": "host", "restart_policy": _restart_policy(pytorchjob),
        "stdin_open": False, "tty": False,
        # as the user running doeks, so what the job writes in the volume folders stays theirs (HOME for caches)
        "user": f"{os.getuid()}:{os.getgid()}",
    }
    spec["environment"].setdefault("HOME", "/tmp")
    if "command" in container:
        spec["entrypoint"] = container["command"]
    if "args" in container:
        spec["command"] = container["args"]
    if container.get("workingDir"):
        spec["working_dir"] = container["workingDir"]
    if shm:
        spec["shm_size"] = shm
    if tmpfs:
        spec["tmpfs"] = tmpfs
    return spec


def docker_run_line(spec: dict[str, Any]) -> str:
    """The `docker run` equivalent of a container spec (what the dry run shows)."""
    parts = ["docker run -d", f"--name {spec['name']}", "--network host"]
    policy = spec["restart_policy"]
    parts.append(f"--restart {policy['Name']}" + (f":{policy['MaximumRetryCount']}" if policy.get("MaximumRetryCount") else ""))
    parts += [f"--label {k}={v}" for k, v in spec["labels"].items()]
    parts += [f"-v {host}:{m['bind']}" + (":ro" if m["mode"] == "ro" else "") for host, m in spec["volumes"].items()]
    if spec.get("shm_size"):
        parts.append(f"--shm-size {spec['shm_size']}")
    parts += [f"-e {k}={v}" for k, v in sorted(spec["environment"].items())]
    if "entrypoint" in spec:
        parts.append(f"--entrypoint {spec['entrypoint'][0]}")
    rest = spec.get("entrypoint", [])[1:] + spec.get("command", [])
    return " ".join(parts + [spec["image"]] + rest)


class DockerTarget(OnThisMachine, Target):
    name = "docker"
    on_this_machine = True
    builds_image = True
    interprets = True

    def checks(self):
        from .checks import local_checks

        return local_checks(self.settings, docker=True)

    @property
    def home(self):
        return self.settings.state_dir / "docker" / self.settings.job_name

    def containers(self) -> list:
        found = client().containers.list(all=True, filters={"label": [f"{JOB}={self.settings.job_name}", f"{TARGET}=docker",
                                                                      f"{STATE}={state_label(self.settings)}"]})
        return sorted(found, key=lambda c: int(c.labels.get(REPLICA, 0)))

    # -- submission ---------------------------------------------------------------------------------------------------
    def plan(self, job: Job) -> Plan:
        s = job.settings
        plan = self.manifest_plan(job)
        pytorchjob = plan.manifests[-1]
        ctx: dict[str, Any] = {"endpoint": None, "started_etcd": False}
        plan.context = ctx
        build = self.image_step(job)
        if build is not None:
            ctx["builds"] = True
            plan.steps.append(build)
        plan.steps.append(Step(f"check: docker daemon, image {plan.image}, job {s.job_name} not running, data in "
                               f"{elastic.data_root(s)}", lambda: self._check(s, plan.image, job.code)))
        if s.rdzv_backend.startswith("etcd"):
            server = etcd(s.state_dir)
            what = (f"use etcd at {s.etcd_endpoint}" if s.etcd_endpoint else
                    "use the running local etcd" if server.info() else "start the local etcd (v2 API)")
            plan.steps.append(Step(f"{what} for rendezvous (stands in for Deployment and Service {jobspec.etcd_name(s)})",
                                   lambda: start_rendezvous(s, ctx)))
            shown = "127.0.0.1:ETCD_PORT"
        else:
            ctx["endpoint"] = shown = f"127.0.0.1:{free_port()}"
        if jobpaths.in_s3(s):  # checkpoints or model in S3: doeks' moto server (or AWS_ENDPOINT_URL), host network
            plan.steps.append(Step(f"S3 for {', '.join(jobpaths.in_s3(s))}: {s.aws_endpoint_url or 'doeks moto server (started if need be; the bucket made there)'}",
                                   lambda: ctx.update(s3_env=elastic.prepare_s3(s))))
        if job.fresh:
            plan.steps.append(Step(f"remove checkpoints, metrics and model.pt of {s.job_name}", lambda: elastic.clear_outputs(s)))
        plan.steps.append(Step(f"record the manifests in {self.home / 'manifests.yaml'}",
                               lambda: self._record(plan.manifests, job.run, ctx.get("s3_env"))))
        volumes = runtime.volumes_dir(s)
        for replica in range(s.replicas):
            spec = container_spec(pytorchjob, replica, shown, volumes, job.run, state_label(s))
            plan.steps.append(Step(docker_run_line(spec),
                                   lambda replica=replica: self._start(pytorchjob, replica, ctx["endpoint"], job.run)))
        return plan

    def refuse_if_running(self) -> None:
        live = [c for c in self.containers() if c.status in ("running", "restarting", "created")]
        if live:
            raise DoeksError(f"job {self.settings.job_name} is already running ({len(live)} containers): "
                             "`invoke elasticjob.status`, or `invoke elasticjob.delete` first")

    def refuse(self, plan: Plan) -> None:
        if not plan.context.get("builds"):
            trainimage.require_image(plan.image, plan.job.settings)
        self.refuse_if_running()
        elastic.check_job_data(plan.job.settings, plan.job.code)  # a user's script gets its data folder as it is

    def _check(self, s, image: str, code=None) -> None:
        trainimage.require_image(image, s)
        self.refuse_if_running()
        for stale in self.containers():
            self._archive(stale)
            stale.remove(force=True)
        elastic.check_job_data(s, code)

    def _archive(self, container) -> None:
        """Keep a finished run's logs (STATE_DIR/docker/<job>/runs/<run>/node-N.log) before its container goes."""
        try:
            data = container.logs(stdout=True, stderr=True)
        except Exception:  # noqa: BLE001 - removed meanwhile
            return
        folder = self.home / "runs" / container.labels.get(RUN, "unknown")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"node-{container.labels.get(REPLICA)}.log").write_bytes(data)

    def _record(self, manifests, run, s3_env=None) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "manifests.yaml").write_text(to_yaml_stream(manifests))
        (self.home / "pytorchjob.json").write_text(json.dumps(manifests[-1], indent=2))
        (self.home / "run.json").write_text(json.dumps({"run": run, "endpoint": None, "s3_env": s3_env or {}}))

    def _start(self, pytorchjob, replica: int, endpoint: str, run: str):
        record = json.loads((self.home / "run.json").read_text())
        if record.get("endpoint") != endpoint:
            record["endpoint"] = endpoint
            (self.home / "run.json").write_text(json.dumps(record))
        spec = container_spec(pytorchjob, replica, endpoint, runtime.volumes_dir(self.settings), run,
                              state_label(self.settings))
        spec["environment"].update(record.get("s3_env") or {})  # the S3 of CHECKPOINT_URI / MODEL_URI on this machine
        for folder in spec["volumes"]:
            Path(folder).mkdir(parents=True, exist_ok=True)
        return client().containers.run(**spec)

    def abandon(self, plan: Plan) -> None:
        for container in self.containers():  # what this submission started, never a job already running
            if container.labels.get(RUN) == plan.job.run:
                container.remove(force=True)
        if plan.context.get("started_etcd"):
            etcd(plan.job.settings.state_dir).stop()

    # -- after submission ---------------------------------------------------------------------------------------------
    def _record_read(self) -> dict[str, Any]:
        try:
            return json.loads((self.home / "run.json").read_text())
        except (OSError, ValueError):
            return {}

    def describe(self) -> JobStatus:
        s = self.settings
        run = self._record_read().get("run", "")
        return container_job_status(self.name, s.job_name, run, self.containers(),
                                    lambda c: f"node-{c.labels.get(REPLICA)}", self._max_restarts())

    def _max_restarts(self) -> int | None:
        """The run's MAX_RESTARTS, as its PyTorchJob says (elasticPolicy.maxRestarts)."""
        try:
            job = json.loads((self.home / "pytorchjob.json").read_text())
            return int(job["spec"]["elasticPolicy"]["maxRestarts"])
        except (OSError, ValueError, KeyError):
            return None

    def _cursor(self, replica: int | None = None) -> ContainerCursor:
        return ContainerCursor(self.containers, lambda c: f"node-{c.labels.get(REPLICA)}",
                               None if replica is None else f"node-{replica}")

    def runs(self) -> list[str]:
        """Runs whose logs were kept when their containers were removed (delete, the next deploy)."""
        folder = self.home / "runs"
        return sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []

    def logs(self, follow: bool = False, replica: int | None = None, run: str | None = None, tail: int | None = None,
             since: float | None = None) -> Iterator[str]:
        from .follow import check_replica, check_run, follow_until_done, window

        wanted = check_run(self, run)
        live = [c for c in self.containers() if c.labels.get(RUN) == wanted]
        if not live and (self.home / "runs" / wanted).is_dir():  # its containers are gone: the logs kept then
            files = sorted((self.home / "runs" / wanted).glob("node-*.log"))
            if replica is not None and f"node-{replica}.log" not in [f.name for f in files]:
                raise DoeksError(f"--replica {replica}: run {wanted} of job {self.settings.job_name} has no such replica")
            lines = [f"[{f.stem}] {line}" for f in files if replica is None or f.stem == f"node-{replica}"
                     for line in f.read_text(errors="replace").splitlines()]
            return iter(window(lines, tail, since))
        check_replica(self, replica)
        return follow_until_done(self, self._cursor(replica), follow, tail=tail, since=since)

    def events(self) -> list[str]:
        return container_events(self.containers())

    def wait(self, timeout: float | None = None, quiet: bool = False) -> JobStatus:
        return wait_with_progress(self, self._cursor(), timeout, quiet, poll=0.5)

    def scale(self, replicas: int, runner) -> None:
        self.validate_scale(replicas)
        s = self.settings
        record = self._record_read()
        if runner.dry_run:
            runner.step(f"scale job {s.job_name} to {replicas} containers (start or remove {s.job_name}-worker-N)", lambda: None)
            return
        live = {int(c.labels[REPLICA]): c for c in self.containers() if c.status in ("running", "restarting", "created")}
        if not live:
            raise DoeksError(f"job {s.job_name} is not running: start it with `invoke elasticjob.deploy`")
        pytorchjob = json.loads((self.home / "pytorchjob.json").read_text())
        for index in range(replicas):
            if index not in live:
                for stale in self.containers():
                    if stale.labels.get(REPLICA) == str(index):
                        stale.remove(force=True)
                runner.step(f"start container {container_name(s.job_name, index)}", self._start, pytorchjob, index,
                            record["endpoint"], record["run"])
        for index in sorted(live):
            if index >= replicas:
                runner.step(f"remove container {live[index].name}", live[index].remove, force=True)

    def cancel(self, runner) -> bool:
        s = self.settings
        try:
            containers = self.containers()
        except DoeksError:
            if runner.dry_run:
                runner.step(f"remove every container labelled {JOB}={s.job_name}", lambda: None)
                return False
            raise
        if not containers:
            runner.note(f"job {s.job_name}: no containers (checkpoints kept in {elastic.checkpoint_uri(s)})")
            return False
        running = [c for c in containers if c.status in ("running", "restarting", "created")]
        for c in containers:
            if not runner.dry_run:
                self._archive(c)  # the run's logs outlive its containers (`invoke elasticjob.logs [--run]`)
            runner.step(f"docker rm -f {c.name}", c.remove, force=True)
        return bool(running)

    def end_failed(self, runner, status: JobStatus | None = None) -> None:
        stop_containers(self.containers(), runner)

    def artifacts(self) -> dict[str, str]:
        s = self.settings
        return {"metrics": str(elastic.metrics_dir(s)), "checkpoints": elastic.checkpoint_uri(s),
                "model": elastic.model_uri(s) + "/model.pt",
                "final": str(elastic.metrics_dir(s) / "final.json"), "manifests": str(self.home / "manifests.yaml")}


def stop_containers(containers, runner) -> None:
    """Stop a failed job's containers for good (docker does not restart a container stopped by hand) and keep them:
    their states and logs are what `status`, `describe` and `logs --errors` read; the next deploy or `delete` removes
    them."""
    for c in containers:
        if c.status in ("running", "restarting", "created"):
            runner.step(f"docker stop {c.name}", c.stop, timeout=5)


def read_replica(container, name: str, seen: dict | None = None) -> ReplicaStatus | None:
    """One container as a replica: its state in the targets' vocabulary, its restarts (docker's restarts of the
    container plus torchrun's of its workers, from the logs), its last step; None when it was removed meanwhile (a
    scale down, a delete from another shell). `seen` collects its log lines, every start of it in order."""
    import docker as sdk

    try:
        container.reload()
        text = container.logs().decode(errors="replace")  # every start of the container, in order
    except sdk.errors.NotFound:
        return None
    lines = text.splitlines()
    state = container.attrs["State"]
    said = [i for i, line in enumerate(lines) if reasons.WORKER_RESTART.search(line)]
    if said:  # doeks' torchrun (the training image's) says each restart of the workers
        worker_restarts = len(said)
    else:  # a stock torchrun (TRAIN_IMAGE): each failed worker group logs one GROUP_FAILED line; the one that ended a
        # container's life is docker's restart (RestartCount) or its final exit, the others were torchrun's restarts
        node_failures = int(container.attrs.get("RestartCount", 0)) + (0 if state.get("Running") or not state.get("ExitCode") else 1)
        worker_restarts = max(0, sum(1 for line in lines if GROUP_FAILED.search(line)) - node_failures)
    if seen is not None:
        seen[name] = lines
    tail = "\n".join(lines[-200:])
    if state.get("Restarting") or (state.get("Running") and restarting(lines)):
        replica_state = RESTARTING  # docker restarts the container, or torchrun its workers
    elif state.get("Running"):
        replica_state = RUNNING
    elif state.get("Status") == "created":
        replica_state = PENDING
    elif state.get("ExitCode") == 0:
        replica_state = SUCCEEDED
    else:  # exited non-zero and docker is not restarting it: its restart policy is spent
        replica_state = FAILED
    progress = parse_progress(tail) or {}
    return ReplicaStatus(name, replica_state, int(container.attrs.get("RestartCount", 0)) + worker_restarts,
                         progress.get("step"), progress.get("samples_per_s"), progress.get("world"), container.short_id,
                         progress.get("total"), progress.get("productive"))


def since_last_step(lines: list[str]) -> list[str]:
    """A replica's lines since its last training step: an error that training went on after is no reason."""
    from ..local.jobs import STEP_LINE

    last = max((i for i, line in enumerate(lines) if STEP_LINE.search(line)), default=-1)
    return lines[last + 1:][-400:]


def container_job_status(target: str, job_name: str, run: str, containers: list, name_of,
                         max_restarts: int | None = None) -> JobStatus:
    """A job whose replicas are containers: Running while any runs (Restarting while one restarts), Succeeded when
    all exited 0, Failed otherwise; the reason: an error of the script's code in any log, a replica over
    `max_restarts` (MAX_RESTARTS: docker's restarts of it and torchrun's of its workers together), else what the lines
    since each replica's last step show. A permanent reason fails the job (`--follow` removes its containers)."""
    if not containers:
        return JobStatus(target, job_name, STOPPED, run=run, reason="no containers (not deployed, or deleted)")
    seen: dict[str, list[str]] = {}
    read = [(c, read_replica(c, name_of(c), seen)) for c in containers]
    read = [(c, r) for c, r in read if r is not None]
    replicas = [r for _, r in read]
    if not replicas:
        return JobStatus(target, job_name, STOPPED, run=run, reason="its containers were removed")
    states = [r.state for r in replicas]
    total = sum(r.restarts for r in replicas)
    reason = ""
    if any(x in (RUNNING, RESTARTING, PENDING) for x in states):
        job_state = RESTARTING if RESTARTING in states else RUNNING
    elif all(x == SUCCEEDED for x in states):
        job_state = SUCCEEDED
    else:
        job_state = FAILED
        failed = next(c for c, r in read if r.state == FAILED)
        reason = (f"{failed.name} exited with {failed.attrs['State'].get('ExitCode')} after "
                  f"{failed.attrs.get('RestartCount', 0)} restarts")
    fix, permanent = "", False
    if job_state != SUCCEEDED:
        everything = [f"[{name}] {line}" for name in sorted(seen) for line in seen[name]]
        lines = [f"[{name}] {line}" for name in sorted(seen) for line in since_last_step(seen[name])]
        loop = sum(1 for line in lines if reasons.WORKER_RESTART.search(reasons.split_prefix(line)[2])
                   or GROUP_FAILED.search(line))
        events = ["OOMKilled" for c, _ in read if c.attrs["State"].get("OOMKilled")]
        found = reasons.tracebacks(everything).permanent()
        over = [r for r in replicas if max_restarts is not None and r.restarts > max_restarts]
        found = found or reasons.classify(lines, [c.attrs["State"].get("ExitCode") for c, r in read if r.state == FAILED],
                                          events, loop, failed=job_state == FAILED or bool(over), total=total)
        if over and (found is None or found.code in reasons.GENERIC):  # no cause of its own: the limit is the reason
            found = reasons.restart_limit(over[0].name, over[0].restarts, max_restarts, reasons.last_error(everything))
        if found is not None:
            reason, fix, permanent = found.text, found.fix, found.permanent
    return JobStatus(target, job_name, job_state, run=run, replicas=replicas, desired=len(replicas),
                     restarts=total, reason=reason, fix=fix, permanent=permanent)


def container_events(containers) -> list[str]:
    """What docker knows of each container: created, started, restarts, how it exited (OOM-killed, exit code)."""
    events = []
    for c in containers:
        try:
            c.reload()
        except Exception:  # noqa: BLE001 - removed meanwhile
            continue
        state = c.attrs.get("State", {})
        events.append(f"{c.attrs.get('Created', '')[:19]} {c.name}: created (run {c.labels.get(RUN, '?')})")
        if state.get("StartedAt", "").startswith("0001"):
            continue
        events.append(f"{state.get('StartedAt', '')[:19]} {c.name}: started (docker restarts so far: "
                      f"{c.attrs.get('RestartCount', 0)})")
        if not state.get("Running") and not state.get("FinishedAt", "").startswith("0001"):
            how = "OOM-killed" if state.get("OOMKilled") else f"exited with {state.get('ExitCode')}"
            events.append(f"{state.get('FinishedAt', '')[:19]} {c.name}: {how}" +
                          (f" ({state['Error']})" if state.get("Error") else ""))
    return sorted(events)
