"""Goodput under faults on doeks' own cluster (issue 33): one elastic run of at least --minutes (10), a fault every
--every seconds (120), in turn:
- pod deleted: a worker pod, `kubectl delete pod --grace-period=0 --force` (the training operator makes a new one);
- container killed: a worker's container task SIGKILLed through its node's containerd (the kubelet restarts it);
- rank stopped: a worker's training process SIGSTOPped (alive, no progress: the hang watchdog names it after
  HANG_TIMEOUT and restarts it);
- node stopped: the node of a worker (an extra node: its kubelet, kube-proxy, containers, containerd stopped, its link
  down; `invoke cluster.node-stop`), started again --node-down seconds later.
KUBE_NODES=3, an elastic job of 3 replicas (2 to 3), one per node. For each fault: detected (the first line of any pod
that shows the job noticed: a worker group failing or restarting, a re-rendezvous, the watchdog naming the rank) and
recovered (the first step logged after a worker process started again) in seconds after the fault; a node's return
adds when the job grew back to 3. At the end, per window (the deploy to the first fault, each fault to the next),
the wall time the pods' step lines do not account as productive; then the run's goodput: productive step time (the seconds of steps the model
holds: steps done again after a restart from the checkpoint count once) over the wall time since the deploy, from the
pods' own step lines, as `status` and `history` show it.

Needs `invoke setup --kubernetes`; the cluster is started with three nodes here and stopped at the end unless it ran
before. Ends with `goodput under faults: 0.NN`; a bench that cannot finish says why in one line and exits 1.

Run: python bench/faults.py [--minutes 10] [--every 120] [--hang-timeout 30] [--node-down 30]
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from docker_target import BenchError, invoke, target_for  # noqa: E402

TRAIN_ARGS = "--log-every 1 --step-delay 0.2"
STEP = re.compile(r"\] \d\d:\d\d:\d\d\.\d{3} \[rank \d+\] step=(\d+) .* world=(\d+)")
NOTICED = re.compile(r"doeks: watchdog: hang:|Worker group (FAILED|UNHEALTHY)|worker group failed|Detected \d+ new "
                     r"nodes|Rendezvous version \d+ is complete|ChildFailedError|Connection (reset|closed)")
FAULTS = ("pod deleted", "container killed", "rank stopped", "node stopped")


class Lines:
    """Every pod's new log lines, read in the background about once a second, each with when it was read."""

    def __init__(self, target):
        self.cursor, self.seen, self.lock = target._cursor(), [], threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            try:
                new = self.cursor()
            except Exception:  # noqa: BLE001 - the API server busy for a moment: read again
                new = []
            now = time.monotonic()
            with self.lock:
                self.seen += [(now, line) for line in new]
            self.stop.wait(1.0)

    def after(self, when: float) -> list[tuple[float, str]]:
        with self.lock:
            return [(t, line) for t, line in self.seen if t >= when]


def workers(target) -> list[dict]:
    return [p for p in target._pods() if "-worker-" in p["metadata"]["name"]]


def victim(target) -> dict:
    """A running worker pod on an extra node (a node that can be stopped), the highest-numbered one."""
    from doeks.cluster import versions

    pods = [p for p in workers(target) if p.get("status", {}).get("phase") == "Running"
            and p.get("spec", {}).get("nodeName", versions.NODE_NAME) != versions.NODE_NAME]
    if not pods:
        raise BenchError("no worker pod runs on an extra node: the job's replicas did not spread over the nodes")
    return sorted(pods, key=lambda p: p["metadata"]["name"])[-1]


def container_of(pod: dict) -> tuple:
    from doeks.cluster import node

    where = node.node_named(pod["spec"]["nodeName"])
    cid = pod["status"]["containerStatuses"][0]["containerID"].split("://")[-1]
    return where, cid


def rank_pid(pod: dict) -> int:
    """The pod's training process: a child of the zygote, the agent's child (the container's first process)."""
    from doeks.cluster import node
    from doeks.local import jobs

    where, cid = container_of(pod)
    listed = node.ctr("tasks", "ls", node=where).stdout.splitlines()
    init = next((int(line.split()[1]) for line in listed if line.startswith(cid)), None)
    if init is None:
        raise BenchError(f"no task of {pod['metadata']['name']}'s container on node {where.name}")
    for zygote in jobs.children_of(init):
        for pid in jobs.children_of(zygote):
            return pid
    raise BenchError(f"no training process in {pod['metadata']['name']}")


def inject(env, target, fault: str, node_down: float) -> tuple[str, str | None]:
    """The fault, on a worker of an extra node; (what was hit, the node stopped or None)."""
    from doeks import kube
    from doeks.cluster import node

    pod = victim(target)
    name = pod["metadata"]["name"]
    if fault == "pod deleted":
        subprocess.run([kube.kubectl(), "delete", "pod", name, "-n", target.settings.namespace, "--grace-period=0",
                        "--force", "--wait=false"], capture_output=True, check=True)
    elif fault == "container killed":
        where, cid = container_of(pod)
        if node.ctr("task", "kill", "-s", "SIGKILL", cid, node=where).returncode != 0:
            raise BenchError(f"cannot kill the container of {name}")
    elif fault == "rank stopped":
        os.kill(rank_pid(pod), 19)  # SIGSTOP
    else:
        stopped = pod["spec"]["nodeName"]
        invoke(env, "cluster.node-stop", stopped)
        return f"{name} on {stopped}", stopped
    return name, None


