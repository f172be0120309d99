"""Kubeflow on the cluster from the pinned upstream platform release (kubeflow/manifests): prerequisites checked
first, the default password replaced, `kustomize build` + server-side apply retried until the CRDs settle, then a wait
for the pods. The user's password is never printed: it is read from KUBEFLOW_PASSWORD or generated and written to a
file only the user can read.

Also the standalone Kubeflow training operator (v1, for elastic PyTorchJobs), side by side with the MPI operator: a
local kustomization over the upstream standalone overlay that drops the operator's MPIJob CRD (kubeflow.org/v1 only;
the MPI operator owns `mpijobs.kubeflow.org` at v2beta1, kubeflow/trainer#1930) and enables only the schemes nothing
else on the cluster serves (`--enable-scheme`).
"""
from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Any

from . import ui
from .errors import DoeksError

# kubeflow/manifests tag 26.03 (commit d68ebc7, 2026-03-21): the current dated platform release. Its example/ installs
# Kubeflow Trainer v2.1.0 (namespace kubeflow-system, with JobSet) and has the v1 training operator commented out, so
# it ships no MPIJob CRD (the only one in the tree is under applications/training-operator, which example/ omits).
VERSION = "26.03"
REPOSITORY = "https://github.com/kubeflow/manifests.git"
DEFAULT_USER = "user@example.com"
NAMESPACES = ("cert-manager", "istio-system", "auth", "oauth2-proxy", "knative-serving", "kubeflow", "kubeflow-system",
              "kubeflow-user-example-com")

# Kubeflow Trainer v2.3.0 (kubeflow/trainer tag v2.3.0, commit 658725b, 2026-08-06), the release the TrainJob path
# targets (../shared/schemas); its kubeflow-platform overlay replaces the release's applications/trainer (v2.1.0).
TRAINER_VERSION = "v2.3.0"
TRAINER_PLATFORM = f"https://github.com/kubeflow/trainer.git/manifests/overlays/kubeflow-platform?ref={TRAINER_VERSION}"
EXAMPLE_TRAINER = "../applications/trainer/overlays"

# The standalone training operator v1: kubeflow/trainer (was kubeflow/training-operator) tag v1.9.4 (2026-08-18),
# manifests/overlays/standalone. Its base/crds lists tfjobs, pytorchjobs, xgboostjobs, mpijobs (v1), paddlejobs, jaxjobs.
TRAINING_OPERATOR_REF = "v1.9.4"
TRAINING_OPERATOR_BASE = f"https://github.com/kubeflow/trainer.git/manifests/overlays/standalone?ref={TRAINING_OPERATOR_REF}"
MPIJOB_CRD = "mpijobs.kubeflow.org"
# cmd/training-operator.v1/main.go (v1.9.4): `--enable-scheme` may be repeated; default = every supported scheme
# (TFJob, PyTorchJob, XGBoostJob, MPIJob, PaddleJob, JAXJob; pkg/controller.v1/register_controller.go). MPIJob is left
# out: the MPI operator (efa unit) serves it.
OPERATOR_SCHEMES = ("tfjob", "pytorchjob", "xgboostjob", "paddlejob", "jaxjob")


def checkout(settings) -> Path:
    return settings.state_dir / "kubeflow" / f"manifests-{VERSION}"


def overlay_dir(settings) -> Path:
    return settings.state_dir / "kubeflow" / "overlay"


def password_file(settings) -> Path:
    return settings.state_dir / "kubeflow" / "password"


def password(settings) -> str:
    """KUBEFLOW_PASSWORD, else one generated once and kept in a 0600 file (never the upstream default)."""
    given = settings.kubeflow_password
    if given:
        if len(given) < 12 or given == "12341234":
            raise DoeksError("KUBEFLOW_PASSWORD is too weak: use at least 12 characters (the upstream default is refused)")
        return given
    path = password_file(settings)
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    value = secrets.token_urlsafe(18)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return value


def dex_patch(hashed: str) -> str:
    """A kustomize patch of the Secret `auth/dex-passwords` with our bcrypt hash for the default user (26.03's dex
    config reads it with `hashFromEnv: DEX_USER_PASSWORD`: common/dex/base/config-map.yaml, dex-passwords.yaml)."""
    import yaml

    patch = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "dex-passwords", "namespace": "auth"},
             "stringData": {"DEX_USER_PASSWORD": hashed}}
    return yaml.safe_dump(patch, sort_keys=False)


