"""TARGET=eks acts on the cluster of .env's CLUSTER_NAME and AWS_REGION only (issue 31): every kubectl doeks runs
reads the kubeconfig `eks.connect` writes for that cluster, never the user's current context (which may be another
cluster: `down` deleted the last-connected cluster's objects before)."""
from __future__ import annotations

import json
import os
import sys

from .conftest import invoke

STANDIN = """#!{python}
import json, os, sys
with open(os.environ["RECORD"], "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "KUBECONFIG": os.environ.get("KUBECONFIG")}}) + "\\n")
print('{{"items": []}}') if "get" in sys.argv else None
sys.exit(1 if "pytorchjob" in sys.argv else 0)
"""


def test_every_kubectl_on_eks_reads_the_kubeconfig_of_the_configured_cluster(tmp_path, state_dir):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").write_text(STANDIN.format(python=sys.executable))
    (bin_dir / "kubectl").chmod(0o755)
    theirs = tmp_path / "user-kubeconfig"  # the user's: its current context is another cluster
    theirs.write_text("apiVersion: v1\nkind: Config\ncurrent-context: prod\ncontexts: []\nclusters: []\nusers: []\n")
    record = tmp_path / "record.jsonl"
    env = {"TARGET": "eks", "CLUSTER_NAME": "train-a", "AWS_REGION": "eu-west-1", "KUBECONFIG": str(theirs),
           "PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD": str(record), "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
           "TRAIN_IMAGE": "123456789012.dkr.ecr.eu-west-1.amazonaws.com/doeks-train:1",
           "AWS_MAX_ATTEMPTS": "1"}  # the dead endpoint refused once, not after botocore's 5 tries and their back-off
    invoke("elasticjob.status", env=env)
    invoke("elasticjob.delete", env=env)
    seen = [json.loads(line) for line in record.read_text().splitlines()]
    assert seen, "kubectl was not run"
    pinned = str(state_dir / "kube" / "eks-train-a.eu-west-1.kubeconfig")
    assert {call["KUBECONFIG"] for call in seen} == {pinned}, seen
