"""The containers doeks runs with docker on this machine (the docker target, SageMaker local mode): their labels,
and their removal by `down`. Below the targets, so the local runtime can clean up without importing one."""
from __future__ import annotations

from ..errors import DoeksError

PART_OF = "app.kubernetes.io/part-of"
JOB, RUN, REPLICA, TARGET, STATE = "doeks/job", "doeks/run", "doeks/replica", "doeks/target", "doeks/state"


def client():
    from ..container import _client

    return _client()


def state_label(settings) -> str:
    """Which checkout's STATE_DIR a container belongs to (two checkouts may share one docker daemon)."""
    import hashlib

    return hashlib.sha256(str(settings.state_dir.resolve()).encode()).hexdigest()[:12]


def remove_all(settings, runner) -> int:
    """Every container doeks labelled for any job (used by `down`)."""
    try:
        found = [c for c in client().containers.list(all=True, filters={"label": [f"{PART_OF}=doeks",
                                                                                    f"{STATE}={state_label(settings)}"]})
                 if c.labels.get(TARGET) in ("docker", "sagemaker-local")]
    except DoeksError:
        return 0
    for c in found:
        runner.step(f"docker rm -f {c.name}", c.remove, force=True)
    return len(found)
