"""doeks root tasks: one collection per unit folder, `up`/`down` across units, the management container, and
the local main job (`invoke demo`). Run `invoke --list` for everything.

Kept thin and light: units are loaded by path (folders with a hyphen too) and nothing heavy is imported here.
"""
import importlib.util
from pathlib import Path

from invoke import Collection

from doeks import container
from doeks.taskkit import runner, settings, task

ROOT = Path(__file__).resolve().parent
UNIT_FILES = {"eks": "eks/tasks.py", "csi": "csi/tasks.py", "efa": "efa-device-plugin/tasks.py",
              "gpu-metrics": "gpu-metrics/tasks.py", "kubeflow": "kubeflow/tasks.py", "sagemaker": "kubeflow/sagemaker.py",
              "elasticjob": "elasticjob/tasks.py"}


def _load_unit(name, path):
    spec = importlib.util.spec_from_file_location(f"doeks_unit_{name.replace('-', '_')}", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


UNITS = {name: _load_unit(name, path) for name, path in UNIT_FILES.items()}


def _ordered_units():
    return sorted((m.UNIT for m in UNITS.values() if getattr(m, "UNIT", None)), key=lambda u: u.order)


@task(help={"dry_run": "print every unit's plan; change nothing"})
def up(c, dry_run=False):
    """Set everything up: each unit's deploy/create step in setup order."""
    from doeks import ui

    for unit in _ordered_units():
        ui.say(f"== up: {unit.name}", style="bold")
        unit.up(c, dry_run=dry_run)


def _takes(task_obj, flag):
    import inspect

    return flag in inspect.signature(getattr(task_obj, "body", task_obj)).parameters


@task(help={"dry_run": "print every unit's plan; change nothing", "yes": "confirm deleting the cluster (TARGET=eks)"})
def down(c, dry_run=False, yes=False):
    """Tear everything down: each unit's delete step in exactly the reverse order, going on past what is gone.

    TARGET=eks: each unit waits until what it deletes is really gone; a unit that fails stops the teardown there
    (what comes next depends on it: the cluster and its VPC are not deleted while a file system, endpoint or role
    made in them remains). Run `invoke audit` afterwards: it exits non-zero while anything is left."""
    from invoke import Exit

    from doeks import ui

    cluster = not settings().on_this_machine
    failed = []
    for unit in reversed(_ordered_units()):
        ui.say(f"== down: {unit.name}", style="bold")
        try:
            unit.down(c, dry_run=dry_run, **({"yes": yes} if _takes(unit.down, "yes") else {}))
        except Exit as error:
            ui.warn(f"{unit.name}: {error.message}")
            failed.append(unit.name)
            if cluster and not dry_run:
                raise Exit(f"error: teardown stopped at {unit.name} (what is left depends on it): fix the error above "
                           "and run `invoke down` again", code=1)
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


@task
def config(c):
    """Print the effective settings (.env, environment, defaults) as a table; secrets masked."""
    from doeks import ui

    s = settings()
    ui.table(f"doeks settings (TARGET={s.target})", ["unit", "key", "value", "from"], s.rows())


@task(help={"docker": "also install and start a local docker daemon (Debian docker.io) and make a base image",
            "dry_run": "print what would be installed"})
def setup(c, docker=False, dry_run=False):
    """Install what pip cannot (torchvision CPU shim, etcd check, optional docker daemon); idempotent."""
    from doeks import preflight

    preflight.setup(runner(dry_run), docker=docker)


@task
def doctor(c):
    """Preflight: check every tool and service doeks uses and say how to fix what is missing."""
    from doeks import preflight

    preflight.doctor()


@task(help={"keep": "leave etcd and the job's files running/in place at the end",
            "dry_run": "print the data plan, the manifests (stdout) and the local commands; change nothing"})
def demo(c, keep=False, dry_run=False):
    """The main job: make data, start etcd, run a 2-node x 2-process elastic job to the end, plot, tear down."""
    from doeks import demo as main_job

    main_job.run(settings(), keep=keep, dry_run=dry_run)


# -- the management container -------------------------------------------------------------------------------------
@task(help={"no_cache": "build without the layer cache", "dry_run": "print the build; change nothing"})
def build(c, no_cache=False, dry_run=False):
    """Build the management container image (streams progress)."""
    container.build(settings(), runner(dry_run), no_cache=no_cache)


@task(name="run", help={"dry_run": "print the container that would start"})
def run_(c, dry_run=False):
    """Start the management container (mounts ~/.aws read-only, ~/.kube, the project, the docker socket)."""
    container.run(settings(), runner(dry_run))


@task(name="exec", help={"command": "command to run inside (or give it after --); default: a shell",
                         "dry_run": "print the docker exec; run nothing"})
def exec_(c, command="", dry_run=False):
    """Open a shell in the running container, or run a command: `invoke exec -- CMD`."""
    command = command or getattr(c, "remainder", "")
    if dry_run:
        s = settings()
        runner(True).step(f"docker exec {s.doeks_container_name} bash -lc {command!r}" if command else f"docker exec -it {s.doeks_container_name} bash",
                          lambda: None)
        return
    container.exec_(settings(), command)


@task(name="status")
def status_(c):
    """Show the management container, the local runtime and the job on TARGET (state, restarts, reason, fix)."""
    from doeks import targets, ui
    from doeks.errors import DoeksError
    from doeks.targets import show

    s = settings()
    container.status(s)
    try:
        show.status(targets.get(s))
    except DoeksError as error:  # the job's target cannot be read now: say so, the rest is still shown
        ui.say(f"job {s.job_name} on {s.target}: cannot read its status: {error}", style="yellow")


@task(help={"dry_run": "print; change nothing"})
def stop(c, dry_run=False):
    """Stop and remove the management container (safe to run twice)."""
    container.stop(settings(), runner(dry_run))


@task(help={"follow": "keep streaming"})
def logs(c, follow=False):
    """Show the management container's logs."""
    container.logs(settings(), follow=follow)


@task(help={"dry_run": "print; change nothing"})
def push(c, dry_run=False):
    """Push the image to REGISTRY (ECR when 'default')."""
    container.push(settings(), runner(dry_run))


@task(help={"dry_run": "print; change nothing"})
def pull(c, dry_run=False):
    """Pull the image from REGISTRY."""
    container.pull(settings(), runner(dry_run))


@task(help={"dry_run": "print; change nothing"})
def login(c, dry_run=False):
    """Log docker in to the account's ECR with a token from boto3."""
    container.login(settings(), runner(dry_run))


@task(name="test")
def test_(c):
    """Run the image's self-test inside a throw-away container."""
    container.self_test(settings())


ns = Collection(up, down, audit, config, setup, doctor, demo, build, run_, exec_, status_, stop, logs, push, pull, login, test_)
for _name, _module in UNITS.items():
    ns.add_collection(_module.ns, name=_name)
