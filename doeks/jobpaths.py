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


STORE_PREFIX = "doeks"  # the S3 prefix of S3_BUCKET under which a target that keeps the job's outputs in S3 puts them
TRAIN_SERVICE_ACCOUNT = "doeks-train"  # the training pods' service account where they have an AWS identity of their own


def s3_store(settings) -> dict[str, str]:
    """CHECKPOINT_URI and MODEL_URI in S3_BUCKET, under doeks' prefix (each job under its name below them): where a
    target whose shared volume does not outlive `down` (eks) keeps them when the user names nothing."""
    base = f"s3://{settings.s3_bucket}/{STORE_PREFIX}"
    return {"CHECKPOINT_URI": f"{base}/checkpoints", "MODEL_URI": f"{base}/models"}


def saved_uri(settings) -> str:
    """Where `csi.data.save-model` copies a job's model and checkpoints from a cluster's claim, one dated prefix per
    copy below it: s3://S3_BUCKET/doeks/saved/<JOB_NAME>."""
    return f"s3://{settings.s3_bucket}/{STORE_PREFIX}/saved/{job_name(settings)}"


def s3_buckets(settings) -> list[str]:
    return sorted({uri[len("s3://"):].split("/", 1)[0] for uri in in_s3(settings)})


def _bucket_key(uri: str) -> tuple[str, str]:
    bucket, _, key = uri[len("s3://"):].partition("/")
    return bucket, key.strip("/")


def _bases_in_s3(settings) -> list[str]:
    """CHECKPOINT_URI and MODEL_URI where they are in S3 (the bases every job's own prefix is under)."""
    return [uri for uri in (settings.checkpoint_uri, settings.model_uri) if uri.startswith("s3://")]


def job_s3_policy(settings) -> dict | None:
    """The IAM policy of the training jobs' own role (EKS Pod Identity for their pods, doeks.identity's `train` row):
    exactly the S3 actions checkpoints and models need (doeks/workload/checkpoints.py: list the prefix, read, write,
    copy and delete its objects, abort its multipart uploads), on CHECKPOINT_URI's and MODEL_URI's prefixes only,
    where each job writes under its own name. The prefixes, not one job's: the cluster's jobs share the role (their
    pods run as one service account per namespace), and a policy naming one job would be replaced by the next job's
    deploy while the first still saves. None when nothing is in S3."""
    uris = _bases_in_s3(settings)
    if not uris:
        return None
    statements = []
    for bucket in sorted({_bucket_key(u)[0] for u in uris}):
        prefixes = sorted({_bucket_key(u)[1] for u in uris if _bucket_key(u)[0] == bucket})
        if "" in prefixes:  # a whole bucket named (s3://bucket): its every key
            listing = {"Effect": "Allow", "Action": "s3:ListBucket", "Resource": f"arn:aws:s3:::{bucket}"}
            objects = [f"arn:aws:s3:::{bucket}/*"]
        else:
            listing = {"Effect": "Allow", "Action": "s3:ListBucket", "Resource": f"arn:aws:s3:::{bucket}",
                       "Condition": {"StringLike": {"s3:prefix": [p for prefix in prefixes for p in (prefix, f"{prefix}/*")]}}}
            objects = [f"arn:aws:s3:::{bucket}/{prefix}/*" for prefix in prefixes]
        statements.append(listing)
        statements.append({"Effect": "Allow",
                           "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
                           "Resource": objects})
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
