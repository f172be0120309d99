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

from .. import elastic, jobspec, trainimage
from ..errors import DoeksError
from ..local import runtime
from ..local.jobs import STEP_LINE
from ..local.services import etcd, free_port
from ..runner import to_yaml_stream
from .base import (FAILED, PENDING, RESTARTING, RUNNING, STOPPED, SUCCEEDED, Job, JobStatus, Plan, ReplicaStatus,
                   Step, Target)
from .follow import wait_with_progress

PART_OF = "app.kubernetes.io/part-of"
JOB, RUN, REPLICA, TARGET, STATE = "doeks/job", "doeks/run", "doeks/replica", "doeks/target", "doeks/state"
SHM_SIZE = "2g"


def client():
    from ..container import _client

    return _client()


def state_label(settings) -> str:
    """Which checkout's STATE_DIR a container belongs to (two checkouts may share one docker daemon)."""
    import hashlib

    return hashlib.sha256(str(settings.state_dir.resolve()).encode()).hexdigest()[:12]


def container_name(job_name: str, replica: int) -> str:
    return f"{job_name}-worker-{replica}"  # the training operator's pod name


def _restart_policy(pytorchjob: dict[str, Any]) -> dict[str, Any]:
    worker = pytorchjob["spec"]["pytorchReplicaSpecs"]["Worker"]
    policy = worker.get("restartPolicy", "OnFailure")
    limit = pytorchjob["spec"].get("runPolicy", {}).get("backoffLimit", 6)
    if policy in ("OnFailure", "ExitCode"):
        return {"Name": "on-failure", "MaximumRetryCount": int(limit)}
    if policy == "Always":
        return {"Name": "always"}
    return {"Name": "no"}


