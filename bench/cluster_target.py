"""The cluster path (TARGET=kubernetes on doeks' own cluster: an elastic PyTorchJob, stock torchrun in the training
image, etcd rendezvous) vs the local target, measured in one run on the same script, data and job (2 nodes x 1
process), as bench/docker_target.py does for docker (issue 21):

1. Time to first step: from `invoke elasticjob.deploy` to the first logged optimizer step.
2. Recovery: past the first checkpoint, a worker killed; time until the next optimizer step of any rank.
   - local: node 1's agent and workers SIGKILLed (the supervisor restarts them);
   - cluster, pod: `kubectl delete pod <job>-worker-1 --grace-period=0 --force` (the training operator makes a new pod);
   - cluster, container: its container's task SIGKILLed through containerd (the kubelet restarts it in place).
   The ratio line uses the killed pod, what a user on EKS meets when a node or pod is lost.
3. First step right after the training image is imported into the node (issue 33): the node's copy removed
   (`ctr images rm --sync`), imported again (`docker save | ctr import`, timed apart), then a deploy timed to its first
   step, against the warm deploy of the same round (the pod round's first step).

Recovery ends at the first step after a worker process started again (its `start host=` line), on every target.
Lines are timed when the bench reads them (the cluster's through the API server, polled every ~0.5 s). Needs
`invoke setup --kubernetes` (the cluster is started here and stopped at the end unless it was running before).
Ends with the lines `cluster first step vs local: N.NNx`, `cluster recovery vs local: N.NNx`, `cluster container killed vs
local: N.NNx`, `pod deleted, slowest round: N.N s` and `first step after an image import vs warm: N.NNx` (medians of
the rounds); a bench that cannot finish says why in one line and exits 1 as soon as it knows.

Run: python bench/cluster_target.py [--rounds N]   (3 by default)
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from docker_target import BenchError, Watch, invoke, kill_node, target_for  # noqa: E402

TRAIN_ARGS = "--log-every 1 --step-delay 0.2"


def kill_pod(target, how: str) -> None:
    from doeks import kube
    from doeks.cluster import node

    s = target.settings
    name = f"{s.job_name}-worker-1"
    if how == "pod":
        subprocess.run([kube.kubectl(), "delete", "pod", name, "-n", s.namespace, "--grace-period=0", "--force",
                        "--wait=false"], capture_output=True, check=True)
        return
    pod = target._get(["pod", name, "-n", s.namespace]) or {}
    container = pod.get("status", {}).get("containerStatuses", [{}])[0].get("containerID", "").split("://")[-1]
    if not container or node.ctr("task", "kill", "-s", "SIGKILL", container).returncode != 0:
        raise BenchError(f"cannot kill the container of {name}")


def anatomy(target, killed_wall: float, replica: int = 1) -> str:
    """What a start or a killed pod's recovery was made of, from the API server and the pod's log (seconds after
    `killed_wall`: the deploy or the kill)."""
    import datetime

    from doeks import kube

    s = target.settings
    name = f"{s.job_name}-worker-{replica}"
    pod = target._get(["pod", name, "-n", s.namespace]) or {}

    def at(stamp: str | None) -> str:
        if not stamp:
            return "?"
        when = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
        return f"{when - killed_wall:.1f}"

    created = pod.get("metadata", {}).get("creationTimestamp")
    running = (pod.get("status", {}).get("containerStatuses") or [{}])[0].get("state", {}).get("running", {})
    log = subprocess.run([kube.kubectl(), "logs", name, "-n", s.namespace, "--timestamps"], capture_output=True,
                         text=True).stdout.splitlines()
    first = log[0].split(" ", 1)[0] if log else None
    rdzv = next((line.split(" ", 1)[0] for line in log if "Rendezvous version" in line and "complete" in line), None)
    step = next((line.split(" ", 1)[0] for line in log if "] step=" in line), None)
    worker = next((line.split(" ", 1)[0] for line in log if "] process started" in line), None)
    group = next((line.split(" ", 1)[0] for line in log if "] start host=" in line), None)
    return (f"{name}: pod created +{at(created)} s, container started +{at(running.get('startedAt'))} s, first log line "
            f"+{at(first)} s, rendezvous complete +{at(rdzv)} s, worker's first line +{at(worker)} s, process group "
            f"+{at(group)} s, its first step +{at(step)} s")


def reimport(env) -> float:
    """The training image removed from the node and imported again; seconds the import took."""
    from doeks import trainimage
    from doeks.cluster import images, node
    from doeks.runner import Runner

    target = target_for(env)
    ref = trainimage.reference(target.settings, on_this_machine=True)
    node.ctr("images", "rm", "--sync", images.containerd_name(ref))
    node.ctr("images", "rm", "--sync", ref)
    began = time.monotonic()
    images.ensure(Runner(echo=False), [ref])
    return time.monotonic() - began


def first_step(env) -> float:
    """A deploy timed to its first step (the job deleted first), then deleted."""
    target = target_for(env)
    invoke(env, "elasticjob.delete")
    started, started_wall = time.monotonic(), time.time()
    invoke(env, "elasticjob.deploy", "--fresh", "--train-args", TRAIN_ARGS)
    first = Watch(target).step(started) - started
    print(f"cluster, first step after an image import in {first:.1f} s; {anatomy(target, started_wall, 0)}", flush=True)
    invoke(env, "elasticjob.delete")
    return first


def one_round(env, name: str, how: str = "pod") -> tuple[float, float]:
    target = target_for(env)
    invoke(env, "elasticjob.delete")  # the previous run's teardown is not this run's start
    started, started_wall = time.monotonic(), time.time()
    invoke(env, "elasticjob.deploy", "--fresh", "--train-args", TRAIN_ARGS)
    watch = Watch(target)
    first = watch.step(started) - started
    if name != "local":
        print(f"cluster, first step in {first:.1f} s; {anatomy(target, started_wall, 0)}", flush=True)
    watch.step(0, min_step=int(env["CHECKPOINT_EVERY"]) + 2)  # past the first checkpoint
    killed, killed_wall = time.monotonic(), time.time()
    if name == "local":
        kill_node(target)
    else:
        kill_pod(target, how)
    # the next step after the recovery: one past the last seen before the kill cannot be the in-flight one (a step a
    # survivor logs before it notices the loss); the training resumes from the checkpoint, at a lower step
    recovery = watch.step(killed, restarted=True) - killed
    if name != "local":
        time.sleep(3)
        print(f"cluster, {how} killed: recovered in {recovery:.1f} s; {anatomy(target, killed_wall)}", flush=True)
    invoke(env, "elasticjob.delete")
    return first, recovery


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="doeks-bench-cluster-"))
    base = {**os.environ, "STATE_DIR": str(work / "state"), "JOB_NAME": "benchk8s", "DATA_TRAIN_PER_CLASS": "200",
            "DATA_VAL_PER_CLASS": "20", "EPOCHS": "20", "CHECKPOINT_EVERY": "5", "REPLICAS": "2",
            "NPROC_PER_NODE": "1", "MIN_REPLICAS": "1", "MAX_REPLICAS": "2", "BATCH_SIZE": "16"}
    local = {**base, "TARGET": "local"}
    cluster = {**base, "TARGET": "kubernetes", "KUBECONFIG": ""}
    from doeks.cluster import build, node

    if build.missing():
        print("bench failed: doeks' cluster is not built: `invoke setup --kubernetes`", file=sys.stderr)
        return 1
    was_running = any(node.running().values())
    rows: dict[str, list[tuple[float, float]]] = {"local": [], "pod": [], "container": []}
    imported: list[tuple[float, float]] = []  # (import seconds, first step seconds)
    try:
        invoke(local, "elasticjob.data")
        invoke(cluster, "up")  # starts the cluster and deploys every unit (the job's first run is replaced below)
        for _ in range(args.rounds):
            rows["local"].append(one_round(local, "local"))
            rows["pod"].append(one_round(cluster, "kubernetes", "pod"))
            rows["container"].append(one_round(cluster, "kubernetes", "container"))
            took = reimport(cluster)
            print(f"cluster, training image imported again in {took:.1f} s", flush=True)
            imported.append((took, first_step(cluster)))
    except BenchError as e:
        print(f"bench failed: {e}", file=sys.stderr)
        return 1
    finally:
        invoke(local, "elasticjob.delete", check=False)
        invoke(local, "eks.delete", check=False)
        invoke(cluster, "elasticjob.delete", check=False)
        if not was_running:
            invoke(cluster, "down", "--yes", check=False)
        shutil.rmtree(work, ignore_errors=True)
    med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for k, v in rows.items()}
    print(f"rounds: {args.rounds}; " + ", ".join(f"{k} {[tuple(round(x, 1) for x in r) for r in v]}"
                                                  for k, v in rows.items()))
    print(f"time to first step: local {med['local'][0]:.1f} s, cluster {med['pod'][0]:.1f} s")
    print(f"recovery: local (node killed) {med['local'][1]:.1f} s, cluster pod deleted {med['pod'][1]:.1f} s, "
          f"cluster container killed {med['container'][1]:.1f} s "
          f"({med['container'][1] / med['local'][1]:.2f}x local)")
    print(f"first step right after an image import: {statistics.median(i[1] for i in imported):.1f} s (imports took "
          f"{', '.join(f'{i[0]:.0f}' for i in imported)} s), warm {med['pod'][0]:.1f} s")
    print(f"cluster first step vs local: {med['pod'][0] / med['local'][0]:.2f}x")
    print(f"cluster recovery vs local: {med['pod'][1] / med['local'][1]:.2f}x")
    print(f"cluster container killed vs local: {med['container'][1] / med['local'][1]:.2f}x")
    print(f"pod deleted, slowest round: {max(r[1] for r in rows['pod']):.1f} s")
    print(f"first step after an image import vs warm: "
          f"{statistics.median(i[1] for i in imported) / med['pod'][0]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
