"""The README's local walk-through works as written (issue 24): after the Quickstart's demo, each command of its
*Step by step* blocks, in order, as a user types them. The install step (`pip install -e '.[dev]'`) is what this
suite runs in already; everything after it runs for real (torchrun agents, etcd, the supervisor)."""
from __future__ import annotations

import os
import re
import subprocess

import pytest

from .conftest import ROOT

pytestmark = pytest.mark.slow

SMALL = {"DATA_TRAIN_PER_CLASS": "150", "DATA_VAL_PER_CLASS": "25", "COLUMNS": "200"}  # a smaller set: minutes, not tens


def readme_commands(section: str) -> list[str]:
    readme = (ROOT / "README.md").read_text()
    if section == "quickstart":
        block = re.search(r"## Quickstart.*?```bash\n(.*?)```", readme, re.S).group(1)
    else:
        part = re.search(rf"<!-- walkthrough:{section}:start -->(.*?)<!-- walkthrough:{section}:end -->", readme, re.S)
        assert part, f"README has no {section} walk-through"
        block = "".join(re.findall(r"```bash\n(.*?)```", part.group(1), re.S))
    commands = [re.sub(r"\s+#.*$", "", line).strip() for line in block.splitlines()]
    return [c for c in commands if c]


def test_the_local_walk_through_works_after_the_quickstart_in_the_order_written(state_dir):
    env = {**os.environ, **SMALL}
    quickstart = readme_commands("quickstart")[0]
    install = "pip install -e '.[dev]' && "
    assert quickstart.startswith(install)
    steps = [quickstart[len(install):]] + readme_commands("local")
    assert len(steps) >= 8 and any("scale" in s for s in steps)
    for command in steps:
        result = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, f"`{command}` failed ({result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
        if command.startswith("invoke elasticjob.logs --follow"):
            assert "world=6" in result.stdout, result.stdout[-3000:]  # the scale reached the job: 3 nodes x 2 processes
        if command == "invoke elasticjob.history":
            assert "Succeeded" in result.stderr + result.stdout
    from .test_elasticjob_local import leftover_processes

    assert leftover_processes(state_dir) == []