def measure(lines: Lines, at: float, timeout: float = 300) -> tuple[float | None, float | None]:
    """(detected, recovered) seconds after `at`, from the pods' lines."""
    deadline = time.monotonic() + timeout
    detected = recovered = None
    started = False
    while time.monotonic() < deadline and recovered is None:
        for t, line in lines.after(at):
            if detected is None and NOTICED.search(line):
                detected = t - at
            if " start host=" in line:
                started = True
            if started and STEP.search(line):
                recovered = t - at
                break
        time.sleep(0.5)
    return detected, recovered


PRODUCTIVE = re.compile(r"\] \d\d:\d\d:\d\d\.\d{3} \[rank \d+\] step=\d+ .* productive=([\d.]+)s")


def productive_by(lines: Lines, until: float) -> float:
    """The run's productive step time as the pods had logged it by `until` (the largest `productive=` of any rank's
    step line read by then: steps done again after a restart do not add to it)."""
    with lines.lock:
        found = [float(m.group(1)) for t, line in lines.seen if t <= until and (m := PRODUCTIVE.search(line))]
    return max(found, default=0.0)


def grown_back(lines: Lines, at: float, world: int, timeout: float = 300) -> float | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for t, line in lines.after(at):
            found = STEP.search(line)
            if found and int(found.group(2)) == world:
                return t - at
        time.sleep(0.5)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--every", type=float, default=120)
    parser.add_argument("--hang-timeout", type=int, default=30)
    parser.add_argument("--node-down", type=float, default=30)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="doeks-bench-faults-"))
    env = {**os.environ, "TARGET": "kubernetes", "KUBECONFIG": "", "KUBE_NODES": "3", "STATE_DIR": str(work / "state"),
           "JOB_NAME": "benchfaults", "DATA_TRAIN_PER_CLASS": "200", "DATA_VAL_PER_CLASS": "20", "EPOCHS": "400",
           "CHECKPOINT_EVERY": "5", "REPLICAS": "3", "MIN_REPLICAS": "2", "MAX_REPLICAS": "3", "NPROC_PER_NODE": "1",
           "BATCH_SIZE": "16", "HANG_TIMEOUT": str(args.hang_timeout)}
    from doeks.cluster import build, node
    from doeks.targets import runs

    if build.missing():
        print("bench failed: doeks' cluster is not built: `invoke setup --kubernetes`", file=sys.stderr)
        return 1
    was_running = bool(node.pid("kube-apiserver"))
    results = []
    try:
        invoke(env, "up")  # three nodes, every unit; the job's first run is replaced below
        target = target_for(env)
        invoke(env, "elasticjob.delete")
        deployed = time.monotonic()
        invoke(env, "elasticjob.deploy", "--fresh", "--train-args", TRAIN_ARGS)
        lines = Lines(target)
        end = deployed + args.minutes * 60
        marks = [deployed]  # the deploy, then each fault: the windows whose lost time is printed at the end
        for index in range(int(args.minutes * 60 // args.every)):
            due = deployed + (index + 1) * args.every
            if due >= end:
                break
            time.sleep(max(0.0, due - time.monotonic()))
            fault = FAULTS[index % len(FAULTS)]
            at = time.monotonic()
            hit, stopped = inject(env, target, fault, args.node_down)
            detected, recovered = measure(lines, at)
            back = None
            if stopped:
                time.sleep(max(0.0, at + args.node_down - time.monotonic()))
                returned = time.monotonic()
                invoke(env, "cluster.node-start", stopped)
                grown = grown_back(lines, returned, 3)
                back = None if grown is None else (returned - at) + grown
            results.append((at - deployed, fault, hit, detected, recovered, back))
            marks.append(at)
            shown = (f"fault {len(results)} at +{at - deployed:.0f} s, {fault} ({hit}): detected in "
                     f"{'-' if detected is None else f'{detected:.1f} s'}, recovered in "
                     f"{'-' if recovered is None else f'{recovered:.1f} s'}")
            if stopped:
                shown += f"; node back after {args.node_down:.0f} s, 3 replicas again at " + (
                    "-" if back is None else f"+{back:.1f} s")
            print(shown, flush=True)
        time.sleep(max(0.0, end - time.monotonic()))
        marks.append(time.monotonic())
        time.sleep(2.5)  # the last lines read
        logged = [productive_by(lines, mark) for mark in marks]
        gained = [b - a for a, b in zip(logged, logged[1:])]
        names = ["deploy"] + [f"fault {i + 1} ({r[1]})" for i, r in enumerate(results)]
        print("wall time not productive, per window (seconds from each mark to the next, less the productive step "
              "time the pods logged in it): " + ", ".join(
                  f"{name} {b - a - g:.0f} of {b - a:.0f}" for name, a, b, g in zip(names, marks, marks[1:], gained)),
              flush=True)
        status = target.describe()
        record = runs.settle(target.settings, status) or {}
        lines.stop.set()
        if record.get("goodput") is None:
            raise BenchError(f"no goodput reported for run {status.run} (state {status.state})")
    except BenchError as e:
        print(f"bench failed: {e}", file=sys.stderr)
        return 1
    finally:
        invoke(env, "elasticjob.delete", check=False)
        if not was_running:
            invoke(env, "down", "--yes", check=False)
        shutil.rmtree(work, ignore_errors=True)
    print(f"run of {record['wall']:.0f} s with {len(results)} faults (one every {args.every:.0f} s, HANG_TIMEOUT="
          f"{args.hang_timeout}): productive step time {record['productive']:.0f} s")
    print(f"goodput under faults: {record['goodput']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
