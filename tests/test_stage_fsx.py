"""FSX_IMPORT_PATH: a data repository association for the static and the dynamically provisioned file system, made
once, removed on delete. moto has no FSx data repository associations, so botocore's Stubber checks every request
against AWS's own FSx service model (botocore 1.43); the claim's binding is read by the real kubernetes client from
tests/k8s_fake.py; kubectl and helm are the recorded-argv stand-ins of test_csi."""
from __future__ import annotations

import datetime

import boto3
import pytest
from botocore.stub import ANY, Stubber

from doeks import settings as S
from doeks import storage
from doeks.runner import Runner

from .conftest import invoke
from .k8s_fake import FakeCluster
from .test_csi import cloud, recorded  # noqa: F401  (fixture)

FS = "fs-0123456789abcdef0"
IMPORT = "s3://doeks-training/data/imagenet"


def association(fs=FS, path=IMPORT + "/", cluster="doeks", lifecycle="AVAILABLE", ident="dra-0123456789abcdef0"):
    return {"AssociationId": ident, "FileSystemId": fs, "FileSystemPath": "/data", "DataRepositoryPath": path,
            "Lifecycle": lifecycle, "BatchImportMetaDataOnCreate": True, "CreationTime": datetime.datetime(2026, 11, 22),
            "Tags": [{"Key": storage.TAG, "Value": cluster}]}


def create_params(fs=FS):
    return {"FileSystemId": fs, "FileSystemPath": "/data", "DataRepositoryPath": IMPORT + "/", "BatchImportMetaDataOnCreate": True,
            "S3": {"AutoImportPolicy": {"Events": ["NEW", "CHANGED", "DELETED"]}}, "ClientRequestToken": f"doeks-doeks-{fs}",
            "Tags": [{"Key": storage.TAG, "Value": "doeks"}]}


@pytest.fixture
def stubbed_fsx(state_dir, monkeypatch):
    """TARGET=eks with FSX_IMPORT_PATH; doeks' FSx client is one the test stubs."""
    monkeypatch.setenv("TARGET", "eks")
    monkeypatch.setenv("FSX_IMPORT_PATH", IMPORT)
    fsx = boto3.client("fsx", region_name="us-west-2", aws_access_key_id="x", aws_secret_access_key="x")
    real = storage._client
    monkeypatch.setattr(storage, "_client", lambda s, service: fsx if service == "fsx" else real(s, service))
    return fsx


@pytest.fixture
def deploy_env(cloud, stubbed_fsx, monkeypatch):  # noqa: F811
    """In-process csi.fsx.deploy against moto (EC2, IAM, EKS), the FSx client stubbed, kubectl/helm recorded."""
    for key, value in cloud["env"].items():
        monkeypatch.setenv(key, value)
    return stubbed_fsx


def test_association_on_a_static_file_system_is_made_once(deploy_env, monkeypatch):
    monkeypatch.setenv("FSX_FILE_SYSTEM_ID", FS)
    fsx = deploy_env
    described = {"FileSystems": [{"FileSystemId": FS, "StorageCapacity": 1200, "DNSName": "x.fsx.us-west-2.amazonaws.com",
                                  "LustreConfiguration": {"MountName": "abc"}}]}
    filters = {"Filters": [{"Name": "file-system-id", "Values": [FS]}]}
    with Stubber(fsx) as stub:
        stub.add_response("describe_file_systems", described, {"FileSystemIds": [FS]})
        stub.add_response("describe_data_repository_associations", {"Associations": []}, filters)
        stub.add_response("create_data_repository_association", {"Association": association(lifecycle="CREATING")}, create_params())
        stub.add_response("describe_file_systems", described, {"FileSystemIds": [FS]})
        stub.add_response("describe_data_repository_associations", {"Associations": [association()]}, filters)
        for _ in range(2):  # the second deploy finds it and creates nothing
            storage.fsx_deploy(S.load(), Runner(echo=False))
        stub.assert_no_pending_responses()


