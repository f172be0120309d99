"""The moto server with the EKS operations moto 5.2 lacks: Pod Identity associations and add-ons.

Run as `python -m tests.moto_eks -H HOST -p PORT` (same flags as `python -m moto.server`). Requests are parsed and
responses serialized by moto against botocore's EKS service model (so a wrong parameter or a wrong response shape
fails as it would against AWS); the state is kept in this server process, so several `invoke` processes see it.
Deleting a cluster deletes its associations and add-ons (as EKS does).
"""
from __future__ import annotations

import os
import sys
import uuid
from datetime import datetime, timezone

# AWS managed policies (AmazonEBSCSIDriverPolicy, ...) exist in IAM, as in an account, so attaching them works; only
# those doeks names are loaded (all ~1,300 cost ~2 s per server start)
os.environ.setdefault("MOTO_IAM_LOAD_MANAGED_POLICIES", "true")


def _only_policies_doeks_names():
    import json
    import re
    from pathlib import Path

    import moto.iam.models as iam_models

    root = Path(__file__).resolve().parent.parent
    text = "".join(p.read_text() for folder in ("doeks", "kubeflow", "csi", "eks", "gpu-metrics") for p in (root / folder).rglob("*.py"))
    names = set(re.findall(r"arn:aws:iam::aws:policy/(?:[\w-]+/)*([\w-]+)", text))
    everything = json.loads(iam_models.aws_managed_policies_data)
    iam_models.aws_managed_policies_data = json.dumps({k: v for k, v in everything.items() if k in names})

from moto.core.responses import ActionResult, EmptyResult  # noqa: F401
from moto.eks import urls
from moto.eks.exceptions import InvalidParameterException, ResourceInUseException, ResourceNotFoundException
from moto.eks.responses import EKSResponse

ACCOUNT = "123456789012"
ASSOCIATIONS: dict[str, dict] = {}  # associationId -> association
ADDONS: dict[tuple[str, str], dict] = {}  # (cluster, addon) -> addon

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
    ADDONS[(name, addon)] = {"addonName": addon, "clusterName": name, "status": "ACTIVE",
                             "addonVersion": self._get_param("addonVersion") or "v1.0.0-eksbuild.1", "health": {"issues": []},
                             "addonArn": f"arn:aws:eks:{self.region}:{ACCOUNT}:addon/{name}/{addon}/x",
                             "createdAt": _now(), "modifiedAt": _now(), "podIdentityAssociations": arns}
    return ActionResult({"addon": ADDONS[(name, addon)]})


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


for _fn in (create_pod_identity_association, list_pod_identity_associations, describe_pod_identity_association,
            delete_pod_identity_association, create_addon, describe_addon, delete_addon, list_addons, delete_cluster):
    setattr(EKSResponse, _fn.__name__, _fn)


if __name__ == "__main__":
    from moto.server import main

    _only_policies_doeks_names()

    main(sys.argv[1:])


def server(state_dir):
    """A doeks Service (pid file, log, port under STATE_DIR/services/moto) running this server instead of plain moto."""
    from pathlib import Path

    from doeks.local import services

    script = str(Path(__file__).resolve())
    plain = services.moto(state_dir)
    return services.Service("moto", state_dir, lambda port, data: [sys.executable, script, "-H", "127.0.0.1", "-p", str(port)],
                            plain.ready)
