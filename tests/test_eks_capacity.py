"""`up` on EKS as AWS really is: nothing bills before it can succeed (issue 55, 2). Before eksctl's first CreateStack
(the control plane bills from then on) `up` reads the EC2 vCPU quotas the node groups run under (Service Quotas;
botocore's Stubber checks each request against AWS's own model, moto has no EC2 quotas) against the vCPUs they ask,
as the real moto server answers DescribeInstanceTypes; a short quota stops it with one line and nothing made."""
from __future__ import annotations

import json
import os
import shutil

import boto3
import pytest
from botocore.stub import Stubber

from doeks import aws, eks
from doeks import settings as S
from doeks.errors import DoeksError
from doeks.runner import Runner

from . import moto_eks
from .conftest import ROOT


@pytest.fixture
def account(state_dir, tmp_path, monkeypatch):
    """The moto server as the account, eksctl's recorded-argv stand-in on PATH, an empty instance-type cache."""
    server = moto_eks.server(state_dir)
    server.start()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(ROOT / "tests" / "eksctl_standin.py", bin_dir / "eksctl")
    shutil.copy(ROOT / "tests" / "recorder.py", bin_dir / "kubectl")
    record = tmp_path / "eksctl.jsonl"
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "EKSCTL_RECORD": str(record), "RECORD": str(tmp_path / "kubectl.jsonl"),
           "AWS_ENDPOINT_URL": server.endpoint(), "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "DOEKS_CACHE": str(tmp_path / "cache")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    yield record
    server.stop()


def load(**env) -> S.Settings:
    return S.load(environ={**os.environ, "TARGET": "eks", **{k: str(v) for k, v in env.items()}}, path=ROOT / ".env")


def quotas_answer(monkeypatch, answers: dict[str, float]) -> Stubber:
    """Service Quotas answering `answers` (quota code -> value) in this order, each request checked by Stubber."""
    quotas = boto3.client("service-quotas", region_name="us-west-2", aws_access_key_id="x", aws_secret_access_key="x")
    stub = Stubber(quotas)
    for code, value in answers.items():
        stub.add_response("get_service_quota", {"Quota": {"QuotaCode": code, "Value": value}},
                          {"ServiceCode": "ec2", "QuotaCode": code})
    stub.activate()
    real = aws.client
    monkeypatch.setattr(aws, "client", lambda s, service: quotas if service == "service-quotas" else real(s, service))
    return stub


def made(settings, record) -> tuple[list, list, list]:
    """(eksctl's recorded argv, EKS clusters, CloudFormation stacks) in the account."""
    argv = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return (argv, aws.client(settings, "eks").list_clusters()["clusters"],
            aws.client(settings, "cloudformation").list_stacks()["StackSummaries"])


@pytest.mark.parametrize("spot,code,name", [
    (False, "L-DB2E81BA", "Running On-Demand G and VT instances"),
    (True, "L-3819A6DF", "All G and VT Spot Instance Requests"),
])
def test_a_short_quota_stops_up_before_anything_bills(account, monkeypatch, spot, code, name):
    s = load(GPU_INSTANCE_TYPE="g6.xlarge", GPU_NODES_MAX=4, GPU_SPOT=str(spot).lower())
    stub = quotas_answer(monkeypatch, {"L-1216C47A": 32.0, code: 8.0})  # sys: 1 x c5.2xlarge = 8 of 32
    with pytest.raises(DoeksError) as refused:
        eks.create(s, Runner(echo=False))
    stub.assert_no_pending_responses()
    line = str(refused.value)
    assert "\n" not in line
    assert f"EC2 quota {code} ({name}) in us-west-2 is 8 vCPUs; the node groups need 16 (gpu 4 x g6.xlarge x 4 vCPUs)" in line
    assert f"aws service-quotas request-service-quota-increase --service-code ec2 --quota-code {code} " \
           "--desired-value 16 --region us-west-2" in line and "Service Quotas console" in line
    assert made(s, account) == ([], [], [])  # no eksctl, no CreateStack, no CreateCluster


