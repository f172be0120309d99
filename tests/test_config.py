"""`invoke config`: the effective settings on stdout (grep-able, whole values when piped), as JSON, filtered by key;
secrets masked in every form."""
from __future__ import annotations

import json

from doeks import settings as S

from .conftest import invoke

SECRET = "abcdEFGH1234secretXYZ"


def test_table_goes_to_stdout_whole_when_piped(state_dir):
    # a long value (SAGEMAKER_IMAGE's default, derived from AWS_REGION, is 110 characters) must survive a pipe,
    # whatever the terminal says
    image = S.load(environ={}).sagemaker_image
    assert len(image) > 100
    result = invoke("config", env={"COLUMNS": "60", "AWS_SECRET_ACCESS_KEY": SECRET})
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    line = next(l for l in result.stdout.splitlines() if "SAGEMAKER_IMAGE" in l)
    assert image in line and "…" not in result.stdout
    secret_line = next(l for l in result.stdout.splitlines() if "AWS_SECRET_ACCESS_KEY" in l)
    assert "****" in secret_line and "environment" in secret_line
    assert SECRET not in result.stdout


def test_json_lists_every_key_with_source_and_masks_secrets(state_dir):
    result = invoke("config", "--json", env={"AWS_SECRET_ACCESS_KEY": SECRET, "REPLICAS": "3"})
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert [d["key"] for d in data] == [k.name for k in S.KEYS]
    by_key = {d["key"]: d for d in data}
    assert by_key["REPLICAS"] == {"key": "REPLICAS", "unit": "elasticjob", "value": "3", "source": "environment"}
    assert by_key["AWS_SECRET_ACCESS_KEY"]["value"] == "****"
    assert SECRET not in result.stdout + result.stderr


def test_key_filter_substring_and_repeated(state_dir):
    result = invoke("config", "--json", "--key", "replicas", "--key", "AWS_REGION")
    assert result.returncode == 0, result.stderr
    assert [d["key"] for d in json.loads(result.stdout)] == ["AWS_REGION", "REPLICAS", "MIN_REPLICAS", "MAX_REPLICAS"]
    table = invoke("config", "--key", "CLUSTER_NAME")
    assert table.returncode == 0 and "CLUSTER_NAME" in table.stdout and "REPLICAS" not in table.stdout
    none = invoke("config", "--key", "NO_SUCH_THING")
    assert none.returncode == 1 and none.stdout == ""
    assert none.stderr.strip().splitlines() == ["error: --key NO_SUCH_THING: no setting matches; `invoke config` lists them all"]
