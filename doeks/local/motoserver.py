"""doeks' moto server: moto with the EKS operations moto 5.2 lacks (Pod Identity associations, add-ons) and EKS
Auth's AssumeRoleForPodIdentity (what the EKS Pod Identity Agent calls to get a pod its role's credentials).

Run as `python -m doeks.local.motoserver -H HOST -p PORT` (same flags as `python -m moto.server`), a process of its
own (doeks.services.moto_eks): importing this module changes moto's EKS responses. Requests are parsed and
responses serialized by moto against botocore's service models (so a wrong parameter or a wrong response shape fails
as it would against AWS); the state is kept in this server process, so several `invoke` processes see it. Deleting a
cluster deletes its associations and add-ons (as EKS does).

IAM: moto checks each request against the caller's IAM policies once enforcement is on (`/moto-api/reset-auth`, as
INITIAL_NO_AUTH_ACTION_COUNT): the action (`service:Action`) always, the resource for S3, IAM, STS and SQS only (other
services are checked against `*`). AssumeRoleForPodIdentity answers with credentials of the role the cluster's
association names for the token's namespace/service account, made as moto's STS makes them for AssumeRole, so every
call made with them is checked against that role's policies. A token not signed by the cluster's service-account key
(DOEKS_SA_PUBLIC_KEY, when set), for another audience, or expired is refused, as EKS Auth refuses it.
"""
from __future__ import annotations

import base64
import json
import os
import re
import sys
import time
import uuid
from datetime import datetime, timezone

# AWS managed policies (AmazonEBSCSIDriverPolicy, ...) exist in IAM, as in an account, so attaching them works; only
# those doeks names are loaded (all ~1,300 cost ~2 s per server start)
os.environ.setdefault("MOTO_IAM_LOAD_MANAGED_POLICIES", "true")

from moto.core.responses import ActionResult, EmptyResult  # noqa: E402,F401
from moto.eks import urls  # noqa: E402
from moto.eks.exceptions import InvalidParameterException, ResourceInUseException, ResourceNotFoundException  # noqa: E402
from moto.eks.responses import EKSResponse  # noqa: E402

ACCOUNT = "123456789012"
ASSOCIATIONS: dict[str, dict] = {}  # associationId -> association
ADDONS: dict[tuple[str, str], dict] = {}  # (cluster, addon) -> addon
POD_IDENTITY_AUDIENCE = "pods.eks.amazonaws.com"


def _only_policies_doeks_names():
    from pathlib import Path

    import moto.iam.models as iam_models

    root = Path(__file__).resolve().parents[2]
    text = "".join(p.read_text() for folder in ("doeks", "kubeflow", "csi", "eks", "gpu-metrics") for p in (root / folder).rglob("*.py"))
    names = set(re.findall(r"arn:aws:iam::aws:policy/(?:[\w-]+/)*([\w-]+)", text))
    everything = json.loads(iam_models.aws_managed_policies_data)
    iam_models.aws_managed_policies_data = json.dumps({k: v for k, v in everything.items() if k in names})


PREFIX = "{0}/clusters/(?P<name>[^/]+)"
urls.url_paths.update({
    PREFIX + "/pod-identity-associations$": EKSResponse.dispatch,
    PREFIX + "/pod-identity-associations/(?P<associationId>[^/]+)$": EKSResponse.dispatch,
    PREFIX + "/addons$": EKSResponse.dispatch,
    PREFIX + "/addons/(?P<addonName>[^/]+)$": EKSResponse.dispatch,
})


def _cluster(self, name):
    if name not in self.eks_backend.clusters:
        raise ResourceNotFoundException(clusterName=name, message=f"No cluster found for name: {name}.")


def _now():
    return datetime.now(timezone.utc)


def _associate(region, cluster, namespace, service_account, role):
    if any(a["clusterName"] == cluster and a["namespace"] == namespace and a["serviceAccount"] == service_account
           for a in ASSOCIATIONS.values()):
        raise ResourceInUseException(clusterName=cluster, message=f"association for {namespace}/{service_account} exists")
    if not role.startswith("arn:aws:iam::"):
        raise InvalidParameterException(clusterName=cluster, message=f"roleArn {role} is not a role ARN")
    ident = "a-" + uuid.uuid4().hex[:17]
    ASSOCIATIONS[ident] = {"clusterName": cluster, "namespace": namespace, "serviceAccount": service_account, "roleArn": role,
                           "associationArn": f"arn:aws:eks:{region}:{ACCOUNT}:podidentityassociation/{cluster}/{ident}",
                           "associationId": ident, "tags": {}, "createdAt": _now(), "modifiedAt": _now()}
    return ASSOCIATIONS[ident]