def test_the_system_group_counts_and_enough_quota_lets_eksctl_create(account, monkeypatch):
    s = load(GPU_INSTANCE_TYPE="p5en.48xlarge", GPU_NODES_MAX=2, SYSTEM_NODES=2, CPU_NODES=1, CPU_NODES_MAX=2)
    stub = quotas_answer(monkeypatch, {"L-1216C47A": 24.0})  # sys 2 x 8 + cpu 1 x 16 = 32 standard vCPUs
    with pytest.raises(DoeksError, match=r"L-1216C47A .* is 24 vCPUs; the node groups need 32 \(sys 2 x c5.2xlarge "
                                         r"x 8 \+ cpu 1 x c5.4xlarge x 16 vCPUs\)"):
        eks.create(s, Runner(echo=False))
    stub.assert_no_pending_responses()
    assert made(s, account)[0] == []
    stub = quotas_answer(monkeypatch, {"L-1216C47A": 32.0, "L-417A185B": 384.0})  # 2 x p5en.48xlarge x 192
    eks.create(s, Runner(echo=False))
    stub.assert_no_pending_responses()
    argv, clusters, _ = made(s, account)
    assert argv[0][:3] == ["create", "cluster", "-f"] and clusters == ["doeks"]


# -- Capacity Blocks (issue 55, 4): eksctl launches into one only with marketType capacity-block ----------------------
RESERVATION = "cr-0123456789abcdef0"


def reservation_answer(monkeypatch, kind: str | None, quotas: dict[str, float] | None = None) -> list[Stubber]:
    """EC2 answering DescribeCapacityReservations for RESERVATION as a reservation of `kind` (None: not found), and
    Service Quotas answering `quotas`, each request checked by Stubber."""
    kw = dict(region_name="us-west-2", aws_access_key_id="x", aws_secret_access_key="x")
    clients = {"ec2": boto3.client("ec2", **kw), "service-quotas": boto3.client("service-quotas", **kw)}
    stubs = [Stubber(clients["ec2"]), Stubber(clients["service-quotas"])]
    for _ in range(2):  # asked by the ClusterConfig and by the quota check
        if kind is None:
            stubs[0].add_client_error("describe_capacity_reservations", "InvalidCapacityReservationId.NotFound",
                                      expected_params={"CapacityReservationIds": [RESERVATION]})
            break
        stubs[0].add_response("describe_capacity_reservations", {"CapacityReservations": [{
            "CapacityReservationId": RESERVATION, "InstanceType": "p5en.48xlarge", "AvailabilityZone": "us-west-2b",
            "ReservationType": kind}]}, {"CapacityReservationIds": [RESERVATION]})
    for code, value in (quotas or {}).items():
        stubs[1].add_response("get_service_quota", {"Quota": {"QuotaCode": code, "Value": value}},
                              {"ServiceCode": "ec2", "QuotaCode": code})
    for stub in stubs:
        stub.activate()
    monkeypatch.setattr(aws, "client", lambda s, service: clients[service])
    monkeypatch.setattr(eks, "zones", lambda settings, runner=None: (["us-west-2a", "us-west-2b"], "us-west-2b"))
    return stubs


@pytest.mark.parametrize("kind", ["capacity-block", "default"])
def test_a_capacity_block_gets_its_market_type_and_no_on_demand_quota(state_dir, tmp_path, monkeypatch, kind):
    import yaml

    from doeks import instancetypes

    from .test_eks import validate

    monkeypatch.setenv("DOEKS_CACHE", str(tmp_path / "cache"))
    instancetypes.remember("us-west-2", "c5.2xlarge", {"gpus": 0, "efa": 0, "vcpus": 8, "memory_mib": 16384})
    instancetypes.remember("us-west-2", "p5en.48xlarge", {"gpus": 8, "efa": 16, "vcpus": 192, "memory_mib": 2097152})
    s = S.load(environ={"TARGET": "eks", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "GPU_NODES_MAX": "2",
                        "GPU_INSTANCE_TYPE": "p5en.48xlarge", "CAPACITY_RESERVATION_ID": RESERVATION}, path=ROOT / ".env")
    # a block is capacity bought already: only the system group's standard vCPUs are checked; a plain reservation's
    # instances run under the on-demand P quota
    quotas = {"L-1216C47A": 32.0} if kind == "capacity-block" else {"L-1216C47A": 32.0, "L-417A185B": 384.0}
    stubs = reservation_answer(monkeypatch, kind, quotas)
    config = yaml.safe_load(eks.config_yaml(s, Runner(echo=False)))
    eks.require_capacity(s, Runner(echo=False))
    for stub in stubs:
        stub.assert_no_pending_responses()
    validate(config)  # eksctl's own JSON schema: instanceMarketOptions.marketType on a managed node group
    gpu = next(g for g in config["managedNodeGroups"] if g["name"] == "gpu")
    assert gpu["capacityReservation"] == {"capacityReservationTarget": {"capacityReservationID": RESERVATION}}
    assert gpu["availabilityZones"] == ["us-west-2b"]
    if kind == "capacity-block":
        assert gpu["instanceMarketOptions"] == {"marketType": "capacity-block"}
    else:
        assert "instanceMarketOptions" not in gpu