# Marks istio-system and cert-manager as Kubeflow's (upstream's Namespaces have no such label), so a second deploy is
# not refused as "an Istio / a cert-manager not installed by Kubeflow" (26.03 installs both: common/istio,
# common/cert-manager).
OWNED_NAMESPACES = ("istio-system", "cert-manager")
NAMESPACE_PATCH = "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {name}\n  labels:\n    app.kubernetes.io/part-of: kubeflow\n"


def write_overlay(settings) -> Path:
    """overlay/: the release's `example` (same resources, same sort order) with Kubeflow Trainer v2.3.0 in place of
    the release's v2.1.0 (whose TrainJob has podTemplateOverrides, not runtimePatches), plus our dex password patch and
    the ownership label on istio-system and cert-manager. Needs the release checked out (deploy clones it first)."""
    import bcrypt
    import yaml

    root = checkout(settings)
    example_file = root / "example" / "kustomization.yaml"
    if not example_file.is_file():
        raise DoeksError(f"{example_file} not found: the Kubeflow manifests {VERSION} checkout is incomplete "
                         f"(remove {root} and deploy again)")
    example = yaml.safe_load(example_file.read_text())
    resources = list(example.get("resources") or [])
    if EXAMPLE_TRAINER not in resources:
        raise DoeksError(f"{example_file} does not list {EXAMPLE_TRAINER}: not the {VERSION} layout doeks knows")
    overlay = overlay_dir(settings)
    (overlay / "trainer").mkdir(parents=True, exist_ok=True)
    trainer = yaml.safe_load((root / "example" / EXAMPLE_TRAINER / "kustomization.yaml").read_text())
    trainer["resources"] = [TRAINER_PLATFORM]  # keeps the release's namespace (kubeflow-system) and Istio patches
    (overlay / "trainer" / "kustomization.yaml").write_text(yaml.safe_dump(trainer, sort_keys=False))
    hashed = bcrypt.hashpw(password(settings).encode(), bcrypt.gensalt(rounds=12)).decode()
    (overlay / "dex-password.yaml").write_text(dex_patch(hashed))
    for name in OWNED_NAMESPACES:
        (overlay / f"namespace-{name}.yaml").write_text(NAMESPACE_PATCH.format(name=name))
    ours: dict[str, Any] = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization"}
    if example.get("sortOptions"):
        ours["sortOptions"] = example["sortOptions"]
    ours["resources"] = ["trainer" if r == EXAMPLE_TRAINER
                         else os.path.relpath(os.path.normpath(root / "example" / r), overlay) for r in resources]
    ours["patches"] = [{"path": "dex-password.yaml"}] + [{"path": f"namespace-{name}.yaml"} for name in OWNED_NAMESPACES]
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(ours, sort_keys=False))
    return overlay


def prerequisites(api_client) -> list[str]:
    """What stands in the way on this cluster (empty = ready): a default StorageClass (Kubeflow's databases and
    SeaweedFS claim volumes without a class), no foreign Istio and no foreign cert-manager (26.03 installs its own).
    An MPIJob CRD from the MPI operator is fine: 26.03 ships none (its example/ leaves the v1 training operator out)."""
    from kubernetes import client as k8s

    problems = []
    classes = k8s.StorageV1Api(api_client).list_storage_class().items
    default = [c.metadata.name for c in classes
               if (c.metadata.annotations or {}).get("storageclass.kubernetes.io/is-default-class") == "true"]
    if not default:
        problems.append("no default StorageClass (Kubeflow's databases need one): annotate one with "
                        "storageclass.kubernetes.io/is-default-class=true")
    core = k8s.CoreV1Api(api_client)
    for name, what in (("istio-system", "an Istio"), ("cert-manager", "a cert-manager")):
        try:
            namespace = core.read_namespace(name)
            if (namespace.metadata.labels or {}).get("app.kubernetes.io/part-of") != "kubeflow":
                problems.append(f"{what} not installed by Kubeflow is present (namespace {name}): remove it or install Kubeflow by hand")
        except k8s.ApiException as error:
            if error.status != 404:
                raise
    return problems


def api_client():
    from kubernetes import config

    try:
        return config.new_client_from_config()
    except Exception as error:  # noqa: BLE001
        raise DoeksError(f"no Kubernetes cluster configured ({type(error).__name__}): run `invoke eks.connect`") from None