def create_pod_identity_association(self):
    name = self._get_param("name")
    _cluster(self, name)
    return ActionResult({"association": _associate(self.region, name, self._get_param("namespace"),
                                                   self._get_param("serviceAccount"), self._get_param("roleArn"))})


def list_pod_identity_associations(self):
    name = self._get_param("name")
    _cluster(self, name)
    ns, sa = self._get_param("namespace"), self._get_param("serviceAccount")
    found = [{k: a[k] for k in ("clusterName", "namespace", "serviceAccount", "associationArn", "associationId")}
             for a in ASSOCIATIONS.values() if a["clusterName"] == name and ns in (None, a["namespace"])
             and sa in (None, a["serviceAccount"])]
    return ActionResult({"associations": found})


def _association(self):
    ident = self._get_param("associationId")
    if ident not in ASSOCIATIONS or ASSOCIATIONS[ident]["clusterName"] != self._get_param("name"):
        raise ResourceNotFoundException(associationId=ident, message=f"association {ident} not found")
    return ident


def describe_pod_identity_association(self):
    return ActionResult({"association": ASSOCIATIONS[_association(self)]})


def delete_pod_identity_association(self):
    return ActionResult({"association": ASSOCIATIONS.pop(_association(self))})


def create_addon(self):
    name, addon = self._get_param("name"), self._get_param("addonName")
    _cluster(self, name)
    if (name, addon) in ADDONS:
        raise ResourceInUseException(clusterName=name, addonName=addon, message=f"add-on {addon} exists")
    arns = [_associate(self.region, name, "kube-system" if addon != "amazon-cloudwatch-observability" else "amazon-cloudwatch",
                       p["serviceAccount"], p["roleArn"])["associationArn"]
            for p in self._get_param("podIdentityAssociations") or []]
    if addon == "amazon-cloudwatch-observability":
        _container_insights_log_groups(self.region, name)
    ADDONS[(name, addon)] = {"addonName": addon, "clusterName": name, "status": "ACTIVE",
                             "addonVersion": self._get_param("addonVersion") or "v1.0.0-eksbuild.1", "health": {"issues": []},
                             "addonArn": f"arn:aws:eks:{self.region}:{ACCOUNT}:addon/{name}/{addon}/x",
                             "createdAt": _now(), "modifiedAt": _now(), "podIdentityAssociations": arns}
    return ActionResult({"addon": ADDONS[(name, addon)]})


# What the CloudWatch observability add-on's agent and Fluent Bit create once they run (Container Insights; AWS docs
# "Container Insights log groups": application, dataplane, host, performance), kept after the add-on is deleted.
CONTAINER_INSIGHTS_GROUPS = ("application", "dataplane", "host", "performance")


def _container_insights_log_groups(region, cluster):
    from moto.logs.models import logs_backends

    logs = logs_backends[ACCOUNT][region]
    for part in CONTAINER_INSIGHTS_GROUPS:
        name = f"/aws/containerinsights/{cluster}/{part}"
        if name not in logs.groups:
            logs.create_log_group(name, tags={})


def _addon(self):
    key = (self._get_param("name"), self._get_param("addonName"))
    if key not in ADDONS:
        raise ResourceNotFoundException(clusterName=key[0], addonName=key[1], message=f"No addon: {key[1]} found in cluster: {key[0]}")
    return key


def describe_addon(self):
    return ActionResult({"addon": ADDONS[_addon(self)]})


def delete_addon(self):
    addon = ADDONS.pop(_addon(self))
    if not self._get_param("preserve"):
        for ident in [i for i, a in ASSOCIATIONS.items() if a["associationArn"] in addon["podIdentityAssociations"]]:
            ASSOCIATIONS.pop(ident)
    return ActionResult({"addon": {**addon, "status": "DELETING"}})


def list_addons(self):
    name = self._get_param("name")
    _cluster(self, name)
    return ActionResult({"addons": sorted(a for c, a in ADDONS if c == name)})


_delete_cluster = EKSResponse.delete_cluster


def delete_cluster(self):
    name = self._get_param("name")
    for ident in [i for i, a in ASSOCIATIONS.items() if a["clusterName"] == name]:
        ASSOCIATIONS.pop(ident)
    for key in [k for k in ADDONS if k[0] == name]:
        ADDONS.pop(key)
    return _delete_cluster(self)