def test_a_reservation_ec2_does_not_know_is_one_line(state_dir, monkeypatch):
    s = S.load(environ={"TARGET": "eks", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
                        "CAPACITY_RESERVATION_ID": RESERVATION}, path=ROOT / ".env")
    reservation_answer(monkeypatch, None)
    with pytest.raises(DoeksError, match=f"^CAPACITY_RESERVATION_ID={RESERVATION}: no such capacity reservation in "
                                         "us-west-2"):
        eks.config_yaml(s, Runner(echo=False))


# -- GPU nodes start at zero (issue 55, 5): a job's deploy grows the group, `down` then `audit` stays clean ----------
def test_gpu_nodes_start_at_zero_and_the_deploy_grows_the_group(account, monkeypatch):
    from .conftest import invoke

    s = load(GPU_INSTANCE_TYPE="g6.xlarge", GPU_NODES_MAX=4, REPLICAS=2, MAX_REPLICAS=3)
    quotas_answer(monkeypatch, {"L-1216C47A": 32.0, "L-DB2E81BA": 16.0})
    eks.create(s, Runner(echo=False))
    group = aws.client(s, "eks").describe_nodegroup(clusterName="doeks", nodegroupName="gpu")["nodegroup"]
    assert (group["scalingConfig"]["minSize"], group["scalingConfig"]["desiredSize"]) == (0, 0)  # nothing bills yet
    plan = invoke("elasticjob.deploy", "--dry-run", env={"TARGET": "eks", "GPU_INSTANCE_TYPE": "g6.xlarge"})
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "grow node group gpu of cluster doeks to 2 g6.xlarge nodes where it has fewer" in plan.stderr
    assert eks.scale_for_job(s, Runner(echo=False), 2) == 2
    assert eks.scale_for_job(s, Runner(echo=False), 1) == 2  # never shrinks: another job may run there
    assert eks.scale_for_job(s, Runner(echo=False), 9) == 4  # at most GPU_NODES_MAX
    group = aws.client(s, "eks").describe_nodegroup(clusterName="doeks", nodegroupName="gpu")["nodegroup"]
    assert group["scalingConfig"]["desiredSize"] == 4
    down = invoke("eks.delete", "--yes", env={"TARGET": "eks"})
    assert down.returncode == 0, down.stderr[-2000:]
    audit = invoke("audit", env={"TARGET": "eks", "COLUMNS": "250"})
    assert audit.returncode == 0, audit.stdout + audit.stderr[-2000:]


def test_up_dry_run_shows_no_gpu_node_until_the_deploy(state_dir, tmp_path):
    import yaml

    from .conftest import invoke

    plan = invoke("eks.create", "--dry-run", env={"TARGET": "eks", "DOEKS_CACHE": str(tmp_path / "cache")})
    assert plan.returncode == 0, plan.stderr[-2000:]
    config = next(d for d in yaml.safe_load_all(plan.stdout) if d and d.get("kind") == "ClusterConfig")
    gpu = next(g for g in config["managedNodeGroups"] if g["name"] == "gpu")
    assert (gpu["minSize"], gpu["desiredCapacity"], gpu["maxSize"]) == (0, 0, 4)
