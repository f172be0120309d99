"""The EKS rehearsal's registry (doeks.cluster.registry): upstream's distribution built here, on loopback. A real
`docker push` to it and the manifest it serves back; `registry.store` (the rehearsal's push: docker's uncompressed
layers written in distribution's layout, nothing recompressed) served by the registry itself, blob by blob, and
only what the registry lacks taken from `docker save`; the pull by the node's containerd under an ECR name is in
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
    from doeks import machine

    host, port = running_registry.split(":")
    assert host == "127.0.0.1"
    assert registry.start() == running_registry  # a running one is kept
    with open(registry.state_dir() / "config.yml") as f:
        assert f"addr: 127.0.0.1:{port}" in f.read()
    media, text = registry.push(machine.BASE_IMAGE, "doeks-probe", "t1")
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
    from doeks.cluster import nodeconfig

    assert f'config_path = "{registry.hosts_dir()}"' in nodeconfig.containerd_config()
    registry.unmap_all()
    assert not registry.hosts_dir().exists()


def test_a_stored_image_is_served_by_the_registry_as_docker_has_it(running_registry, docker_client, tmp_path,
                                                                    monkeypatch):
    import hashlib
    import json
    import subprocess

    from doeks import machine

    media, text = registry.store(machine.BASE_IMAGE, "doeks-stored", "t1")
    document = json.loads(text)
    image = docker_client.images.get(machine.BASE_IMAGE)
    assert media == registry.OCI_MANIFEST == document["mediaType"]
    # docker's own config and layers, unchanged: the image ID is the config's digest, each layer's digest its diff ID
    assert document["config"]["digest"] == image.id
    assert [layer["digest"] for layer in document["layers"]] == image.attrs["RootFS"]["Layers"]
    for blob in [document["config"], *document["layers"]]:  # what the registry serves over HTTP hashes to its name
        digest = hashlib.sha256()
        with urllib.request.urlopen(f"http://{running_registry}/v2/doeks-stored/blobs/{blob['digest']}") as answer:
            while chunk := answer.read(1 << 20):
                digest.update(chunk)
        assert f"sha256:{digest.hexdigest()}" == blob["digest"]
    with urllib.request.urlopen(f"http://{running_registry}/v2/doeks-stored/tags/list") as answer:
        assert json.loads(answer.read())["tags"] == ["t1"]

    def no_save(*args, **kwargs):
        raise AssertionError("docker save ran for an image the registry has whole")

    with monkeypatch.context() as patched:
        patched.setattr(registry, "_save_blobs", no_save)
        assert registry.store(machine.BASE_IMAGE, "doeks-stored", "t2") == (media, text)  # a second tag: links only

    # a code edit: one new layer on the same base; the base's layers are hashed from `docker save`, not written
    (tmp_path / "Dockerfile").write_text(f"FROM {machine.BASE_IMAGE}\nRUN echo edited > /edited\n")
    edited = "doeks-stored-edit:t3"
    built = subprocess.run(["docker", "build", "-q", "-t", edited, str(tmp_path)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    hashed_only = []
    real = registry._save_blobs

    def spy(ref, wanted, hash_only):
        hashed_only.extend(d for digests in hash_only.values() for d in digests)
        return real(ref, wanted, hash_only)

    try:
        with monkeypatch.context() as patched:
            patched.setattr(registry, "_save_blobs", spy)
            _, text3 = registry.store(edited, "doeks-stored", "t3")
        layers = [layer["digest"] for layer in json.loads(text3)["layers"]]
        assert layers[:-1] == image.attrs["RootFS"]["Layers"] and set(hashed_only) == set(layers[:-1])
        assert registry.manifest("doeks-stored", "t3")[1] == text3
    finally:
        subprocess.run(["docker", "rmi", edited], capture_output=True)
        registry.delete_repository("doeks-stored")


def test_a_store_removes_old_blobs_that_nothing_names_and_keeps_the_cache(running_registry, docker_client):
    """Blobs of a deleted repository or an old base image stayed for ever (3.9 GB per training base image): a store
    removes the old ones that no repository names and no docker image here has; the layers docker still has (the
    cache a later store reuses), what a repository names, and a blob written moments ago (a push in progress) stay."""
    import hashlib
    import os
    import time

    from doeks import machine

    def blob(content: bytes, age_s: float) -> str:
        digest = f"sha256:{hashlib.sha256(content).hexdigest()}"
        path = registry._blob(digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        os.utime(path, (time.time() - age_s, time.time() - age_s))
        return digest

    stamp = str(time.time_ns()).encode()
    orphan, fresh, named = blob(b"orphan " + stamp, 3600), blob(b"fresh " + stamp, 0), blob(b"named " + stamp, 3600)
    registry._link(registry._v2() / "repositories" / "doeks-gc" / "_layers" / "sha256" / named.split(":")[1] / "link",
                   named)
    try:
        _, text = registry.store(machine.BASE_IMAGE, "doeks-stored-gc", "t1")
        assert not registry._blob(orphan).exists(), "an old blob nothing names was kept"
        assert registry._blob(fresh).exists() and registry._blob(named).exists()
        image = docker_client.images.get(machine.BASE_IMAGE)
        for digest in [image.id, *image.attrs["RootFS"]["Layers"]]:
            assert registry._blob(digest).exists(), digest
        registry.delete_repository("doeks-stored-gc")
        # the base image's layers are no repository's now, but docker has them: a later store writes nothing
        registry.collect_garbage(older_than_s=0)
        assert all(registry._blob(d).exists() for d in [image.id, *image.attrs["RootFS"]["Layers"]])
        assert registry._blob(named).exists() and not registry._blob(fresh).exists()
    finally:
        registry.delete_repository("doeks-gc")
        registry.delete_repository("doeks-stored-gc")
        for digest in (orphan, fresh, named):
            registry._blob(digest).unlink(missing_ok=True)
