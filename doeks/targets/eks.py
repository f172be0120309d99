"""TARGET=eks: the manifests applied to the cluster with kubectl (server-side apply); the Kubeflow training operator
runs the PyTorchJob. Status from the PyTorchJob's conditions and its pods; logs from `kubectl logs`."""
from __future__ import annotations

import json
import subprocess
from typing import Any, Iterator

from .. import jobspec, kube, trainimage
from ..errors import DoeksError
from .base import (FAILED, PENDING, RESTARTING, RUNNING, STOPPED, SUCCEEDED, Job, JobStatus, Plan, ReplicaStatus,
                   Step, Target)
from .reasons import check_train_args

_CONDITIONS = {"Created": PENDING, "Running": RUNNING, "Restarting": RESTARTING, "Succeeded": SUCCEEDED,
               "Failed": FAILED, "Suspended": STOPPED}
_POD_PROBLEMS = ("CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "CreateContainerConfigError", "OOMKilled")


class EksTarget(Target):
    name = "eks"
    on_this_machine = False

    def manifests(self, job: Job) -> list[dict]:
        return jobspec.manifests(job.settings, job.train_args, job.run, image=trainimage.reference(job.settings, False))

    def plan(self, job: Job) -> Plan:
        check_train_args(job.train_args)
        manifests = self.manifests(job)
        image = manifests[-1]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["image"]
        kinds = ", ".join(f"{m['kind']}/{m['metadata']['name']}" for m in manifests)
        plan = Plan(self.name, job, manifests=manifests, image=image)
        plan.steps.append(Step(f"kubectl apply --server-side --field-manager=doeks --force-conflicts -f - ({kinds} in "
                               f"namespace {job.settings.namespace})", lambda: None))
        return plan

    def submit(self, plan: Plan, runner) -> None:
        from ..runner import to_yaml_stream

        trainimage.require_resolved(plan.image)
        kube.run(runner, ["apply", "--server-side", "--field-manager=doeks", "--force-conflicts", "-f", "-"],
                 input=to_yaml_stream(plan.manifests))

    def _get(self, args: list[str]) -> dict[str, Any] | None:
        argv = [kube.kubectl(), "get"] + args + ["-o", "json"]
        result = subprocess.run(argv, capture_output=True, text=True)
        if result.returncode != 0:
            if "NotFound" in result.stderr or "not found" in result.stderr:
                return None
            first = (result.stderr.strip().splitlines() or ["kubectl failed"])[-1]
            raise DoeksError(f"cannot read the cluster ({first}): run `invoke eks.connect` to write the kubeconfig")
        if not result.stdout.strip():
            return None
        try:
            return json.loads(result.stdout)
        except ValueError:
            raise DoeksError(f"kubectl get {' '.join(args)} answered something that is not JSON") from None

    def describe(self) -> JobStatus:
        s = self.settings
        job = self._get(["pytorchjob", s.job_name, "-n", s.namespace])
        if job is None:
            return JobStatus(self.name, s.job_name, STOPPED, reason=f"no PyTorchJob {s.job_name} in namespace {s.namespace}")
        conditions = [c for c in job.get("status", {}).get("conditions", []) if c.get("status") == "True"]
        state = _CONDITIONS.get(conditions[-1]["type"], RUNNING) if conditions else PENDING
        reason = conditions[-1].get("message", "") if conditions and state == FAILED else ""
        pods = (self._get(["pods", "-n", s.namespace, "-l", f"doeks/job={s.job_name}"]) or {}).get("items", [])
        replicas = []
        for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
            if "etcd" in pod["metadata"].get("labels", {}).get("app", ""):
                continue
            statuses = pod.get("status", {}).get("containerStatuses", [])
            restarts = sum(c.get("restartCount", 0) for c in statuses)
            waiting = next((c["state"]["waiting"].get("reason") for c in statuses if "waiting" in c.get("state", {})), "")
            phase = pod.get("status", {}).get("phase", "Pending")
            replica_state = {"Pending": PENDING, "Running": RUNNING, "Succeeded": SUCCEEDED, "Failed": FAILED}.get(phase, PENDING)
            if waiting in _POD_PROBLEMS:
                replica_state = RESTARTING if waiting == "CrashLoopBackOff" else PENDING
                reason = reason or f"{pod['metadata']['name']}: {waiting}"
            replicas.append(ReplicaStatus(pod["metadata"]["name"], replica_state, restarts,
                                          detail=pod.get("spec", {}).get("nodeName", "")))
        desired = job["spec"]["pytorchReplicaSpecs"]["Worker"].get("replicas")
        return JobStatus(self.name, s.job_name, state, run=job["spec"].get("elasticPolicy", {}).get("rdzvId", ""),
                         replicas=replicas, desired=desired, restarts=sum(r.restarts for r in replicas), reason=reason)

    def logs(self, follow: bool = False, replica: int | None = None) -> Iterator[str]:
        s = self.settings
        selector = f"doeks/job={s.job_name}" + (f",training.kubeflow.org/replica-index={replica}" if replica is not None else "")
        argv = [kube.kubectl(), "logs", "-n", s.namespace, "-l", selector, "--prefix", "--all-containers",
                "--max-log-requests=64"] + (["-f"] if follow else [])
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert process.stdout is not None
        for line in process.stdout:
            yield line.rstrip("\n")
        if process.wait() != 0:
            error = (process.stderr.read().strip().splitlines() or ["kubectl logs failed"])[-1] if process.stderr else ""
            raise DoeksError(f"cannot read logs from the cluster ({error}): `invoke eks.connect` writes the kubeconfig")

    def wait(self, timeout: float | None = None, quiet: bool = False, poll: float = 10) -> JobStatus:
        """Until the PyTorchJob is final: its logs as they come (best effort: there may be no pod yet, or a pod still
        creating), then its status."""
        import time

        from .. import ui

        deadline = time.monotonic() + timeout if timeout else None
        seen: set[str] = set()
        while True:
            status = self.describe()
            if not quiet:
                try:
                    for line in self.logs():
                        if line not in seen:
                            seen.add(line)
                            ui.console().print(line, markup=False, highlight=False)
                except DoeksError:
                    pass  # no pod to read yet
            if status.finished:
                return status
            if deadline and time.monotonic() > deadline:
                raise DoeksError(f"job {self.settings.job_name} still running after {timeout:.0f}s")
            time.sleep(poll)

    def scale(self, replicas: int, runner) -> None:
        self.validate_scale(replicas)
        kube.patch_replicas(runner, self.settings, replicas)

    def cancel(self, runner) -> bool:
        s = self.settings
        existed = False if runner.dry_run else self._get(["pytorchjob", s.job_name, "-n", s.namespace]) is not None
        kube.delete(runner, list(reversed(jobspec.manifests(s, image="-"))))
        return existed

    def artifacts(self) -> dict[str, str]:
        s = self.settings
        base = f"pvc://{s.namespace}/{s.shared_pvc}"
        return {"metrics": f"{base}/metrics/{s.job_name}", "checkpoints": f"{base}/checkpoints/{s.job_name}",
                "final": f"{base}/metrics/{s.job_name}/final.json",
                "copy": "invoke csi.data.save-model copies checkpoints to S3"}
