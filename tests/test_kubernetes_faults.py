"""Faults on doeks' own cluster with three nodes (KUBE_NODES=3), as a user and a test meet them, through the API
server: every extra node guarded before it runs; a node lost under an elastic job of 2 to 3 replicas (the job goes on
with two, `status` names the node, it grows back to three when the node returns); a rank stopped with SIGSTOP (its
replica's watchdog names it in `status` within HANG_TIMEOUT + 15 s and restarts it); the job ends Succeeded, with
its goodput and every step in `history`; then the extra nodes removed leave nothing. Marked `cluster_down`: `down` of
a three-node cluster leaves nothing of any node.
Opt-in (CI does not run it, docs/testing.md): only with DOEKS_MULTINODE_TESTS=1, else every test skips in one line
naming it.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest

from .conftest import invoke, wait_for
from .test_kubernetes_cluster import SMALL_JOB, kubectl, own_cluster
from .test_kubernetes_jobs import progress, trains_past

pytestmark = [pytest.mark.kubernetes, pytest.mark.slow]

JOB = "faults1"
HANG_TIMEOUT = 20
# three replicas (two at least), one per node; a step of at least 1 s and 120 in all: the faults fit in the run
VALUES = {**SMALL_JOB, "JOB_NAME": JOB, "KUBE_NODES": "3", "REPLICAS": "3", "MIN_REPLICAS": "2", "MAX_REPLICAS": "3",
          "EPOCHS": "100", "CHECKPOINT_EVERY": "5", "HANG_TIMEOUT": str(HANG_TIMEOUT)}
TRAIN_ARGS = "--log-every 1 --step-delay 1 --max-steps 120"


# Opt-in, as tests/test_kubernetes_kueue.py is: two extra nodes and their faults take more than what is left of CI's hour
OPT_IN = "DOEKS_MULTINODE_TESTS"


@pytest.fixture(scope="module")
def env(request):
    if os.environ.get(OPT_IN) != "1":
        pytest.skip(f"three-node cluster tests are opt-in: {OPT_IN}=1 python -m pytest tests/test_kubernetes_faults.py "
                    "runs them")
    yield from own_cluster(request, VALUES)


def said(result) -> str:
    return result.stdout + result.stderr


def status(env) -> str:
    return said(invoke("elasticjob.status", env=env, timeout=120))


def pods(env) -> dict[str, dict]:
    items = json.loads(kubectl(env, "get", "pods", "-A", "-o", "json").stdout)["items"]
    return {p["metadata"]["name"]: p for p in items}


def lose_a_node(env) -> tuple[str, str]:
    """An extra node running one of the job's workers and nothing the others need (the job's etcd, CoreDNS, an
    operator): (node, worker)."""
    from doeks.cluster import versions

    everything = pods(env)
    workers = {p["spec"].get("nodeName"): name for name, p in everything.items() if name.startswith(f"{JOB}-worker-")}
    needed = {p["spec"].get("nodeName") for name, p in everything.items() if not name.startswith(f"{JOB}-worker-")}
    free = sorted(n for n in workers if n and n != versions.NODE_NAME and n not in needed)
    assert free, f"no extra node runs a worker alone: workers on {workers}, the rest on {needed}"
    return free[-1], workers[free[-1]]


def rank_process(env, pod: str) -> int:
    """The pod's training process, seen from the host: a child of the zygote, the first child of the container's
    first process (the agent)."""
    from doeks.cluster import node
    from doeks.local import jobs

    def found():  # the pod may be new (a rung of the node loss above replaced it): its container running, its rank up
        state = pods(env).get(pod) or {}
        running = [c for c in state.get("status", {}).get("containerStatuses", []) if "running" in c.get("state", {})]
        if not running or not running[0].get("containerID"):
            return None
        where = node.node_named(state["spec"]["nodeName"])
        cid = running[0]["containerID"].split("://")[-1]
        init = next((int(line.split()[1]) for line in node.ctr("tasks", "ls", node=where).stdout.splitlines()
                     if line.startswith(cid)), None)
        return init and next((pid for zygote in jobs.children_of(init) for pid in jobs.children_of(zygote)), None)

    return wait_for(found, 180, f"{pod}'s training process", poll=2)


def test_up_with_three_nodes_guards_each_before_it_runs(env):
    from doeks.cluster import guard, node, versions

    result = invoke("up", env=env, timeout=2400)
    assert result.returncode == 0, result.stderr[-3000:]
    print("\n".join(line for line in said(result).splitlines() if re.search(r"\d s\)?$|\ds |node doeks-|import", line)))
    nodes = json.loads(kubectl(env, "get", "nodes", "-o", "json").stdout)["items"]
    assert sorted(n["metadata"]["name"] for n in nodes) == ["doeks", "doeks-1", "doeks-2"]
    assert all(c["status"] == "True" for n in nodes for c in n["status"]["conditions"] if c["type"] == "Ready")
    addresses = {n["metadata"]["name"]: n["status"]["addresses"][0]["address"] for n in nodes}
    assert addresses == {"doeks": versions.NODE_IP, "doeks-1": "10.244.255.1", "doeks-2": "10.244.255.2"}
    # the extra nodes are for training pods (as EKS's GPU node group): the cluster's own services stay on node doeks
    taints = {n["metadata"]["name"]: n["spec"].get("taints", []) for n in nodes}
    assert not taints["doeks"] and all(any(t["key"] == versions.WORKER_TAINT["key"] for t in each)
                                       for name, each in taints.items() if name != "doeks"), taints
    # the host's guard keeps every node's range in; each extra node has its own, hooked first in its POSTROUTING
    assert ["-s", versions.CLUSTER_CIDR] == guard.rules(guard.default_interface())[0][:2]
    for index in (1, 2):
        assert guard.node_installed(node.Node(index).netns)
        # its pods' bridge has a MAC of its own, as doeks0 has (a port's going would not change the gateway's)
        cni0 = subprocess.run(["ip", "-n", node.Node(index).netns, "link", "show", "cni0"], capture_output=True, text=True)
        assert f"link/ether {versions.bridge_mac(index)} " in cni0.stdout, cni0.stdout + cni0.stderr
    listed = invoke("cluster.nodes", env=env, timeout=120)
    assert listed.returncode == 0 and said(listed).count("Ready") >= 3, said(listed)
    # bad input: one line each, nothing stopped
    for name, words in (("doeks", "runs the control plane"), ("doeks-7", "no node doeks-7"), ("web", "no node web")):
        refused = invoke("cluster.node-stop", name, env=env, timeout=120)
        assert refused.returncode == 1 and words in refused.stderr and "Traceback" not in refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    planned = invoke("cluster.node-stop", "doeks-2", "--dry-run", env=env, timeout=120)
    assert planned.returncode == 0 and "would node doeks-2: stop kubelet" in said(planned), said(planned)
    assert all(node.running(node.Node(2)).values())


def test_a_lost_node_is_named_the_job_goes_on_with_two_and_grows_back_to_three(env):
    deploy = invoke("elasticjob.deploy", "--fresh", "--train-args", TRAIN_ARGS, env=env, timeout=900)
    assert deploy.returncode == 0, deploy.stderr[-3000:]
    step = trains_past(env, 3, 3, timeout=420, job=JOB)
    lost, worker = lose_a_node(env)
    stopped = invoke("cluster.node-stop", lost, env=env, timeout=300)
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    began = time.monotonic()
    # the two others go on (elastic min 2): a step logged in a world of 2
    wait_for(lambda: any(p.get("world") == 2 and p.get("step", 0) > step for name, p in progress(env, JOB).items()
                         if name != worker), 180, "the job training on with two replicas", poll=2)
    went_on = time.monotonic() - began
    text = wait_for(lambda: f"node {lost} lost: NotReady" in (t := status(env)) and t, 120, "status naming the node")
    assert f"on it: {worker}" in text and f"{lost} (lost)" in text, text
    print(f"node {lost} stopped: the job went on with two in {went_on:.0f} s")
    started = invoke("cluster.node-start", lost, env=env, timeout=600)
    assert started.returncode == 0, started.stderr[-2000:]
    # (its pods may be restarting as it comes back: no log to read yet)
    trains_past(env, max((p.get("step", 0) for p in progress(env, JOB).values()), default=step), 3, timeout=300,
                job=JOB)


def test_a_stopped_rank_is_named_within_the_hang_timeout_and_the_job_succeeds(env):
    pod = f"{JOB}-worker-0"
    # the node lost above stalled the job past HANG_TIMEOUT: its watchdogs named ranks and restarted them (what ended
    # the survivors' wait in a collective with the lost rank), so notes of that hang are there already: this fault's
    # note is the one that says the rank is stopped
    victim = rank_process(env, pod)
    os.kill(victim, signal.SIGSTOP)
    began = time.monotonic()
    stopped = re.compile(rf"\(replica {pod}, local rank 0, pid \d+\) made no progress for \d+ s since step \d+: "
                         r"stopped \(SIGSTOP or a debugger\)")
    wait_for(lambda: stopped.search(status(env)), HANG_TIMEOUT + 15, "status naming the stopped rank", poll=1)
    print(f"rank of {pod} stopped: named in status after {time.monotonic() - began:.0f} s")
    # the ladder acted on it (rung 1 kills it, rung 2 where the node loss spent rung 1 replaces its pod): it is gone
    from doeks.pod.watchdog import process_state

    wait_for(lambda: process_state(victim) in ("", "Z"), 60, f"the stopped rank (pid {victim} here) ended by the watchdog")
    assert re.search(rf"watchdog: replica {pod}: .* \(rung [12] of 4, ", status(env)), status(env)
    job = wait_for(lambda: _final(env), 900, "the job to end", poll=5)
    assert job == "Succeeded", status(env)
    text = status(env)
    assert re.search(r"goodput: 0\.\d\d \(productive step time \d+ s of \d+ s since the deploy\)", text), text
    history = said(invoke("elasticjob.history", env=env, timeout=120))
    assert "Succeeded" in history and re.search(r"│ 0\.\d\d\s+│", history), history
    assert "node doeks-" in history and "lost: NotReady" in history, history
    assert "watchdog: hang: rank" in history and "rung 1 of 4" in history, history


def _final(env) -> str | None:
    out = kubectl(env, "get", "pytorchjob", JOB, "-o", "jsonpath={.status.conditions[-1].type}").stdout
    return out if out in ("Succeeded", "Failed") else None


def test_fewer_nodes_asked_leave_nothing_of_the_others(env):
    from doeks.cluster import guard, node

    result = invoke("up", env={**env, "KUBE_NODES": "1"}, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "node doeks-1 removed (KUBE_NODES=1)" in said(result), said(result)[-2000:]
    nodes = json.loads(kubectl(env, "get", "nodes", "-o", "json").stdout)["items"]
    assert [n["metadata"]["name"] for n in nodes] == ["doeks"]
    left = node.leftovers()
    assert not [p for p in left["processes"] if "doeks-" in p], left
    assert not [n for n in left["network namespaces"] if "doeks-node" in n], left
    assert left["bridge"] == ["doeks0"] and left["routes"] == [r for r in left["routes"] if r.startswith("10.244.0.")]
    assert not node.extra_nodes() and guard.dropped() == 0


@pytest.mark.cluster_down
def test_down_of_a_three_node_cluster_leaves_nothing_of_any_node(env):
    from doeks.cluster import node

    created = invoke("eks.create", env=env, timeout=1200)
    assert created.returncode == 0, created.stderr[-3000:]
    assert len(node.extra_nodes()) == 2
    for _ in range(2):
        down = invoke("down", "--yes", env=env, timeout=900)
        assert down.returncode == 0, down.stderr[-3000:]
        assert node.leftovers() == {"processes": [], "mounts": [], "network namespaces": [], "iptables chains": [],
                                    "bridge": [], "routes": [], "cgroups": []}
