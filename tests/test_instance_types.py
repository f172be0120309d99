"""GPUs and EFA per pod from EC2's DescribeInstanceTypes (issue 31, failure 4): a type missing from a hand-kept
table got 2 GPUs per pod (g5.2xlarge has 1: the pods stayed Pending), g5.12xlarge's EFA was left out. The real
moto server answers DescribeInstanceTypes from AWS's published data; doeks asks it once and caches the answer."""
from __future__ import annotations

import json

import pytest
import yaml

from . import moto_eks
from .conftest import invoke

EXPECTED = {"p4d.24xlarge": (8, 4), "p5.48xlarge": (8, 32), "g5.2xlarge": (1, 0), "g5.12xlarge": (4, 1),
            "g5.48xlarge": (8, 1)}


@pytest.fixture
def account(state_dir, tmp_path):
    import boto3

    server = moto_eks.server(state_dir)
    server.start()
    s3 = boto3.client("s3", region_name="us-west-2", endpoint_url=server.endpoint(), aws_access_key_id="testing",
                      aws_secret_access_key="testing")
    s3.create_bucket(Bucket="doeks-training", CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
    for part in ("train", "val"):  # the built-in job's data, which `up` checks for before staging it
        s3.put_object(Bucket="doeks-training", Key=f"data/imagenet/{part}/n01/a.JPEG", Body=b"x")
    yield {"TARGET": "eks", "AWS_ENDPOINT_URL": server.endpoint(), "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "DOEKS_CACHE": str(tmp_path / "cache"), "COLUMNS": "250"}
    server.stop()


def per_pod(stdout: str) -> tuple[int, int]:
    job = next(d for d in yaml.safe_load_all(stdout) if d and d.get("kind") == "PyTorchJob")
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    limits = pod["containers"][0]["resources"]["limits"]
    assert int(job["spec"]["nprocPerNode"]) == limits["nvidia.com/gpu"]  # one process per GPU
    return limits["nvidia.com/gpu"], limits.get("vpc.amazonaws.com/efa", 0)


def test_up_dry_run_asks_ec2_for_the_gpus_and_efa_of_the_node_type(account, tmp_path):
    """Every type's GPUs and EFA per pod as EC2 answers them, and cached, in a deploy's plan (which asks EC2 as `up`
    does); `up`'s whole plan, with a cache of its own, for a type with EFA and one without: its node group follows."""
    for instance, expected in EXPECTED.items():
        plan = invoke("elasticjob.deploy", "--dry-run", env={**account, "GPU_INSTANCE_TYPE": instance})
        assert plan.returncode == 0, plan.stderr[-2000:]
        assert per_pod(plan.stdout) == expected, instance
        cached = json.loads((tmp_path / "cache" / "instance-types.json").read_text())["us-west-2"][instance]
        assert (cached["gpus"], cached["efa"]) == expected, instance
    for instance in ("g5.12xlarge", "g5.2xlarge"):
        cache = tmp_path / f"cache-up-{instance}"
        plan = invoke("up", "--dry-run", "--full",
                      env={**account, "GPU_INSTANCE_TYPE": instance, "DOEKS_CACHE": str(cache)})
        assert plan.returncode == 0, plan.stderr[-2000:]
        assert per_pod(plan.stdout) == EXPECTED[instance]
        config = next(d for d in yaml.safe_load_all(plan.stdout) if d and d.get("kind") == "ClusterConfig")
        gpu_group = next(g for g in config["managedNodeGroups"] if g["name"] == "gpu")
        assert bool(gpu_group.get("efaEnabled")) == (EXPECTED[instance][1] > 0)
        cached = json.loads((cache / "instance-types.json").read_text())["us-west-2"][instance]
        assert (cached["gpus"], cached["efa"]) == EXPECTED[instance]


def test_the_cached_answer_is_used_and_env_overrides_it(account):
    first = invoke("elasticjob.deploy", "--dry-run", env={**account, "GPU_INSTANCE_TYPE": "g5.2xlarge"})
    assert first.returncode == 0 and per_pod(first.stdout) == (1, 0)
    offline = {**account, "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "GPU_INSTANCE_TYPE": "g5.2xlarge"}
    again = invoke("elasticjob.deploy", "--dry-run", env=offline)  # EC2 is not asked again: the cache answers
    assert again.returncode == 0 and per_pod(again.stdout) == (1, 0)
    mine = invoke("elasticjob.deploy", "--dry-run", env={**offline, "NPROC_PER_NODE": "2", "EFA_PER_NODE": "0",
                                                          "GPU_INSTANCE_TYPE": "p4d.24xlarge"})
    assert mine.returncode == 0 and per_pod(mine.stdout) == (2, 0)
    unknown = invoke("elasticjob.deploy", "--dry-run", env={**account, "GPU_INSTANCE_TYPE": "g5.3xlarge"})
    assert unknown.returncode == 1 and "GPU_INSTANCE_TYPE=g5.3xlarge is not an instance type EC2 knows" in unknown.stderr
    assert "Traceback" not in unknown.stderr