def test_association_on_the_default_dynamic_file_system_after_the_claim_binds_once(deploy_env, tmp_path, monkeypatch):
    fake = FakeCluster()
    monkeypatch.setenv("KUBECONFIG", str(fake.kubeconfig(tmp_path / "kubeconfig")))
    monkeypatch.setattr(storage.time, "sleep", lambda s: None)
    claim = {"kind": "PersistentVolumeClaim", "apiVersion": "v1", "metadata": {"name": "fsx-pvc", "namespace": "default"},
             "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "fsx-sc", "volumeName": "pvc-1a2b"},
             "status": {"phase": "Bound"}}
    fake.objects["/api/v1/namespaces/default/persistentvolumeclaims/fsx-pvc"] = claim
    fake.objects["/api/v1/persistentvolumes/pvc-1a2b"] = {
        "kind": "PersistentVolume", "apiVersion": "v1", "metadata": {"name": "pvc-1a2b"},
        "spec": {"capacity": {"storage": "1200Gi"}, "accessModes": ["ReadWriteMany"],
                 "csi": {"driver": "fsx.csi.aws.com", "volumeHandle": FS,
                         "volumeAttributes": {"dnsname": "x.fsx.us-west-2.amazonaws.com", "mountname": "abc"}}}}
    fsx = deploy_env
    try:
        with Stubber(fsx) as stub:
            filters = {"Filters": [{"Name": "file-system-id", "Values": [FS]}]}
            stub.add_response("describe_data_repository_associations", {"Associations": []}, filters)
            stub.add_response("create_data_repository_association",
                              {"Association": association(lifecycle="CREATING")}, create_params())
            stub.add_response("describe_data_repository_associations", {"Associations": [association()]}, filters)
            for _ in range(2):  # the second deploy finds it and creates nothing
                storage.fsx_deploy(S.load(), Runner(echo=False))
            stub.assert_no_pending_responses()
    finally:
        fake.close()
    assert "/api/v1/persistentvolumes/pvc-1a2b" in fake.requests  # the id came from the bound PV


def test_association_removed_on_delete_only_ours(stubbed_fsx):
    fsx = stubbed_fsx
    theirs = association(fs="fs-0fedcba9876543210", cluster="someone-else", ident="dra-0fedcba9876543210")
    with Stubber(fsx) as stub:
        stub.add_response("describe_data_repository_associations", {"Associations": [theirs], "NextToken": "t"}, {})
        stub.add_response("describe_data_repository_associations", {"Associations": [association()]}, {"NextToken": "t"})
        stub.add_response("delete_data_repository_association",
                          {"AssociationId": "dra-0123456789abcdef0", "Lifecycle": "DELETING", "DeleteDataInFileSystem": False},
                          {"AssociationId": "dra-0123456789abcdef0", "DeleteDataInFileSystem": False})
        stub.add_response("describe_data_repository_associations", {"Associations": [theirs, association(lifecycle="DELETING")]}, {})
        stub.add_response("describe_data_repository_associations", {"Associations": [theirs]}, {})
        runner = Runner(echo=False)
        assert storage.fsx_dissociate(S.load(), runner) == 1
        assert storage.fsx_dissociate(S.load(), runner) == 0  # being deleted: not asked twice
        assert storage.fsx_dissociate(S.load(), runner) == 0  # gone: safe
        stub.assert_no_pending_responses()


def test_a_different_path_already_linked_is_refused(stubbed_fsx):
    fsx = stubbed_fsx
    with Stubber(fsx) as stub:
        stub.add_response("describe_data_repository_associations",
                          {"Associations": [association(path="s3://other/prefix/")]}, {"Filters": ANY})
        with pytest.raises(storage.DoeksError, match="linked to s3://other/prefix/ already"):
            storage.fsx_associate(S.load(), Runner(echo=False), FS)


def test_dry_run_shows_the_association_for_the_dynamic_file_system(cloud, state_dir):  # noqa: F811
    result = invoke("csi.fsx.deploy", "--dry-run", env={**cloud["env"], "FSX_IMPORT_PATH": IMPORT})
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stderr.split())
    assert "would wait for PVC fsx-pvc to bind" in text
    assert 'fsx.create_data_repository_association {"BatchImportMetaDataOnCreate": true' in text
    assert '"FileSystemId": "<volumeHandle of the PV bound to fsx-pvc>"' in text
    assert not recorded(cloud)  # nothing ran