def deploy(settings, runner, attempts: int = 20, wait_s: float = 15) -> None:
    from . import kube

    if runner.dry_run:
        runner.run(["git", "clone", "--depth", "1", "--branch", VERSION, REPOSITORY, str(checkout(settings))])
        runner.step(f"write {overlay_dir(settings)} (Kubeflow platform {VERSION} example with Trainer {TRAINER_VERSION} in place of "
                    "its own, dex password patch with a bcrypt hash)", lambda: None)
        runner.run(["kubectl", "kustomize", str(overlay_dir(settings))])
        runner.run(["kubectl", "apply", "--server-side", "--force-conflicts", "-f", "-"])
        return
    problems = prerequisites(api_client())
    if problems:
        raise DoeksError("Kubeflow prerequisites not met: " + "; ".join(problems))
    if not checkout(settings).exists():
        runner.run(["git", "clone", "--depth", "1", "--branch", VERSION, REPOSITORY, str(checkout(settings))])
    overlay = write_overlay(settings)
    built = runner.run([kube.kubectl(), "kustomize", str(overlay)], mutating=False, capture=True).stdout
    with ui.progress() as bar:
        task_id = bar.add_task("applying Kubeflow (CRDs settle over several rounds)", total=attempts)
        for attempt in range(1, attempts + 1):
            result = runner.run([kube.kubectl(), "apply", "--server-side", "--force-conflicts", "-f", "-"],
                                input=built, check=False, capture=True)
            bar.update(task_id, completed=attempt)
            if result.returncode == 0:
                break
            time.sleep(wait_s)
        else:
            raise DoeksError(f"Kubeflow manifests did not apply after {attempts} rounds: see `kubectl get pods -A`")
    for namespace in NAMESPACES:
        runner.run([kube.kubectl(), "wait", "--for=condition=Ready", "pods", "--all", "-n", namespace, "--timeout=600s"], mutating=False)
    ui.say(f"Kubeflow platform {VERSION} (Trainer {TRAINER_VERSION}) is up; log in as {DEFAULT_USER} with the password in {password_file(settings)} "
           "(or KUBEFLOW_PASSWORD); `invoke kubeflow.expose` opens the dashboard")


PLATFORM_DELETE_TIMEOUT = 900  # seconds: the platform's namespaces go once their pods and claims have (EBS on EKS)


def platform_on_cluster() -> bool:
    """Whether the cluster has a Kubeflow platform that doeks' kubeflow.deploy installed: it labels istio-system
    `app.kubernetes.io/part-of: kubeflow` (NAMESPACE_PATCH), which upstream's manifests do not."""
    from . import kube

    found = kube.get_json(["namespace", OWNED_NAMESPACES[0]])
    return bool(found) and (found["metadata"].get("labels") or {}).get("app.kubernetes.io/part-of") == "kubeflow"


def remove(settings, runner, on_down: bool = False, timeout: int = PLATFORM_DELETE_TIMEOUT) -> None:
    """Delete what kubeflow.deploy applied from this STATE_DIR's overlay, waiting at most `timeout` s for it to be
    gone (on EKS its claims are EBS volumes, which a cluster deleted first would leave behind, billing). Without the
    overlay: nothing of doeks' here; a platform doeks labelled on the cluster all the same is one error line (it
    was deployed from another checkout or STATE_DIR: remove it from there). `on_down`: `invoke down`'s step, whose
    plan shows the deletion only when there is one to do."""
    from . import kube

    overlay = overlay_dir(settings)
    argv = ["delete", "--ignore-not-found", "--wait=true", f"--timeout={timeout}s", "-k", str(overlay)]
    if runner.dry_run:
        if overlay.exists() or not on_down:
            kube.run(runner, argv)
        return
    if not overlay.exists():
        if platform_on_cluster():
            raise DoeksError(f"a Kubeflow platform deployed by doeks is on the cluster (namespace {OWNED_NAMESPACES[0]} "
                             f"is labelled by kubeflow.deploy) but its overlay is not in {overlay.parent}: run "
                             "`invoke kubeflow.remove` where it was deployed from (its STATE_DIR)")
        ui.say("Kubeflow platform: not deployed by doeks here (no overlay): nothing to remove")
        return
    ui.say(f"removing the Kubeflow platform {VERSION} that kubeflow.deploy installed (at most {timeout} s)")
    try:
        kube.run(runner, argv)
    except DoeksError as error:
        if "timed out" in str(error):
            raise DoeksError(f"waited {timeout} s for the Kubeflow platform's objects to be gone, and they were not "
                             "(`kubectl get ns` shows what is left terminating)") from None
        raise


