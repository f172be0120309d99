"""A price before the bill (doeks.pricing): `up` on TARGET=eks first says what it makes that AWS bills by the hour
(instance types, counts, FSx, the NAT gateway) with the on-demand $/hour of the AWS Price List's answer, cached with
its date, then asks; without a terminal and without --yes it refuses in one line and makes nothing."""
from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import time

import boto3
import pytest
from botocore.stub import Stubber

from doeks import pricing, targets
from doeks import settings as S

from .conftest import ROOT, invoke
from .test_teardown import account  # noqa: F401 - the moto account with eksctl/kubectl/helm stand-ins

SIZES = {"TARGET": "eks", "AWS_REGION": "us-west-2", "GPU_INSTANCE_TYPE": "g5.xlarge", "GPU_NODES": "2",
         "GPU_NODES_MIN": "0", "GPU_NODES_MAX": "4", "SYSTEM_NODES": "1", "CPU_NODES": "0", "CPU_NODES_MAX": "0"}
PRICES = {"AmazonEKS": ("USW2-AmazonEKS-Hours:perCluster", "0.10"), "NAT Gateway": ("USW2-NatGateway-Hours", "0.045"),
          "c5.2xlarge": ("USW2-BoxUsage:c5.2xlarge", "0.34"), "g5.xlarge": ("USW2-BoxUsage:g5.xlarge", "1.006")}


def _product(usage: str, usd: str) -> str:
    """One product of GetProducts' PriceList, as the Price List API writes it (a JSON string)."""
    return json.dumps({"product": {"attributes": {"usagetype": usage}},
                       "terms": {"OnDemand": {"X.JRTCKXETXF": {"priceDimensions": {"X.JRTCKXETXF.6YS6EN2CT7": {
                           "unit": "Hrs", "pricePerUnit": {"USD": usd}}}}}}})


@pytest.fixture
def eks_settings(tmp_path, state_dir, monkeypatch):
    monkeypatch.setenv("DOEKS_CACHE", str(tmp_path / "cache"))
    for key, value in SIZES.items():
        monkeypatch.setenv(key, value)
    S.reset()
    return S.current()


