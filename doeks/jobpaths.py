"""Where a job's checkpoints and model go, built from the settings' job name in one place (the job's name may change
to a per-run name: issue 32). Plain values: paths inside the training processes (`mount` = SHARED_MOUNT) or s3://
URIs; `doeks.workload.checkpoints` reads and writes them."""
from __future__ import annotations


def job_name(settings) -> str:
    return settings.job_name


def _under(base: str, settings) -> str:
    return f"{base.rstrip('/')}/{job_name(settings)}"


JOB_FOLDERS = ("checkpoints", "metrics", "models", "output")


def job_folder(settings, kind: str, mount: str | None = None) -> str:
    """The job's folder of `kind` (checkpoints, metrics, models, output) on the shared volume: `<mount>/<kind>/<job>`,
    each job under its own name (issue 32: the name comes from its code), so a job never reads another's state.
    `mount` is where the volume is seen: SHARED_MOUNT in the pods (the default), its folder on this machine, a
    `pvc://` URI. Checkpoints and the model may live elsewhere: checkpoint_uri, model_uri."""
    if kind not in JOB_FOLDERS:
        raise ValueError(f"job_folder: {kind!r} is not one of {', '.join(JOB_FOLDERS)}")
    return f"{str(mount or settings.shared_mount).rstrip('/')}/{kind}/{job_name(settings)}"


def checkpoint_uri(settings, mount: str | None = None) -> str:
    """CHECKPOINT_URI/<job>, or the shared volume's checkpoints/<job> (as the training processes see it)."""
    if settings.checkpoint_uri:
        return _under(settings.checkpoint_uri, settings)
    return job_folder(settings, "checkpoints", mount)


def model_uri(settings, mount: str | None = None) -> str:
    """MODEL_URI/<job>, or the shared volume's models/<job>: the final model is model.pt there."""
    if settings.model_uri:
        return _under(settings.model_uri, settings)
    return job_folder(settings, "models", mount)


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


def _bucket_key(uri: str) -> tuple[str, str]:
    bucket, _, key = uri[len("s3://"):].partition("/")
    return bucket, key.strip("/")


def job_s3_policy(settings) -> dict | None:
    """The IAM policy of the training job's own role (EKS Pod Identity for its pods): exactly the S3 actions its
    checkpoints and model need (doeks/workload/checkpoints.py: list the job's prefix, read, write, copy and delete its
    objects, abort its multipart uploads), on the job's prefixes only. None when nothing of the job is in S3."""
    uris = in_s3(settings)
    if not uris:
        return None
    statements = []
    for bucket in sorted({_bucket_key(u)[0] for u in uris}):
        prefixes = sorted({_bucket_key(u)[1] for u in uris if _bucket_key(u)[0] == bucket})
        statements.append({"Effect": "Allow", "Action": "s3:ListBucket", "Resource": f"arn:aws:s3:::{bucket}",
                           "Condition": {"StringLike": {"s3:prefix": [p for prefix in prefixes for p in (prefix, f"{prefix}/*")]}}})
        statements.append({"Effect": "Allow",
                           "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
                           "Resource": [f"arn:aws:s3:::{bucket}/{prefix}/*" for prefix in prefixes]})
    return {"Version": "2012-10-17", "Statement": statements}


JOB_S3_CALLS = ("s3:ListBucket", "s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload")
# doeks/workload/checkpoints.py through s3fs and DCP's writer/reader: ListObjectsV2 (names, complete), HeadObject and
# GetObject (exists, latest, reads), PutObject and the multipart upload calls (data, .metadata, latest, model.pt),
# CopyObject (DCP renames .metadata.tmp: GetObject on the source, PutObject on the target), DeleteObject(s) (prune,
# clear_after, the probe), AbortMultipartUpload (a failed upload).


def pod_env(settings) -> dict[str, str]:
    """What the training pods need, besides the contract, to reach the job's S3 on a cluster: the region (their
    credentials come from the job's role through Pod Identity; no endpoint, no keys)."""
    return {"AWS_REGION": settings.aws_region} if in_s3(settings) else {}
