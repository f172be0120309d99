"""eksctl's own validation of doeks' ClusterConfig (`eksctl create cluster --dry-run -f`), with eksctl v0.215.0 built
here from its Go module (doeks.cluster.eksctl; long to build, so not part of `invoke setup --kubernetes`: skipped with
one line where it is not built) against doeks' moto server (DescribeClusterVersions from doeks' calendar); any
other address is refused by a proxy on a closed loopback port."""
from __future__ import annotations

import pytest
import yaml

from doeks import eks
from doeks import settings as S
from doeks.cluster import eksctl
from doeks.errors import DoeksError

from . import moto_eks
from .conftest import ROOT

pytestmark = pytest.mark.skipif(not eksctl.built(), reason=f"eksctl is not built here ({eksctl.binary()}): "
                                "doeks.cluster.eksctl.build_binary() builds it")


@pytest.fixture
def endpoint(state_dir):
    server = moto_eks.server(state_dir)
    server.start()
    yield server.endpoint()
    server.stop()


@pytest.mark.parametrize("env", [{}, {"GPU_INSTANCE_TYPE": "p5.48xlarge", "CAPACITY_RESERVATION_ID": "cr-0123456789abcdef0"},
                                 {"GPU_INSTANCE_TYPE": "g5.12xlarge", "GPU_SPOT": "true", "CPU_NODES_MAX": "4"},
                                 {"GPU_NODES_MAX": "0", "GPU_NODES": "0", "AMI_FAMILY": "Bottlerocket"}])
def test_eksctl_accepts_the_cluster_config_doeks_renders(endpoint, tmp_path, env, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    s = S.load(environ={"TARGET": "eks", "AWS_ENDPOINT_URL": endpoint, **env}, path=ROOT / ".env")
    config = eks.cluster_config(s, eks.choose_zones(s, ["us-west-2b"], [f"us-west-2{z}" for z in "abcd"]))
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    eksctl.validate(s, path)


def test_eksctl_refuses_a_broken_config(endpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    s = S.load(environ={"TARGET": "eks", "AWS_ENDPOINT_URL": endpoint}, path=ROOT / ".env")
    config = eks.cluster_config(s, eks.choose_zones(s, ["us-west-2b"], [f"us-west-2{z}" for z in "abcd"]))
    config["managedNodeGroups"][-1]["minSize"] = 5  # more than desiredCapacity: the JSON schema cannot see this
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    with pytest.raises(DoeksError, match="eksctl create cluster --dry-run refuses .*cannot use --nodes-min=5"):
        eksctl.validate(s, path)
