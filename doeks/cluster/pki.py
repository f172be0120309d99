"""The cluster's certificates and kubeconfigs (what hack/local-up-cluster.sh makes with openssl, written in Python):
one CA, the API server's serving certificate, one client certificate per component, the service-account key pair.
Keys are written 0600; nothing here is printed."""
from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from . import versions

# component -> (common name, organisation): the identities the API server's RBAC knows (system:kube-controller-manager...)
CLIENTS = {
    "admin": ("doeks-admin", "system:masters"),
    "controller-manager": ("system:kube-controller-manager", None),
    "scheduler": ("system:kube-scheduler", None),
    "kubelet": (f"system:node:{versions.NODE_NAME}", "system:nodes"),
    "kube-proxy": ("system:kube-proxy", None),
    "apiserver-kubelet-client": ("kube-apiserver-kubelet-client", "system:masters"),
}


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _name(cn: str, org: str | None = None):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    parts = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        parts.insert(0, x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(parts)


def _certificate(subject, issuer, public_key, signer, *, ca: bool = False, server_names=(), client: bool = False,
                 server: bool = False):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID

    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=365 if not ca else 3650))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
    else:
        builder = builder.add_extension(x509.KeyUsage(True, True, False, False, False, False, False, False, False), critical=True)
        usages = ([ExtendedKeyUsageOID.CLIENT_AUTH] if client else []) + ([ExtendedKeyUsageOID.SERVER_AUTH] if server else [])
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if server_names:
        sans = []
        for name in server_names:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(name)))
            except ValueError:
                sans.append(x509.DNSName(name))
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(signer, hashes.SHA256())


def _pem(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def pki_dir() -> Path:
    return versions.cluster_dir() / "pki"


def _made() -> list[Path]:
    """Every file make() writes (the API server's client certificate for kubelets has no kubeconfig)."""
    pki = pki_dir()
    files = [pki / f"{name}.{ext}" for name in ("ca", "apiserver", "kubelet-serving", *CLIENTS) for ext in ("crt", "key")]
    files += [versions.cluster_dir() / f"{c}.kubeconfig" for c in CLIENTS if c != "apiserver-kubelet-client"]
    return files + [pki / "sa.key", pki / "sa.pub"]


def make(server_url: str) -> None:
    """Every certificate, key and kubeconfig the cluster needs (once: kept while the cluster's folder is)."""
    from cryptography.hazmat.primitives import serialization

    pki = pki_dir()
    if all(path.exists() for path in _made()):
        return  # a second `up` with the cluster running must keep the CA its processes loaded
    ca_key = _key()
    ca_name = _name("doeks-cluster-ca")
    ca = _certificate(ca_name, ca_name, ca_key.public_key(), ca_key, ca=True)
    _write(pki / "ca.key", _pem_key(ca_key), private=True)
    _write(pki / "ca.crt", _pem(ca))
    names = ["kubernetes", "kubernetes.default", "kubernetes.default.svc", f"kubernetes.default.svc.{versions.CLUSTER_DOMAIN}",
             "localhost", "127.0.0.1", versions.NODE_IP, versions.KUBERNETES_SERVICE_IP, versions.NODE_NAME]
    for name, (cn, server) in {"apiserver": ("kube-apiserver", True), "kubelet-serving": (versions.NODE_NAME, True)}.items():
        key = _key()
        cert = _certificate(_name(cn), ca_name, key.public_key(), ca_key, server=True, server_names=names)
        _write(pki / f"{name}.key", _pem_key(key), private=True)
        _write(pki / f"{name}.crt", _pem(cert))
    for client, (cn, org) in CLIENTS.items():
        key = _key()
        cert = _certificate(_name(cn, org), ca_name, key.public_key(), ca_key, client=True)
        _write(pki / f"{client}.key", _pem_key(key), private=True)
        _write(pki / f"{client}.crt", _pem(cert))
        if client != "apiserver-kubelet-client":
            write_kubeconfig(versions.cluster_dir() / f"{client}.kubeconfig", server_url, client)
    sa = _key()
    _write(pki / "sa.key", _pem_key(sa), private=True)
    _write(pki / "sa.pub", sa.public_key().public_bytes(serialization.Encoding.PEM,
                                                         serialization.PublicFormat.SubjectPublicKeyInfo))


def make_node(name: str, ip: str) -> None:
    """An extra node's kubelet identity (client certificate system:node:<name>, its kubeconfig) and serving certificate
    for its address, signed by the cluster's CA (once: kept while the cluster's folder is)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    pki = pki_dir()
    client, serving = f"kubelet-{name}", f"kubelet-serving-{name}"
    kubeconfig = versions.cluster_dir() / "nodes" / name / "kubelet.kubeconfig"
    if all(p.exists() for p in (pki / f"{client}.crt", pki / f"{serving}.crt", kubeconfig)):
        return
    ca_key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), password=None)
    ca_name = x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes()).subject
    key = _key()
    cert = _certificate(_name(name), ca_name, key.public_key(), ca_key, server=True, server_names=[name, ip])
    _write(pki / f"{serving}.key", _pem_key(key), private=True)
    _write(pki / f"{serving}.crt", _pem(cert))
    key = _key()
    cert = _certificate(_name(f"system:node:{name}", "system:nodes"), ca_name, key.public_key(), ca_key, client=True)
    _write(pki / f"{client}.key", _pem_key(key), private=True)
    _write(pki / f"{client}.crt", _pem(cert))
    server = f"https://{versions.NODE_IP}:{versions.API_PORT}"
    write_kubeconfig(kubeconfig, server, client)


def write_kubeconfig(path: Path, server_url: str, client: str) -> None:
    import yaml

    pki = pki_dir()
    config = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "doeks", "cluster": {"server": server_url, "certificate-authority": str(pki / "ca.crt")}}],
        "users": [{"name": client, "user": {"client-certificate": str(pki / f"{client}.crt"),
                                             "client-key": str(pki / f"{client}.key")}}],
        "contexts": [{"name": "doeks", "context": {"cluster": "doeks", "user": client}}],
        "current-context": "doeks",
    }
    _write(path, yaml.safe_dump(config, sort_keys=False).encode(), private=True)
