"""`invoke dev.mutate` (dev/tasks.py) follows the code: its MODULES and pyproject.toml's [tool.mutmut] (what mutmut
itself reads) name the same files and tests, and every file and test they name is there. A test renamed or moved
would otherwise leave its module's mutants to no test, found only hours into a mutation run."""
from __future__ import annotations

import re

from .conftest import ROOT, invoke


def test_the_mutation_modules_and_mutmuts_configuration_agree_and_name_what_exists():
    from dev import tasks

    assert tasks._configured() == tasks.MODULES_TESTS
    for name, (file, mutants, tests) in tasks.MODULES.items():
        assert (ROOT / file).is_file(), (name, file)
        assert mutants.startswith(file[:-len(".py")].replace("/", ".") + "."), (name, mutants)  # mutmut's names
        for test in tests:
            path, _, function = test.partition("::")
            assert (ROOT / path).is_file(), (name, test)
            if function:
                assert re.search(rf"^def {re.escape(function)}\(", (ROOT / path).read_text(), re.M), (name, test)


def test_dry_run_names_the_files_the_tests_and_the_commands():
    result = invoke("dev.mutate", "--dry-run", "--modules", "checkpoints,watchdog", timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "would mutate: doeks/pod/watchdog.py, doeks/workload/checkpoints.py" in out, out
    assert "python -m mutmut run doeks.workload.checkpoints.* doeks.pod.watchdog.*" in out, out
    refused = invoke("dev.mutate", "--modules", "watchdog,nope", timeout=120)
    assert refused.returncode == 1 and refused.stderr.strip().splitlines()[-1].startswith(
        "error: --modules 'watchdog,nope': nope not among reasons,"), refused.stderr


FAKE_MUTMUT = """import sys
if sys.argv[1] == "run":
    print("failed to collect stats. runner returned 1")
    sys.exit(1)
print("    doeks.keys.x_parse__mutmut_1: survived")  # what an earlier run left in mutants/
"""


def test_a_failed_mutmut_run_is_a_failed_task_not_an_earlier_runs_score(tmp_path):
    """mutmut exits 1 when its stats or the clean test run fail; `results` then still lists an earlier run's verdicts,
    which the task printed as this run's score, with exit 0."""
    fake = tmp_path / "mutmut"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "__main__.py").write_text(FAKE_MUTMUT)
    result = invoke("dev.mutate", "--modules", "keys", env={"PYTHONPATH": f"{tmp_path}:{ROOT}"}, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: mutmut run failed (exit 1)"), result.stderr
    assert "score" not in result.stdout, result.stdout