def container_spec(pytorchjob: dict[str, Any], replica: int, rdzv_endpoint: str, volumes_dir, run: str,
                   state: str = "") -> dict[str, Any]:
    """docker SDK `containers.run` arguments for one Worker replica, interpreted from the PyTorchJob's pod template."""
    name = pytorchjob["metadata"]["name"]
    pod = pytorchjob["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
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


class DockerTarget(Target):
    name = "docker"
    on_this_machine = True
    builds_image = True

    @property
    def home(self):
        return self.settings.state_dir / "docker" / self.settings.job_name

    def image(self) -> str:
        return trainimage.reference(self.settings, on_this_machine=True)

    def manifests(self, job: Job) -> list[dict]:
        return jobspec.manifests(job.settings, job.train_args, job.run, image=trainimage.reference(job.settings, True))

    def containers(self, all_runs: bool = True) -> list:
        found = client().containers.list(all=True, filters={"label": [f"{JOB}={self.settings.job_name}", f"{TARGET}=docker",
                                                                      f"{STATE}={state_label(self.settings)}"]})
        return sorted(found, key=lambda c: int(c.labels.get(REPLICA, 0)))

    # -- submission ---------------------------------------------------------------------------------------------------
    def plan(self, job: Job) -> Plan:
        s = job.settings
        manifests = self.manifests(job)
        pytorchjob = manifests[-1]
        plan = Plan(self.name, job, manifests=manifests, image=pytorchjob["spec"]["pytorchReplicaSpecs"]["Worker"]
                    ["template"]["spec"]["containers"][0]["image"])
        ctx: dict[str, Any] = {"endpoint": None, "started_etcd": False}
        plan.context = ctx
        plan.steps.append(Step(f"check: docker daemon, image {plan.image}, job {s.job_name} not running, data in "
                               f"{elastic.data_root(s)}", lambda: self._check(s, plan.image)))
        if s.rdzv_backend.startswith("etcd"):
            server = etcd(s.state_dir)
            what = (f"use etcd at {s.etcd_endpoint}" if s.etcd_endpoint else
                    "use the running local etcd" if server.info() else "start the local etcd (v2 API)")
            plan.steps.append(Step(f"{what} for rendezvous (stands in for Deployment etcd / Service etcd-service)",
                                   lambda: self._etcd(s, ctx)))
            shown = "127.0.0.1:ETCD_PORT"
        else:
            ctx["endpoint"] = shown = f"127.0.0.1:{free_port()}"
        if job.fresh:
            plan.steps.append(Step(f"remove checkpoints and metrics of {s.job_name}", lambda: _clear_outputs(s)))
        plan.steps.append(Step(f"record the manifests in {self.home / 'manifests.yaml'}",
                               lambda: self._record(manifests, job.run)))
        volumes = runtime.volumes_dir(s)
        for replica in range(s.replicas):
            spec = container_spec(pytorchjob, replica, shown, volumes, job.run, state_label(s))
            plan.steps.append(Step(docker_run_line(spec),
                                   lambda replica=replica: self._start(pytorchjob, replica, ctx["endpoint"], job.run)))
        return plan

    def _check(self, s, image: str) -> None:
        docker = client()
        import docker as sdk

        try:
            docker.images.get(image)
        except sdk.errors.ImageNotFound:
            raise DoeksError(f"training image {image} is not built: run `invoke elasticjob.build`") from None
        live = [c for c in self.containers() if c.status in ("running", "restarting", "created")]
        if live:
            raise DoeksError(f"job {s.job_name} is already running ({len(live)} containers): `invoke elasticjob.status`, "
                             "or `invoke elasticjob.delete` first")
        for stale in self.containers():
            stale.remove(force=True)
        elastic.check_data(s)

    def _etcd(self, s, ctx) -> None:
        from ..runner import Runner

        ctx["started_etcd"] = not s.etcd_endpoint and etcd(s.state_dir).info() is None
        ctx["endpoint"] = runtime.etcd_endpoint(s, Runner(echo=False))

    def _record(self, manifests, run) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "manifests.yaml").write_text(to_yaml_stream(manifests))
        (self.home / "pytorchjob.json").write_text(json.dumps(manifests[-1], indent=2))
        (self.home / "run.json").write_text(json.dumps({"run": run, "endpoint": None}))

    def _start(self, pytorchjob, replica: int, endpoint: str, run: str):
        record = json.loads((self.home / "run.json").read_text())
        if record.get("endpoint") != endpoint:
            record["endpoint"] = endpoint
            (self.home / "run.json").write_text(json.dumps(record))
        spec = container_spec(pytorchjob, replica, endpoint, runtime.volumes_dir(self.settings), run,
                              state_label(self.settings))
        for folder in spec["volumes"]:
            Path(folder).mkdir(parents=True, exist_ok=True)
        return client().containers.run(**spec)

    def submit(self, plan: Plan, runner) -> None:
        try:
            super().submit(plan, runner)
        except BaseException:
            for container in self.containers():  # what this submission started, never a job already running
                if container.labels.get(RUN) == plan.job.run:
                    container.remove(force=True)
            if plan.context.get("started_etcd"):
                etcd(plan.job.settings.state_dir).stop()
            raise

    # -- after submission ---------------------------------------------------------------------------------------------
    def _record_read(self) -> dict[str, Any]:
        try:
            return json.loads((self.home / "run.json").read_text())
        except (OSError, ValueError):
            return {}

    def describe(self) -> JobStatus:
        s = self.settings
        containers = self.containers()
        run = self._record_read().get("run", "")
        if not containers:
            return JobStatus(self.name, s.job_name, STOPPED, run=run, reason="no containers (not deployed, or deleted)")
        replicas, states = [], []
        import docker as sdk

        for c in list(containers):
            try:
                c.reload()
            except sdk.errors.NotFound:  # removed meanwhile (scale down, delete from another shell)
                containers.remove(c)
                continue
            state = c.attrs["State"]
            restarts = int(c.attrs.get("RestartCount", 0))
            if state.get("Restarting"):
                replica_state = RESTARTING
            elif state.get("Running"):
                replica_state = RUNNING
            elif state.get("Status") == "created":
                replica_state = PENDING
            elif state.get("ExitCode") == 0:
                replica_state = SUCCEEDED
            else:  # exited non-zero and docker is not restarting it: its restart policy is spent
                replica_state = FAILED
            progress = _last_progress(c)
            replicas.append(ReplicaStatus(f"node-{c.labels.get(REPLICA)}", replica_state, restarts,
                                          progress.get("step"), progress.get("samples_per_s"), progress.get("world"),
                                          c.short_id))
            states.append(replica_state)
        if not states:
            return JobStatus(self.name, s.job_name, STOPPED, run=run, reason="its containers were removed")
        if any(x in (RUNNING, RESTARTING, PENDING) for x in states):
            job_state = RUNNING
        elif all(x == SUCCEEDED for x in states):
            job_state = SUCCEEDED
        else:
            job_state = FAILED
        reason = ""
        if job_state == FAILED:
            failed = [c for c, x in zip(containers, states) if x == FAILED]
            code = failed[0].attrs["State"].get("ExitCode")
            reason = f"{failed[0].name} exited with {code} after {failed[0].attrs.get('RestartCount', 0)} restarts"
        return JobStatus(self.name, s.job_name, job_state, run=run, replicas=replicas, desired=len(containers),
                         restarts=sum(r.restarts for r in replicas), reason=reason)

    def _cursor(self, replica: int | None = None):
        offsets: dict[str, int] = {}

        def new_lines() -> list[str]:
            lines = []
            for c in self.containers():
                node = c.labels.get(REPLICA)
                if replica is not None and node != str(replica):
                    continue
                try:
                    data = c.logs(stdout=True, stderr=True)
                except Exception:  # noqa: BLE001 - removed meanwhile
                    continue
                start = offsets.get(c.id, 0)
                complete = data.rfind(b"\n") + 1
                if complete > start:
                    offsets[c.id] = complete
                    lines += [f"[node-{node}] {line}" for line in data[start:complete].decode(errors="replace").splitlines()]
            return lines

        return new_lines

    def logs(self, follow: bool = False, replica: int | None = None) -> Iterator[str]:
        from .follow import check_replica, follow_until_done

        check_replica(self, replica)
        return follow_until_done(self, self._cursor(replica), follow)

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
            runner.note(f"job {s.job_name}: no containers (checkpoints kept in {elastic.checkpoint_dir(s)})")
            return False
        running = [c for c in containers if c.status in ("running", "restarting", "created")]
        for c in containers:
            runner.step(f"docker rm -f {c.name}", c.remove, force=True)
        return bool(running)

    def artifacts(self) -> dict[str, str]:
        s = self.settings
        return {"metrics": str(elastic.metrics_dir(s)), "checkpoints": str(elastic.checkpoint_dir(s)),
                "final": str(elastic.metrics_dir(s) / "final.json"), "manifests": str(self.home / "manifests.yaml")}


def _last_progress(container) -> dict[str, Any]:
    try:
        tail = container.logs(tail=200).decode(errors="replace")
    except Exception:  # noqa: BLE001 - a container removed meanwhile
        return {}
    matches = STEP_LINE.findall(tail)
    if not matches:
        return {}
    step, epoch, loss, acc, rate, world = matches[-1]
    return {"step": int(step), "samples_per_s": float(rate), "world": int(world)}


def _clear_outputs(settings) -> None:
    import shutil

    for folder in (elastic.checkpoint_dir(settings), elastic.metrics_dir(settings)):
        shutil.rmtree(folder, ignore_errors=True)


def remove_all(settings, runner) -> int:
    """Every container doeks labelled for any job (used by `down`)."""
    try:
        found = [c for c in client().containers.list(all=True, filters={"label": [f"{PART_OF}=doeks",
                                                                                    f"{STATE}={state_label(settings)}"]})
                 if c.labels.get(TARGET) in ("docker", "sagemaker-local")]
    except DoeksError:
        return 0
    for c in found:
        runner.step(f"docker rm -f {c.name}", c.remove, force=True)
    return len(found)
