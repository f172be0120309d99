"""Defects found by using the CLI as a new user would (review of issues 12 item 4 and 15), each with the test that
fails without its fix."""
from __future__ import annotations

from doeks import settings as S
from doeks.targets import runs

from .conftest import invoke


def test_history_run_ids_are_whole_when_piped(state_dir):
    # `elasticjob.history` is where a user copies the id `logs --run` takes; piped (a script, `| grep`, CI) rich cut
    # its cells at 80 columns to `20261122-2…`, an id no command accepts
    s = S.current()
    run = "20261122-221045-74c2"
    runs.start(s, "local", run)
    result = invoke("elasticjob.history", env={"TARGET": "local", "COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    assert run in result.stderr and "…" not in result.stderr, result.stderr
    line = next(line for line in result.stderr.splitlines() if run in line)
    assert "Running" in line and "local" in line