def test_prices_are_the_price_lists_answer_cached_with_the_date(eks_settings, tmp_path):
    client = boto3.client("pricing", region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing")
    stub = Stubber(client)
    other = _product("USW2-AmazonEKS-Hours:extendedSupport", "0.60")  # another EKS product of the region, first
    stub.add_response("get_products", {"PriceList": [other], "NextToken": "page2"},
                      {"ServiceCode": "AmazonEKS", "Filters": [{"Type": "TERM_MATCH", "Field": "regionCode", "Value": "us-west-2"}],
                       "FormatVersion": "aws_v1", "MaxResults": 100})
    stub.add_response("get_products", {"PriceList": [_product(*PRICES["AmazonEKS"])]},
                      {"ServiceCode": "AmazonEKS", "Filters": [{"Type": "TERM_MATCH", "Field": "regionCode", "Value": "us-west-2"}],
                       "FormatVersion": "aws_v1", "MaxResults": 100, "NextToken": "page2"})
    stub.add_response("get_products", {"PriceList": [_product(*PRICES["NAT Gateway"])]})
    for instance in ("c5.2xlarge", "g5.xlarge"):
        filters = pricing.queries(eks_settings)[f"us-west-2/ec2/{instance}"][1]
        assert {"Type": "TERM_MATCH", "Field": "instanceType", "Value": instance} in filters
        stub.add_response("get_products", {"PriceList": [_product(*PRICES[instance])]},
                          {"ServiceCode": "AmazonEC2", "Filters": filters, "FormatVersion": "aws_v1", "MaxResults": 100})
    with stub:
        found, source = pricing.prices(eks_settings, client)
        stub.assert_no_pending_responses()
    today = time.strftime("%Y-%m-%d")
    assert found == {"us-west-2/eks-cluster": 0.10, "us-west-2/nat-gateway": 0.045, "us-west-2/ec2/c5.2xlarge": 0.34,
                     "us-west-2/ec2/g5.xlarge": 1.006}
    assert source == f"AWS Price List, read {today}"
    cached = json.loads((tmp_path / "cache" / "prices.json").read_text())
    assert cached["us-west-2/ec2/g5.xlarge"] == {"usd_hour": 1.006, "date": today}

    class Unasked:  # a second look reads the cache: the Price List is not asked again
        def get_products(self, **kwargs):
            raise AssertionError(f"asked again: {kwargs}")

    assert pricing.prices(eks_settings, Unasked()) == (found, source)
    lines = pricing.summary(targets.get(eks_settings))
    gpu = next(line for line in lines if "node group gpu" in line)
    assert gpu.split()[:2] == ["2", "x"] and "g5.xlarge" in gpu and "$2.01/h ($1.006 each)" in gpu and "scales 0-4" in gpu
    assert any("1 x node group sys: c5.2xlarge" in line and "$0.34/h" in line for line in lines)
    assert any("NAT gateway" in line and "$0.04/h" in line for line in lines)
    assert any("FSx for Lustre PERSISTENT_2 1200 GiB" in line for line in lines)
    total = 0.10 + 0.045 + 0.34 + 2 * 1.006 + round(1200 * 0.210 / 730, 3)
    assert lines[-1].strip() == f"about ${total:,.2f}/hour on demand (AWS Price List, read {today})", lines


def _fill_cache(folder):
    folder.mkdir(parents=True, exist_ok=True)
    today = time.strftime("%Y-%m-%d")
    keys = {"us-west-2/eks-cluster": 0.10, "us-west-2/nat-gateway": 0.045, "us-west-2/ec2/c5.2xlarge": 0.34,
            "us-west-2/ec2/g5.xlarge": 1.006}
    (folder / "prices.json").write_text(json.dumps({k: {"usd_hour": v, "date": today} for k, v in keys.items()}))


def test_up_on_eks_says_what_it_bills_and_asks_before_creating(account, tmp_path):  # noqa: F811
    env = {**account["env"], **SIZES, "DOEKS_CACHE": str(tmp_path / "cache")}
    env.pop("CI", None)
    _fill_cache(tmp_path / "cache")
    refused = subprocess.run([sys.executable, "-m", "invoke", "up"], cwd=ROOT, env={**os.environ, **env, "CI": ""},
                             stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)  # no terminal
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    err = refused.stderr.strip().splitlines()
    assert "`invoke up` on TARGET=eks makes, in us-west-2 (billed by the hour until `invoke down`):" in err, err
    assert any(line.split()[:2] == ["2", "x"] and "node group gpu: g5.xlarge" in line and "$2.01/h" in line for line in err)
    assert err[-1].startswith("error: `invoke up` makes billable resources (about $") and "pass --yes to confirm" in err[-1]
    assert "== up: eks" not in refused.stderr and not (account["tmp"] / "record.jsonl").exists()  # nothing made

    # on a terminal it asks (Python's input() prompts on stderr there); anything but yes makes nothing
    primary, secondary = pty.openpty()
    process = subprocess.Popen([sys.executable, "-m", "invoke", "up"], cwd=ROOT, env={**os.environ, **env, "CI": ""},
                               stdin=secondary, stdout=secondary, stderr=subprocess.PIPE)
    os.close(secondary)
    os.write(primary, b"n\n")  # typed ahead: the terminal holds it until up asks
    try:
        stderr = process.communicate(timeout=120)[1].decode()
    finally:
        os.close(primary)
    assert process.returncode == 1, stderr
    assert stderr.strip().splitlines()[-1] == "Create them? [y/N] error: not confirmed: nothing created", stderr
    assert "node group gpu: g5.xlarge" in stderr and not (account["tmp"] / "record.jsonl").exists()


def test_up_dry_run_fits_on_a_screen_and_keeps_the_whole_plan(state_dir):
    """No credentials, TARGET=eks: the summary and a line a step, under 55 lines (50 until eksctl's renamed EFA
    DaemonSet and the previous job's replacement became steps of their own); the whole plan (every request with
    its parameters, every manifest) in STATE_DIR/plans/, and on the terminal with --full."""
    env = {**SIZES, "AWS_SHARED_CREDENTIALS_FILE": str(state_dir / "none"), "AWS_CONFIG_FILE": str(state_dir / "none"),
           "AWS_EC2_METADATA_DISABLED": "true"}  # a machine without credentials, as test_first_run's
    brief = invoke("up", "--dry-run", env=env, timeout=600)
    assert brief.returncode == 0, brief.stderr[-3000:]
    said = brief.stdout.splitlines() + brief.stderr.strip().splitlines()
    assert len(said) < 55, "\n".join(said)
    assert "would run: eksctl create cluster -f" in brief.stderr and "node group gpu: g5.xlarge" in brief.stderr
    assert "Create them?" not in brief.stderr  # a dry run asks nothing
    steps, manifests = state_dir / "plans" / "up-eks.txt", state_dir / "plans" / "up-eks.yaml"
    assert f"the whole plan: {steps}" in brief.stderr and "--dry-run --full" in brief.stderr
    full = invoke("up", "--dry-run", "--full", env=env, timeout=600)
    assert full.returncode == 0, full.stderr[-3000:]
    assert manifests.read_text() == full.stdout and "kind: ClusterConfig" in full.stdout
    requests = [line for line in full.stderr.splitlines() if line.startswith("would call: iam.create_role {")]
    assert requests and requests == [line for line in steps.read_text().splitlines() if line.startswith("would call: iam.create_role {")]