def describe_cluster_versions(self):
    """EKS's DescribeClusterVersions from doeks' calendar (doeks.catalog.EKS_SUPPORT), as eksctl and doeks ask it."""
    import datetime as dt

    from doeks import catalog

    today = dt.date.today()
    found = []
    newest = catalog.newest_standard(today)
    for version, (standard, extended) in sorted(catalog.EKS_SUPPORT.items(), key=lambda kv: catalog.version_key(kv[0])):
        phase = catalog.support_phase(version, today)
        if phase == "ended":
            continue
        status = "STANDARD_SUPPORT" if phase == "standard" else "EXTENDED_SUPPORT"
        found.append({"clusterVersion": version, "clusterType": "eks", "defaultPlatformVersion": "eks.1",
                      "defaultVersion": version == newest, "status": status, "versionStatus": status,
                      "endOfStandardSupportDate": dt.datetime.fromisoformat(standard).replace(tzinfo=timezone.utc),
                      "endOfExtendedSupportDate": dt.datetime.fromisoformat(extended).replace(tzinfo=timezone.utc),
                      "kubernetesPatchVersion": f"{version}.0"})
    wanted = self._get_param("clusterVersions") or self.querystring.get("clusterVersions")
    if wanted:
        found = [v for v in found if v["clusterVersion"] in wanted]
    if self._get_param("defaultOnly") in (True, "true"):
        found = [v for v in found if v["defaultVersion"]]
    return ActionResult({"clusterVersions": found})


urls.url_paths.update({"{0}/cluster-versions$": EKSResponse.dispatch})

for _fn in (describe_cluster_versions, create_pod_identity_association, list_pod_identity_associations, describe_pod_identity_association,
            delete_pod_identity_association, create_addon, describe_addon, delete_addon, list_addons, delete_cluster):
    setattr(EKSResponse, _fn.__name__, _fn)


# -- EKS Auth: AssumeRoleForPodIdentity --------------------------------------------------------------------------------
# botocore's eks-auth model: POST /clusters/{clusterName}/assume-role-for-pod-identity, signed for service `eks-auth`
# (the Pod Identity Agent signs with the node role; its policy AmazonEKSWorkerNodePolicy allows
# eks-auth:AssumeRoleForPodIdentity). moto has no eks-auth service: this WSGI layer answers it in front of moto.
_PATH = re.compile(r"^/clusters/(?P<cluster>[^/]+)/assume-role-for-pod-identity$")


def _b64(part: str) -> bytes:
    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


class TokenError(Exception):
    pass


def token_subject(token: str, key_path: str | None, now: float | None = None) -> tuple[str, str]:
    """(namespace, service account) of a projected service-account token for the Pod Identity audience, its RS256 or
    ES256 signature checked against the cluster's service-account public key when `key_path` is given."""
    try:
        head, payload, signature = token.split(".")
        claims = json.loads(_b64(payload))
        header = json.loads(_b64(head))
    except (ValueError, AttributeError):
        raise TokenError("the token is not a JWT") from None
    if key_path and not os.path.exists(key_path):
        raise TokenError(f"the cluster's service-account key {key_path} is not there: is the cluster up?")
    if key_path:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa, utils

        key = serialization.load_pem_public_key(open(key_path, "rb").read())
        signed, raw = f"{head}.{payload}".encode(), _b64(signature)
        try:
            if header.get("alg") == "RS256" and isinstance(key, rsa.RSAPublicKey):
                key.verify(raw, signed, padding.PKCS1v15(), hashes.SHA256())
            elif header.get("alg") == "ES256" and isinstance(key, ec.EllipticCurvePublicKey) and len(raw) == 64:
                der = utils.encode_dss_signature(int.from_bytes(raw[:32], "big"), int.from_bytes(raw[32:], "big"))
                key.verify(der, signed, ec.ECDSA(hashes.SHA256()))
            else:
                raise TokenError(f"token algorithm {header.get('alg')} does not match the cluster's key")
        except InvalidSignature:
            raise TokenError("the token's signature is not the cluster's") from None
    audience = claims.get("aud")
    if POD_IDENTITY_AUDIENCE not in ([audience] if isinstance(audience, str) else audience or []):
        raise TokenError(f"the token's audience is {audience}, not {POD_IDENTITY_AUDIENCE}")
    if claims.get("exp", 0) < (now or time.time()):
        raise TokenError("the token has expired")
    k8s = claims.get("kubernetes.io") or {}
    namespace, account = k8s.get("namespace"), (k8s.get("serviceaccount") or {}).get("name")
    if not namespace or not account:
        raise TokenError("the token names no service account")
    return namespace, account


