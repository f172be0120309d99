"""Errors typed by what the caller should do about them (as kopf's PermanentError / TemporaryError decide whether a
handler is retried: https://github.com/nolar/kopf, kopf/_core/actions/execution.py).

- `DoeksError`: permanent until the user changes something; its message is one line with the fix. Never retried.
- `Retryable`: transient (a server not up yet, a port busy, a throttled API): the same call may work later.
- `library_error(error)`: the boundary where a library's exception (botocore, kubernetes, kubectl's stderr) becomes
  one of these, with the fix in words; `doeks.taskkit.task` applies it to every task.
"""
from __future__ import annotations

import os
import re


class DoeksError(Exception):
    """A failure the user can fix; its message is one line saying what went wrong and what to do."""


class SettingsError(DoeksError):
    """A `.env` key holds a value doeks does not accept."""


class FlagError(DoeksError):
    """A task flag holds a value the task does not accept (the message names the flag)."""


class MissingTool(DoeksError):
    """A program or package doeks needs is not installed."""


class NoCredentials(DoeksError):
    """No usable AWS credentials: the message says where doeks (botocore) looked."""


class NotConnected(DoeksError):
    """No usable kubeconfig / cluster API: the fix is `invoke eks.connect`."""


class Retryable(DoeksError):
    """A transient failure (a server not up yet, a port busy): trying again later may work."""


CONNECT_FIX = "run `invoke eks.connect` (TARGET=eks) to write the cluster's kubeconfig"

# kubectl/helm stderr that means "no kubeconfig" or "no API server at the configured address" (client-go's
# defaults: with no kubeconfig it dials http://localhost:8080; kubernetes/client-go tools/clientcmd, v0.33)
_KUBE_UNREACHABLE = re.compile(
    r"localhost:8080|127\.0\.0\.1:8080|no configuration has been provided|Kubernetes cluster unreachable"
    r"|The connection to the server \S+ was refused|dial tcp \S+: connect: connection refused"
    r"|current-context is not set|context was not found|Unable to connect to the server|no such host")
# client-go's API discovery cache logs each failed attempt as `E1122 ... memcache.go:265] "Unhandled Error" ...`
KUBE_NOISE = re.compile(r"^[EWI]\d{4} [\d:.]+\s+\d+ \w+\.go:\d+\]")

# botocore's credential chain, in its order (botocore/credentials.py create_credential_resolver, botocore 1.43)
CREDENTIAL_SOURCES = ("AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (environment, or .env.local)",
                      "AWS_PROFILE in {credentials} or {config} (aws configure / aws sso login)",
                      "a container or Pod Identity endpoint (AWS_CONTAINER_CREDENTIALS_FULL_URI)",
                      "the EC2 instance role (IMDS{imds})")

_AUTH_CODES = {"ExpiredToken", "ExpiredTokenException", "InvalidClientTokenId", "UnrecognizedClientException",
               "AuthFailure", "InvalidAccessKeyId", "SignatureDoesNotMatch", "RequestExpired"}


def credential_sources() -> str:
    credentials = os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or "~/.aws/credentials"
    config = os.environ.get("AWS_CONFIG_FILE") or "~/.aws/config"
    imds = ", disabled by AWS_EC2_METADATA_DISABLED" if os.environ.get("AWS_EC2_METADATA_DISABLED", "").lower() == "true" else ""
    return "; ".join(s.format(credentials=credentials, config=config, imds=imds) for s in CREDENTIAL_SOURCES)


def no_credentials_message(detail: str = "no AWS credentials found") -> str:
    return f"{detail}: doeks reads them (botocore's chain, in order) from {credential_sources()}"


def is_credentials_error(error: BaseException) -> bool:
    """botocore could not sign (no or partial credentials) or AWS refused the credentials it had."""
    name = type(error).__name__
    if name in ("NoCredentialsError", "PartialCredentialsError", "NoAuthTokenError", "CredentialRetrievalError"):
        return True
    if isinstance(error, NoCredentials):
        return True
    response = getattr(error, "response", None)
    return isinstance(response, dict) and response.get("Error", {}).get("Code") in _AUTH_CODES


# An API server that answers but cannot reach an admission webhook's Service says so in the same words as an
# unreachable API server ("failed calling webhook ...: dial tcp 10.96.x.y:443: connect: connection refused"): that is
# the webhook's pod not serving yet (kubernetes apiserver/pkg/admission/plugin/webhook/errors), not a missing cluster.
_WEBHOOK = re.compile(r"failed call(ing|ed)? webhook|failed to call webhook")


def kube_unreachable(text: str) -> bool:
    return any(_KUBE_UNREACHABLE.search(line) and not _WEBHOOK.search(line) for line in (text or "").splitlines())


def library_error(error: BaseException) -> DoeksError | None:
    """The typed, one-line form of a library's exception, with the fix; None when doeks has no better words."""
    name = type(error).__name__
    module = type(error).__module__.split(".")[0]
    text = str(error)
    if is_credentials_error(error):
        code = (getattr(error, "response", None) or {}).get("Error", {}).get("Code")
        detail = f"AWS refused the credentials ({code})" if code else f"no AWS credentials found ({name})"
        return NoCredentials(no_credentials_message(detail))
    if name == "ProfileNotFound":
        return NoCredentials(f"{text}: set AWS_PROFILE to a profile in "
                             f"{os.environ.get('AWS_CONFIG_FILE') or '~/.aws/config'} (or leave it empty)")
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError"):
        return Retryable(f"AWS API not reachable ({name}: {text.splitlines()[0] if text else ''}): "
                         "check the network / AWS_ENDPOINT_URL and try again")
    if module == "kubernetes" and name == "ConfigException":
        return NotConnected(f"no Kubernetes cluster configured ({text.splitlines()[0] if text else name}): {CONNECT_FIX}")
    if module in ("urllib3", "kubernetes") and ("Max retries exceeded" in text or "Connection refused" in text
                                                or kube_unreachable(text)):
        return NotConnected(f"Kubernetes API not reachable ({name}): {CONNECT_FIX}")
    return None
