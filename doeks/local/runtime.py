"""The local runtime as a whole: the servers that stand in for the cloud (etcd, the moto AWS-API endpoint), the
shared volume folder, and the jobs. `up`/`down` are what `eks.create`/`eks.delete` do on TARGET=local.
"""
from __future__ import annotations

from pathlib import Path

from .. import services
from .jobs import job_home, stop as stop_job


def volumes_dir(settings) -> Path:
    return settings.state_dir / "volumes"


def shared_volume(settings) -> Path:
    """The local folder standing in for the shared PVC (SHARED_PVC) mounted at SHARED_MOUNT."""
    return volumes_dir(settings) / settings.shared_pvc


def etcd_endpoint(settings, runner, start: bool = True) -> str | None:
    """host:port of the rendezvous etcd: ETCD_ENDPOINT if set (must answer), else the toolkit's own server."""
    from ..errors import DoeksError

    if settings.etcd_endpoint:
        if not services._http_ok(settings.etcd_endpoint + "/v2/keys"):
            raise DoeksError(f"etcd at ETCD_ENDPOINT={settings.etcd_endpoint} is unreachable or has no v2 API: start it "
                             "with --enable-v2, or leave ETCD_ENDPOINT empty so doeks runs its own")
        return settings.etcd_endpoint.split("://", 1)[-1]
    server = services.etcd(settings.state_dir)
    if server.info() is None:
        if not start:
            return None
        runner.step(f"start etcd (v2 API) on 127.0.0.1:{settings.etcd_port or 'a free port'}, data in {server.home}",
                    server.start, settings.etcd_port or None)
        if runner.dry_run:
            return f"127.0.0.1:{settings.etcd_port or 2379}"
    return server.endpoint().split("://", 1)[-1]


def up(settings, runner) -> None:
    for server in (services.etcd(settings.state_dir), services.moto(settings.state_dir)):
        if server.info():
            runner.note(f"{server.name} already running at {server.endpoint()}")
            continue
        port = settings.etcd_port or None if server.name == "etcd" else None
        runner.step(f"start {server.name} (local stand-in) with state in {server.home}", server.start, port)
    runner.step(f"create shared volume folder {shared_volume(settings)}", shared_volume(settings).mkdir, parents=True, exist_ok=True)


def down(settings, runner) -> None:
    jobs = settings.state_dir / "jobs"
    for home in sorted(jobs.iterdir()) if jobs.exists() else []:
        runner.step(f"stop local job {home.name} (checkpoints kept)", stop_job, home)
    if (settings.state_dir / "docker").exists() or (settings.state_dir / "sagemaker").exists():
        from .containers import remove_all

        remove_all(settings, runner)  # containers of the docker target and SageMaker local mode
    for server in reversed(services.services(settings.state_dir)):
        if server.info() is None:
            continue
        runner.step(f"stop {server.name}", server.stop)


def rows(settings) -> list[list[str]]:
    result = []
    for server in services.services(settings.state_dir):
        info = server.info()
        result.append([server.name, "running" if info else "stopped", server.endpoint() or "", str(info["pid"]) if info else ""])
    return result


__all__ = ["up", "down", "rows", "etcd_endpoint", "shared_volume", "volumes_dir", "job_home"]