def _error(start_response, status: str, kind: str, message: str):
    body = json.dumps({"message": message}).encode()
    start_response(status, [("Content-Type", "application/json"), ("x-amzn-ErrorType", kind),
                            ("Content-Length", str(len(body)))])
    return [body]


class PodIdentity:
    """WSGI: EKS Auth's AssumeRoleForPodIdentity in front of moto's application; everything else goes to moto."""

    def __init__(self, app):
        self.app = app

    def __call__(self, environ, start_response):
        found = _PATH.match(environ.get("PATH_INFO", ""))
        if not (found and environ.get("REQUEST_METHOD") == "POST"
                and "/eks-auth/aws4_request" in environ.get("HTTP_AUTHORIZATION", "")):
            return self.app(environ, start_response)
        length = int(environ.get("CONTENT_LENGTH") or 0)
        body = environ["wsgi.input"].read(length) if length else b""
        try:
            denied = self._caller_denied(environ, body)
        except Exception as error:  # noqa: BLE001 - moto's own signature and policy errors
            return _error(start_response, "403 Forbidden", "AccessDeniedException", str(error) or type(error).__name__)
        if denied:
            return _error(start_response, "403 Forbidden", "AccessDeniedException", denied)
        cluster = found.group("cluster")
        try:
            namespace, account = token_subject(json.loads(body or b"{}").get("token", ""),
                                               os.environ.get("DOEKS_SA_PUBLIC_KEY") or None)
        except TokenError as error:
            return _error(start_response, "400 Bad Request", "InvalidTokenException", str(error))
        match = [a for a in ASSOCIATIONS.values() if a["clusterName"] == cluster and a["namespace"] == namespace
                 and a["serviceAccount"] == account]
        if not match:
            return _error(start_response, "404 Not Found", "ResourceNotFoundException",
                          f"no pod identity association for {namespace}/{account} in cluster {cluster}")
        association = match[0]
        from moto.sts.models import sts_backends

        region = re.search(r"/\d{8}/([a-z0-9-]+)/eks-auth/", environ["HTTP_AUTHORIZATION"])
        session = f"eks-{cluster}-{account}-{uuid.uuid4().hex[:8]}"[:64]
        assumed = sts_backends[ACCOUNT]["aws"].assume_role(
            region_name=region.group(1) if region else "us-east-1", role_session_name=session,
            role_arn=association["roleArn"], policy=None, duration=3600, external_id=None)
        answer = {"subject": {"namespace": namespace, "serviceAccount": account}, "audience": POD_IDENTITY_AUDIENCE,
                  "podIdentityAssociation": {"associationArn": association["associationArn"],
                                             "associationId": association["associationId"]},
                  "assumedRoleUser": {"arn": assumed.arn, "assumeRoleId": f"{assumed.access_key_id}:{session}"},
                  "credentials": {"sessionToken": assumed.session_token, "secretAccessKey": assumed.secret_access_key,
                                  "accessKeyId": assumed.access_key_id, "expiration": time.time() + 3600}}
        data = json.dumps(answer).encode()
        start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
        return [data]

    @staticmethod
    def _caller_denied(environ, body: bytes) -> str:
        """With enforcement on, the caller (the Pod Identity Agent's role or user) must be allowed
        eks-auth:AssumeRoleForPodIdentity, its signature checked, as moto checks every other request."""
        from moto import settings
        from moto.core.authorization import ActionAuthenticatorMixin
        from moto.iam.access_control import IAMRequest

        if ActionAuthenticatorMixin.request_count < settings.INITIAL_NO_AUTH_ACTION_COUNT:
            ActionAuthenticatorMixin.request_count += 1
            return ""
        headers = {key[5:].replace("_", "-").title(): value for key, value in environ.items() if key.startswith("HTTP_")}
        for key in ("CONTENT_TYPE", "CONTENT_LENGTH"):
            if environ.get(key):
                headers[key.replace("_", "-").title()] = environ[key]
        request = IAMRequest(account_id=ACCOUNT, method="POST", path=environ["PATH_INFO"], data={}, body=body,
                             headers=headers, action="AssumeRoleForPodIdentity")
        request._action = "eks-auth:AssumeRoleForPodIdentity"
        request.check_signature()
        request.check_action_permitted("*")
        return ""


