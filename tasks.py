"""doeks root tasks: one collection per unit folder, `up`/`down` across units, the management container, and
the local main job (`invoke demo`). Run `invoke --list` for everything.

Kept thin and light: units are loaded by path (folders with a hyphen too) and nothing heavy is imported here.
"""
import importlib.util
from pathlib import Path

from invoke import Collection

from doeks import container
from doeks.taskkit import runner, settings, target, task

ROOT = Path(__file__).resolve().parent
UNIT_FILES = {"eks": "eks/tasks.py", "csi": "csi/tasks.py", "efa": "efa-device-plugin/tasks.py",
              "gpu-metrics": "gpu-metrics/tasks.py", "kubeflow": "kubeflow/tasks.py", "sagemaker": "kubeflow/sagemaker.py",
              "kueue": "kueue/tasks.py", "elasticjob": "elasticjob/tasks.py", "cluster": "cluster/tasks.py",
              "dev": "dev/tasks.py"}


def _load_unit(name, path):
    spec = importlib.util.spec_from_file_location(f"doeks_unit_{name.replace('-', '_')}", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


UNITS = {name: _load_unit(name, path) for name, path in UNIT_FILES.items()}


def _ordered_units():
    return sorted((m.UNIT for m in UNITS.values() if getattr(m, "UNIT", None)), key=lambda u: u.order)


@task(help={"dry_run": "print every unit's plan, one line a step (the whole plan goes to STATE_DIR/plans/); change "
                       "nothing (what cannot be looked up is shown as unknown)",
            "full": "with --dry-run: print the whole plan: every request with its parameters, the manifests' YAML on stdout",
            "yes": "create what bills (TARGET=eks, sagemaker) without asking (scripts, CI)"})
def up(c, dry_run=False, full=False, yes=False):
    """Set everything up: each unit's deploy/create step in setup order (a dry run plans every unit).

    TARGET=eks or sagemaker: first what it makes that AWS bills by the hour (instance types and counts, FSx, the NAT
    gateway) with the on-demand $/hour, then one question (--yes: none; no terminal or CI without --yes: refused).
    A dry run fits on a screen (the summary and a line a step) unless --full."""
    import contextlib

    from invoke import Exit

    from doeks import planview, pricing, ui

    where = target()
    pricing.confirm(where, yes, dry_run)  # before anything is made
    brief = dry_run and not full
    failed = []
    with planview.capture() if brief else contextlib.nullcontext() as held:
        for unit in _ordered_units():
            ui.say(f"== up: {unit.name}", style="bold")
            try:
                unit.up(c, dry_run=dry_run)
            except Exit as error:
                if not dry_run:
                    raise
                ui.warn(f"{unit.name}: {error.message}")  # a dry run goes on: the whole plan, every unit
                failed.append(unit.name)
    if brief:
        planview.show(where.settings, "up", held)
    _plan_summary(dry_run, failed, "up")
    target().after_up(dry_run)


def _plan_summary(dry_run, failed, verb):
    from invoke import Exit

    from doeks import runner as steps
    from doeks import ui

    if not dry_run:
        return
    if steps.UNKNOWN:
        ui.say(f"{len(steps.UNKNOWN)} lookup(s) unknown in this plan ({', '.join(steps.UNKNOWN)}): they are read when "
               "it runs with credentials", style="yellow")
    if failed:
        raise Exit(f"error: the {verb} plan failed for {', '.join(failed)}: see the warnings above", code=1)


def _takes(task_obj, flag):
    import inspect

    return flag in inspect.signature(getattr(task_obj, "body", task_obj)).parameters


def _teardown_summary(units) -> list[str]:
    lines = []
    for unit in units:
        body = getattr(unit.down, "body", unit.down)
        doc = (body.__doc__ or "").strip().splitlines()[0] if body.__doc__ else ""
        lines.append(f"  {unit.name}: {unit.down.name}: {doc}")
    return lines


def _confirm_teardown(where, units) -> None:
    """One confirmation for the whole teardown, before anything is deleted."""
    import sys

    from doeks import ui
    from doeks.errors import DoeksError

    s = where.settings
    what = where.teardown_what()
    if not sys.stdin.isatty():
        raise DoeksError(f"`invoke down` deletes {what} ({', '.join(u.name for u in units)}): pass --yes to confirm "
                         "(stdin is not a terminal); --dry-run shows the plan")
    ui.say(f"`invoke down` will delete {what}, in this order:", style="bold")
    for line in _teardown_summary(units):
        ui.say(line)
    answer = input(f"Type the cluster name ({s.cluster_name}) to delete it all: ")
    if answer.strip() != s.cluster_name:
        raise DoeksError("not confirmed: nothing deleted")


@task(help={"dry_run": "print every unit's plan; change nothing (what cannot be looked up is shown as unknown)",
            "yes": "confirm the whole teardown without asking (scripts); TARGET=eks asks once otherwise",
            "force": "delete the cluster even after an earlier unit failed (what that unit left may be stranded), and "
                     "the shared volume even where it holds a job's only model (TARGET=eks with MODEL_URI not in S3)"})
def down(c, dry_run=False, yes=False, force=False):
    """Tear everything down: each unit's delete step in exactly the reverse order, going on past what is gone.

    TARGET=eks: asks once, up front, for the whole teardown (--yes: not at all); each unit waits until what it
    deletes is really gone; when a unit fails the others still run, but the cluster is not deleted (its VPC
    would keep what the failed unit left) unless --force. Run `invoke audit` afterwards: it exits non-zero while
    anything is left.

    First it says where each job's model and last checkpoint are (TARGET=eks: S3, which `down` keeps), and refuses
    while a model is only on the shared volume it would delete (`invoke csi.data.save-model` copies it), unless --force."""
    from invoke import Exit

    from doeks import ui

    where = target()
    s = where.settings
    cluster = where.asks_before_down   # a cluster that costs money and is asked for; kubernetes: doeks' own or the user's
    units = list(reversed(_ordered_units()))
    where.before_down(runner(dry_run), force=force)  # before anything is asked or deleted
    if cluster and not dry_run and not yes:
        _confirm_teardown(where, units)
    failed = []
    for unit in units:
        if cluster and not dry_run and failed and unit.name == "eks" and not force:
            raise Exit(f"error: not deleting cluster {s.cluster_name}: {', '.join(failed)} failed (what it left depends "
                       "on the cluster's VPC): fix the errors above and run `invoke down` again, or pass --force", code=1)
        ui.say(f"== down: {unit.name}", style="bold")
        try:
            unit.down(c, dry_run=dry_run, **({"yes": True} if _takes(unit.down, "yes") else {}))
        except Exit as error:
            ui.warn(f"{unit.name}: {error.message}")
            failed.append(unit.name)
    _plan_summary(dry_run, failed, "teardown")
    if failed:
        raise Exit(f"error: teardown incomplete for {', '.join(failed)}: fix the errors above and run `invoke down` again", code=1)


@task
def audit(c):
    """Every AWS resource doeks tagged or made for CLUSTER_NAME that still exists, with $/hour where known; exit 1 if any."""
    from invoke import Exit

    from doeks import audit as scan
    from doeks import ui

    s = settings()
    found = scan.scan(s)
    if not found:
        ui.say(f"audit: nothing left for cluster {s.cluster_name} in {s.aws_region}")
        return
    ui.table(f"doeks resources left for {s.cluster_name} ({s.aws_region})", ["kind", "id", "detail", "$/hour"], scan.rows(found))
    raise Exit(f"error: {len(found)} resource(s) left, about ${scan.total_per_hour(found):,.2f}/hour where priced: "
               "run `invoke down` (TARGET=eks)", code=1)


@task(help={"json": "print a JSON list (key, unit, value, source) instead of the table; secrets masked",
            "key": "only keys containing this text (case-insensitive); give it more than once for several"},
      iterable=["key"])
def config(c, json=False, key=None):
    """Print the effective settings (.env, environment, defaults) to stdout as a table or JSON; secrets masked."""
    import json as json_module

    from doeks import settings as settings_module
    from doeks import ui
    from doeks.errors import DoeksError

    s = settings_module.current(lenient=True)  # a bad value is shown marked, then named: config is how to find it
    from doeks import targets

    try:
        s = targets.settled(s)  # what the target uses where a key is empty (TARGET=eks: checkpoints and model in S3)
    except DoeksError:
        pass
    rows = s.rows()
    wanted = [k.strip().upper() for k in key or [] if k.strip()]
    if key and not wanted:
        raise DoeksError("--key: give part of a key name, e.g. --key REPLICAS")
    if wanted:
        rows = [row for row in rows if any(w in row[1] for w in wanted)]
        if not rows:
            raise DoeksError(f"--key {' '.join(key)}: no setting matches; `invoke config` lists them all")
    if json:
        print(json_module.dumps([{"key": k, "unit": u, "value": settings_module.mask_value(settings_module.KEY_BY_NAME[k], s.raw(k)),
                                  "source": f, **({"problem": s.problems[k]} if k in s.problems else {})}
                                 for u, k, v, f in rows], indent=2))
    else:
        ui.table(f"doeks settings (TARGET={s.target})", ["unit", "key", "value", "from"], rows, stdout=True)
    _settings_problems(s)


def _settings_problems(s) -> None:
    """The values not accepted, as one error line (config and doctor show them marked first)."""
    from doeks.errors import SettingsError

    problems = list(s.problems.values())
    if len(problems) == 1:
        raise SettingsError(problems[0])
    if problems:
        raise SettingsError(f"{len(problems)} settings are not accepted: " + "; ".join(problems))


@task(help={"docker": "also install and start a local docker daemon (Debian docker.io) and make a base image",
            "kubernetes": "also build doeks' own single-node Kubernetes (once per version, cached outside the repo; "
                          "implies --docker) and its images",
            "kueue": "also build Kueue and kwok for doeks' cluster (the kueue unit, KUBE_SIM_NODES; implies --kubernetes)",
            "dry_run": "print what would be installed and built"})
def setup(c, docker=False, kubernetes=False, kueue=False, dry_run=False):
    """Install what pip cannot (torchvision CPU shim, etcd check, optional docker daemon, optional cluster); idempotent."""
    from doeks import machine

    machine.setup(runner(dry_run), docker=docker or kubernetes or kueue, kubernetes=kubernetes or kueue, kueue=kueue)


@task
def doctor(c):
    """Preflight for TARGET: what it needs, and the settings; exit 1 when a needed check fails.

    Each target owns its checks: local/docker: tools and services; kubernetes: API server, nodes, CoreDNS, the
    operator and its webhook, the image on the node; eks: credentials, cluster, kubeconfig, tools; sagemaker: role,
    bucket, image. Every target: each setting's value (a bad one is a failed check, shown with where it came from)."""
    from doeks import targets, ui
    from doeks.errors import DoeksError
    from doeks.settings import current

    s = current(lenient=True)  # a bad value is a failed check here (its default stands in), not the end
    where = targets.get(s)
    where.connect()
    rows = where.checks()  # each target owns its checks
    rows = [(f"setting {key}", False, problem, True) for key, problem in s.problems.items()] + rows
    ui.table(f"doeks doctor (TARGET={s.target})", ["check", "ok", "detail / fix", "needed"],
             [[w, "yes" if ok else ("NO" if required else "no"), d, "yes" if required else ""] for w, ok, d, required in rows])
    missing = [w for w, ok, _, required in rows if required and not ok]
    if missing:
        raise DoeksError(f"TARGET={s.target} cannot work here: {', '.join(missing)} (see the fixes above)")


@task(help={"keep": "leave etcd and the job's files running/in place at the end",
            "verbose": "show every node's log lines (torchelastic's INFO, every rank), not rank 0's progress alone",
            "dry_run": "print the data plan, the manifests (stdout) and the local commands; change nothing"})
def demo(c, keep=False, verbose=False, dry_run=False):
    """The main job: make data, start etcd, run a 2-node x 2-process elastic job to the end, plot, tear down."""
    from doeks import demo as main_job

    main_job.run(settings(), keep=keep, dry_run=dry_run, verbose=verbose)


# -- the management container -------------------------------------------------------------------------------------
@task(help={"no_cache": "build without the layer cache", "dry_run": "print the build; change nothing"})
def build(c, no_cache=False, dry_run=False):
    """Tools container: build its image (aws, kubectl, helm, eksctl, doeks); the job's: `invoke elasticjob.build`."""
    container.build(settings(), runner(dry_run), no_cache=no_cache)


@task(name="run", help={"dry_run": "print the container that would start"})
def run_(c, dry_run=False):
    """Tools container: start it (mounts ~/.aws read-only, ~/.kube, the project, the docker socket)."""
    container.run(settings(), runner(dry_run))


@task(name="exec", help={"command": "command to run inside (or give it after --); default: a shell",
                         "dry_run": "print the docker exec; run nothing"})
def exec_(c, command="", dry_run=False):
    """Tools container: a shell in it, or a command: `invoke exec -- CMD`."""
    command = command or getattr(c, "remainder", "")
    if dry_run:
        s = settings()
        runner(True).step(f"docker exec {s.doeks_container_name} bash -lc {command!r}" if command else f"docker exec -it {s.doeks_container_name} bash",
                          lambda: None)
        return
    container.exec_(settings(), command)


@task(name="status")
def status_(c):
    """The tools container, the local runtime, and the job on TARGET (`invoke elasticjob.status` for the job alone)."""
    from doeks import lastjob, targets, ui
    from doeks.errors import DoeksError
    from doeks.targets import show

    s = lastjob.choose(settings(), ui.say)  # the job last deployed from here, as elasticjob.status
    where = targets.get(s)
    container.status(s, where.status_rows())
    try:
        show.status(where)
    except DoeksError as error:  # the job's target cannot be read now: say so, the rest is still shown
        ui.say(f"job {s.job_name} on {s.target}: cannot read its status: {error}", style="yellow")


@task(help={"dry_run": "print; change nothing"})
def stop(c, dry_run=False):
    """Tools container: stop and remove it (safe to run twice)."""
    container.stop(settings(), runner(dry_run))


@task(help={"follow": "keep streaming"})
def logs(c, follow=False):
    """Tools container: its logs (the training job's: `invoke elasticjob.logs`)."""
    container.logs(settings(), follow=follow)


@task(help={"dry_run": "print; change nothing"})
def push(c, dry_run=False):
    """Tools container: push its image to REGISTRY (ECR when 'default'); the job's: `invoke elasticjob.push`."""
    container.push(settings(), runner(dry_run))


@task(help={"dry_run": "print; change nothing"})
def pull(c, dry_run=False):
    """Tools container: pull its image from REGISTRY."""
    container.pull(settings(), runner(dry_run))


@task(help={"dry_run": "print; change nothing"})
def login(c, dry_run=False):
    """Tools container: log docker in to the account's ECR with a token from boto3."""
    container.login(settings(), runner(dry_run))


@task(name="test")
def test_(c):
    """Tools container: its image's self-test (exit 1 when a check fails or a needed tool is missing)."""
    container.self_test(settings())


ns = Collection(up, down, audit, config, setup, doctor, demo, build, run_, exec_, status_, stop, logs, push, pull, login, test_)
for _name, _module in UNITS.items():
    ns.add_collection(_module.ns, name=_name)
