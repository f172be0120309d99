"""The EKS rehearsal's registry (doeks.cluster.registry): upstream's distribution built here, on loopback. A real
`docker push` to it and the manifest it serves back; the pull by the node's containerd under an ECR name is in
tests/test_rehearsal_cluster.py (it needs the cluster)."""
from __future__ import annotations

import urllib.request

import pytest

from doeks.cluster import registry


@pytest.fixture
def running_registry(tmp_path, monkeypatch, docker_client):
    if not registry.built():
        pytest.skip(f"the registry is not built ({registry.binary()}): `invoke setup --kubernetes` builds it")
    monkeypatch.setenv("DOEKS_CLUSTER_DIR", str(tmp_path / "cluster"))
    endpoint = registry.start()
    yield endpoint
    registry.stop()


def test_the_registry_listens_on_loopback_only_and_serves_what_docker_pushed(running_registry):
    from doeks import preflight

    host, port = running_registry.split(":")
    assert host == "127.0.0.1"
    assert registry.start() == running_registry  # a running one is kept
    with open(registry.state_dir() / "config.yml") as f:
        assert f"addr: 127.0.0.1:{port}" in f.read()
    media, text = registry.push(preflight.BASE_IMAGE, "doeks-probe", "t1")
    assert media == "application/vnd.docker.distribution.manifest.v2+json" and '"layers"' in text
    assert registry.manifest("doeks-probe", "t2") is None
    with urllib.request.urlopen(f"http://{running_registry}/v2/doeks-probe/tags/list") as answer:
        assert b'"t1"' in answer.read()
    assert registry.delete_repository("doeks-probe") and registry.manifest("doeks-probe", "t1") is None
    assert registry.stop() and not registry.stop()  # idempotent
    assert registry.endpoint() is None


def test_the_node_maps_an_ecr_name_to_the_registry_and_nothing_else(tmp_path, monkeypatch):
    monkeypatch.setenv("DOEKS_CLUSTER_DIR", str(tmp_path / "cluster"))
    path = registry.map_host("123456789012.dkr.ecr.us-west-2.amazonaws.com", "127.0.0.1:5999")
    text = path.read_text()
    assert path.parent.name == "123456789012.dkr.ecr.us-west-2.amazonaws.com"
    # the server is the mirror too: no fallback to the ECR name, which would be looked up outside this machine
    assert 'server = "http://127.0.0.1:5999"' in text and '[host."http://127.0.0.1:5999"]' in text
    from doeks.cluster import node

    assert f'config_path = "{registry.hosts_dir()}"' in node.containerd_config()
    registry.unmap_all()
    assert not registry.hosts_dir().exists()