def pod_rows(api) -> list[list[Any]]:
    from kubernetes import client as k8s

    core = k8s.CoreV1Api(api)
    rows = []
    for namespace in NAMESPACES:
        try:
            pods = core.list_namespaced_pod(namespace).items
        except k8s.ApiException:
            continue
        ready = sum(1 for p in pods if p.status.phase in ("Running", "Succeeded"))
        rows.append([namespace, len(pods), ready])
    return rows


def operator_dir(settings) -> Path:
    return settings.state_dir / "kubeflow" / "training-operator"


OPERATOR_NAMESPACE = "kubeflow"  # the standalone overlay's namespace.yaml: shared with the platform's kubeflow namespace


def restricted_ops() -> list[dict[str, Any]]:
    """JSON patch operations making the operator's Deployment meet Pod Security `restricted`, which kubeflow/manifests
    26.03 enforces on namespace `kubeflow`: v1.9.4's sets only allowPrivilegeEscalation=false, so its pod is refused
    the next time it is made (a node drained, a rollout). Its image (distroless/static) runs as root: a non-root user
    is named (distroless' nonroot, 65532), which reads the mounted webhook certificate as any user can."""
    pod = {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "seccompProfile": {"type": "RuntimeDefault"}}
    container = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True,
                 "seccompProfile": {"type": "RuntimeDefault"}}
    return [{"op": "add", "path": "/spec/template/spec/securityContext", "value": pod},
            {"op": "add", "path": "/spec/template/spec/containers/0/securityContext", "value": container}]


