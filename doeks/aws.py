"""boto3 sessions and clients that honour AWS_REGION, AWS_PROFILE and AWS_ENDPOINT_URL.

On TARGET=local with no AWS_ENDPOINT_URL, clients talk to the toolkit's own moto server (started on demand as its
own process), so every boto3 path runs over real HTTP without an AWS account.
"""
from __future__ import annotations

from typing import Any

from .errors import DoeksError

LOCAL_CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}


def endpoint_url(settings, start: bool = True) -> str | None:
    """The AWS-API endpoint to use: AWS_ENDPOINT_URL, else the local moto server on TARGET=local, else real AWS."""
    if settings.aws_endpoint_url:
        return settings.aws_endpoint_url
    if not settings.on_this_machine:
        return None
    from .services import moto

    service = moto(settings.state_dir)
    if service.endpoint() is None:
        if not start:
            return None
        service.start()
    return service.endpoint()


def credentials_configured(settings) -> bool:
    """Credentials doeks can see without probing the network (the instance metadata service is not asked)."""
    import os
    from pathlib import Path

    env = os.environ
    if settings.aws_endpoint_url or settings.aws_profile or settings.aws_access_key_id:
        return True
    if any(env.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
                                "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")):
        return True
    files = (Path(env.get("AWS_SHARED_CREDENTIALS_FILE", Path.home() / ".aws" / "credentials")),
             Path(env.get("AWS_CONFIG_FILE", Path.home() / ".aws" / "config")))
    return any(_has_text(path) for path in files)  # an empty file holds no credentials


def _has_text(path) -> bool:
    try:
        return path.is_file() and bool(path.read_text(errors="replace").strip())
    except OSError:
        return False


def credentials_of(settings) -> dict[str, str | None]:
    """The resolved credentials of `session(settings)` as client keyword arguments (the stager's own clients take
    them); the local stand-in's when none are configured."""
    creds = session(settings).get_credentials()
    if creds is None:
        return dict(LOCAL_CREDENTIALS)
    frozen = creds.get_frozen_credentials()
    return {"aws_access_key_id": frozen.access_key, "aws_secret_access_key": frozen.secret_key,
            "aws_session_token": frozen.token}


def session(settings):
    import boto3

    kwargs: dict[str, Any] = {"region_name": settings.aws_region}
    if settings.aws_profile:
        kwargs["profile_name"] = settings.aws_profile
    if settings.aws_access_key_id and settings.aws_secret_access_key:
        kwargs.update(aws_access_key_id=settings.aws_access_key_id,
                      aws_secret_access_key=settings.aws_secret_access_key,
                      aws_session_token=settings.aws_session_token or None)
    elif endpoint_url(settings, start=False) and not settings.aws_profile:
        kwargs.update(LOCAL_CREDENTIALS)
    try:
        return boto3.Session(**kwargs)
    except Exception as error:  # botocore.exceptions.ProfileNotFound and friends
        raise DoeksError(f"AWS_PROFILE={settings.aws_profile!r}: {error}") from None


def client(settings, service: str):
    url = endpoint_url(settings)
    sess = session(settings)
    if url and sess.get_credentials() is None:
        import boto3

        sess = boto3.Session(region_name=settings.aws_region, **LOCAL_CREDENTIALS)
    return sess.client(service, endpoint_url=url)


def account_id(settings) -> str:
    return client(settings, "sts").get_caller_identity()["Account"]


def lookup(runner, what: str, read, unknown=None):
    """`read()` (an AWS lookup a plan depends on); in a dry run without usable credentials the plan goes on:
    the runner says `unknown: WHAT <unknown: no credentials>` once and `unknown` stands in for the answer."""
    from .errors import is_credentials_error

    try:
        return read()
    except Exception as error:  # noqa: BLE001 - only credential errors in a dry run are turned into unknowns
        if runner is None or not runner.dry_run or not is_credentials_error(error):
            raise
        runner.unknown(what)
        return unknown


def describe_cluster(settings, runner=None) -> dict[str, Any] | None:
    """The EKS cluster as EKS reports it, or None when there is no such cluster (or, in a dry run without
    credentials, when it cannot be known: the runner says so). Here, below eks/storage/identity, so they need not
    import each other for it."""
    eks = client(settings, "eks")

    def read():
        try:
            return eks.describe_cluster(name=settings.cluster_name)["cluster"]
        except eks.exceptions.ResourceNotFoundException:
            return None

    return lookup(runner, f"cluster {settings.cluster_name} in {settings.aws_region}", read)
