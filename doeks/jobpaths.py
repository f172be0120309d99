"""Where a job's checkpoints and model go, built from the settings' job name in one place (the job's name may change
to a per-run name: issue 32). Plain values: paths inside the training processes (`mount` = SHARED_MOUNT) or s3://
URIs; `doeks.workload.checkpoints` reads and writes them."""
from __future__ import annotations


def job_name(settings) -> str:
    return settings.job_name


def _under(base: str, settings) -> str:
    return f"{base.rstrip('/')}/{job_name(settings)}"


def checkpoint_uri(settings, mount: str | None = None) -> str:
    """CHECKPOINT_URI/<job>, or the shared volume's checkpoints/<job> (as the training processes see it)."""
    if settings.checkpoint_uri:
        return _under(settings.checkpoint_uri, settings)
    return f"{mount or settings.shared_mount}/checkpoints/{job_name(settings)}"


def model_uri(settings, mount: str | None = None) -> str:
    """MODEL_URI/<job>, or the shared volume's models/<job>: the final model is model.pt there."""
    if settings.model_uri:
        return _under(settings.model_uri, settings)
    return f"{mount or settings.shared_mount}/models/{job_name(settings)}"


def in_s3(settings) -> list[str]:
    """The job's URIs that are in S3 (its checkpoints, its model)."""
    return [uri for uri in (checkpoint_uri(settings), model_uri(settings)) if uri.startswith("s3://")]


def s3_env(settings, endpoint: str | None) -> dict[str, str]:
    """What the training processes on this machine need to reach the S3 of CHECKPOINT_URI / MODEL_URI: the endpoint
    (doeks' moto server, or AWS_ENDPOINT_URL), the region, and moto's fixed test credentials, never a secret (with a
    real endpoint and no AWS_ENDPOINT_URL nothing is added: the processes use their own identity). Empty when nothing
    is in S3."""
    if not in_s3(settings) or not endpoint:
        return {}
    from .aws import LOCAL_CREDENTIALS

    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_REGION": settings.aws_region}
    if not settings.aws_endpoint_url:  # doeks' own moto: its test credentials
        env.update({"AWS_ACCESS_KEY_ID": LOCAL_CREDENTIALS["aws_access_key_id"],
                    "AWS_SECRET_ACCESS_KEY": LOCAL_CREDENTIALS["aws_secret_access_key"]})
    return env


def s3_buckets(settings) -> list[str]:
    return sorted({uri[len("s3://"):].split("/", 1)[0] for uri in in_s3(settings)})