def operator_kustomization(base: str = TRAINING_OPERATOR_BASE, drop_mpijob: bool = True, for_delete: bool = False) -> str:
    """The standalone training operator over `base`: without its MPIJob CRD (the MPI operator owns it) and with
    `--enable-scheme` for every scheme but MPIJob, so the operator neither installs nor reconciles MPIJobs.
    `for_delete`: also without the overlay's Namespace `kubeflow`, which the Kubeflow platform (and whatever else
    runs there) shares: deleting the operator never deletes that namespace."""
    import yaml

    args = [f"--enable-scheme={scheme}" for scheme in OPERATOR_SCHEMES]
    ops = [{"op": "add", "path": "/spec/template/spec/containers/0/args", "value": args}]
    ops += restricted_ops()
    patches: list[dict[str, Any]] = [{"target": {"group": "apps", "version": "v1", "kind": "Deployment", "name": "training-operator"},
                                      "patch": yaml.safe_dump(ops, sort_keys=False)}]
    if drop_mpijob:
        patches.insert(0, {"patch": yaml.safe_dump({"$patch": "delete", "apiVersion": "apiextensions.k8s.io/v1",
                                                    "kind": "CustomResourceDefinition", "metadata": {"name": MPIJOB_CRD}},
                                                   sort_keys=False)})
    if for_delete:
        patches.insert(0, {"patch": yaml.safe_dump({"$patch": "delete", "apiVersion": "v1", "kind": "Namespace",
                                                    "metadata": {"name": OPERATOR_NAMESPACE}}, sort_keys=False)})
    return yaml.safe_dump({"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                           "resources": [base], "patches": patches}, sort_keys=False)


def write_operator_kustomization(settings, base: str = TRAINING_OPERATOR_BASE, folder: Path | None = None,
                                 for_delete: bool = False) -> Path:
    import os

    folder = folder or operator_dir(settings)
    folder.mkdir(parents=True, exist_ok=True)
    if os.path.isabs(base):  # a local overlay (doeks' own cluster): kustomize takes a base by relative path only
        base = os.path.relpath(base, folder)
    (folder / "kustomization.yaml").write_text(operator_kustomization(base, for_delete=for_delete))
    return folder


def operator_base(settings) -> str:
    """The standalone overlay the kustomization builds on: upstream's on GitHub, or, on doeks' own cluster (no
    network), the same overlay inside the operator's Go module at the pinned version."""
    if settings.own_cluster:
        from .cluster import operators

        op = operators.TRAINING_OPERATOR
        return str(operators.module_dir(op) / op.overlay)
    return TRAINING_OPERATOR_BASE


def operator_deploy(settings, runner) -> None:
    from . import kube

    folder = operator_dir(settings)
    base = operator_base(settings)
    if settings.own_cluster:
        from .cluster import operators

        operators.ensure_images(operators.TRAINING_OPERATOR, runner)
    if runner.dry_run:
        import yaml

        runner.step(f"write {folder}/kustomization.yaml (printed on stdout)", lambda: None)
        runner.emit([yaml.safe_load(operator_kustomization(base))])
        kube.run(runner, ["apply", "--server-side", "-k", str(folder)])
        kube.run(runner, ["rollout", "status", "-n", "kubeflow", "deployment/training-operator", "--timeout=300s"])
        return
    write_operator_kustomization(settings, base)
    kube.run(runner, ["apply", "--server-side", "-k", str(folder)])
    # its webhook validates every PyTorchJob (failurePolicy Fail): a job applied before it serves is refused
    kube.run(runner, ["rollout", "status", "-n", "kubeflow", "deployment/training-operator", "--timeout=300s"])


def operator_delete(settings, runner) -> None:
    """Deletes what operator_deploy applies but the shared `kubeflow` namespace (and never the MPI operator's MPIJob
    CRD); safe twice."""
    from . import kube

    folder = operator_dir(settings) / "delete"
    base = operator_base(settings)
    if runner.dry_run:
        import yaml

        runner.step(f"write {folder}/kustomization.yaml (printed on stdout)", lambda: None)
        runner.emit([yaml.safe_load(operator_kustomization(base, for_delete=True))])
    else:
        write_operator_kustomization(settings, base, folder=folder, for_delete=True)
    kube.delete_from(runner, "-k", str(folder))


# Trainer v2.3.0 on its own (a cluster without the platform): the controller + JobSet (manifests/overlays/manager),
# then the ClusterTrainingRuntimes incl. torch-distributed (manifests/overlays/runtimes), which need the CRDs and
# the webhook up first (hence the retries).
TRAINER_MANAGER = f"https://github.com/kubeflow/trainer.git/manifests/overlays/manager?ref={TRAINER_VERSION}"
TRAINER_RUNTIMES = f"https://github.com/kubeflow/trainer.git/manifests/overlays/runtimes?ref={TRAINER_VERSION}"


def trainer_sources(settings, runner) -> tuple[str, str, str | None]:
    """(manager, runtimes, JobSet) kustomizations: upstream's on GitHub (its manager overlay brings JobSet), or on
    doeks' own cluster the same manifests from the modules at the pinned versions, JobSet apart, images built here
    (the operators', and the images the runtimes name that doeks can make: doeks.cluster.runtimes)."""
    if not settings.own_cluster:
        return TRAINER_MANAGER, TRAINER_RUNTIMES, None
    from .cluster import operators, runtimes

    operators.trainer_images(runner)
    runtimes.ensure_images(settings, runner)  # the runtimes' images doeks can make; the others named
    folders = operators.trainer_kustomizations(settings.state_dir, write=not runner.dry_run)
    return str(folders["trainer"]), str(folders["runtimes"]), str(folders["jobset"])


def trainer_deploy(settings, runner, attempts: int = 20, wait_s: float = 10) -> None:
    from . import kube

    manager, runtimes, jobset = trainer_sources(settings, runner)
    if jobset:
        kube.run(runner, ["apply", "--server-side", "-k", jobset])
        if not runner.dry_run:
            runner.run([kube.kubectl(), "wait", "-n", "jobset-system", "--for=condition=Available", "deployment", "--all",
                        "--timeout=300s"], mutating=False)
    kube.run(runner, ["apply", "--server-side", "-k", manager])
    if runner.dry_run:
        kube.run(runner, ["apply", "--server-side", "-k", runtimes])
        return
    runner.run([kube.kubectl(), "wait", "-n", "kubeflow-system", "--for=condition=Available", "deployment", "--all", "--timeout=300s"],
               mutating=False)
    for _ in range(attempts):
        if runner.run([kube.kubectl(), "apply", "--server-side", "-k", runtimes], check=False).returncode == 0:
            return
        time.sleep(wait_s)
    raise DoeksError(f"the Trainer {TRAINER_VERSION} runtimes did not apply after {attempts} rounds: see `kubectl get pods -n kubeflow-system`")


def trainer_delete(settings, runner) -> None:
    from . import kube

    if settings.own_cluster and not runner.dry_run:
        from .cluster import operators

        folders = operators.trainer_kustomizations(settings.state_dir)
        manager, runtimes, jobset = str(folders["trainer"]), str(folders["runtimes"]), str(folders["jobset"])
    else:
        manager, runtimes, jobset = TRAINER_MANAGER, TRAINER_RUNTIMES, None
    kube.delete_from(runner, "-k", runtimes)
    kube.delete_from(runner, "-k", manager)
    if jobset:
        kube.delete_from(runner, "-k", jobset)