def _patch_iam_checks() -> None:
    """Two corrections to moto's IAM enforcement, so that what AWS allows is allowed here too:
    - a GET (or HEAD, DELETE) with query parameters and no body (EKS's ListPodIdentityAssociations?namespace=...)
      was checked as if its parameters were a form body, so the signature never matched: the empty payload, as
      signed; and a query value with `/` (ListObjectsV2's prefix=data/...) arrives decoded by the server while the
      client signed it percent-encoded: the query is encoded again as botocore encodes it (safe `-_.~`);
    - a policy Condition was evaluated with no request values and StringEquals only (moto ignores other
      operators, and a key without a value passes), so a conditioned Allow allowed everything: for S3 requests the
      request's s3:prefix (ListObjects' prefix) is supplied, the key doeks' stage policy conditions ListBucket on,
      and StringEquals/StringLike/StringNotEquals/StringNotLike are evaluated as IAM does (a key the request lacks
      fails the condition; any other operator denies: stricter than AWS). Other services keep moto's evaluation."""
    from urllib.parse import parse_qs, urlparse

    from moto.iam import access_control

    create = access_control.IAMRequestBase._create_aws_request

    def aws_request(self):
        from urllib.parse import quote, unquote

        path, _, query = self._path.partition("?")
        if query:
            pairs = [pair.partition("=") for pair in query.split("&")]
            self._path = path + "?" + "&".join(f"{quote(unquote(k), safe='-_.~')}{eq}{quote(unquote(v), safe='-_.~')}"
                                               for k, eq, v in pairs)
        if not self._body and self._method in ("GET", "HEAD", "DELETE") and not isinstance(self, access_control.S3IAMRequest):
            saved, self._data = self._data, None
            try:
                return create(self)
            finally:
                self._data = saved
        return create(self)

    access_control.IAMRequestBase._create_aws_request = aws_request
    permitted = access_control.IAMPolicy.is_action_permitted

    def with_request_values(self, action, resource="*", principal=None, incoming_condition_values=None):
        values = getattr(access_control, "_doeks_request_values", None)
        return permitted(self, action, resource, principal, incoming_condition_values or values)

    access_control.IAMPolicy.is_action_permitted = with_request_values
    conditions = access_control.IAMPolicyStatement._check_conditions

    def check_conditions(self, incoming_condition_values):
        values = getattr(access_control, "_doeks_request_values", None)
        if values is None:
            return conditions(self, incoming_condition_values)
        from fnmatch import fnmatchcase

        def like(pattern: str, value: str) -> bool:
            return fnmatchcase(value, pattern.replace("[", "[[]"))

        operators = {"StringEquals": lambda e, v: e == v, "StringLike": like,
                     "StringNotEquals": lambda e, v: e != v, "StringNotLike": lambda e, v: not like(e, v)}
        for operator, keys in (self._statement.get("Condition") or {}).items():
            test = operators.get(operator)
            if test is None:
                return False
            for key, expected in keys.items():
                value = values.get(key)
                expected = [expected] if isinstance(expected, str) else expected
                if value is None or not (any if not operator.startswith("StringNot") else all)(test(e, value) for e in expected):
                    return False
        return True

    access_control.IAMPolicyStatement._check_conditions = check_conditions
    statement = access_control.IAMPolicyStatement.is_action_permitted

    def allow_or_neutral(self, *args, **kwargs):
        """An Allow whose condition (or principal) does not match does not apply (IAM's evaluation logic); moto
        answered DENIED, an explicit deny that overrode every other Allow."""
        result = statement(self, *args, **kwargs)
        if result == access_control.PermissionResult.DENIED and self._statement.get("Effect") == "Allow":
            return access_control.PermissionResult.NEUTRAL
        return result

    access_control.IAMPolicyStatement.is_action_permitted = allow_or_neutral
    check = access_control.S3IAMRequest.check_action_permitted

    def s3_check(self, resource):
        query = parse_qs(urlparse(self._path).query)
        values = {"s3:prefix": query["prefix"][0]} if "prefix" in query else {}
        access_control._doeks_request_values = values
        try:
            return check(self, resource)
        finally:
            access_control._doeks_request_values = None

    access_control.S3IAMRequest.check_action_permitted = s3_check


def main(argv: list[str]) -> None:
    """moto.server's main, with doeks' additions: the same flags."""
    import argparse
    import signal

    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import run_simple

    parser = argparse.ArgumentParser()
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, default=5000)
    args = parser.parse_args(argv)
    os.environ.setdefault("MOTO_PORT", str(args.port))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    _only_policies_doeks_names()
    _patch_iam_checks()
    app = DomainDispatcherApplication(create_backend_app)
    run_simple(args.host, args.port, PodIdentity(app), threaded=True)


if __name__ == "__main__":
    main(sys.argv[1:])
