"""Developer tasks (not a unit: nothing here is deployed): `invoke dev.mutate`, a mutation run over the modules where
a wrong line costs users most.

mutmut (PyPI, `pip install -e '.[mutation]'`) changes one thing at a time in a function (an operator, a constant, a
string, an argument) and runs the tests that reached that function: a change no test notices "survives", and is
either a missing test or a change that cannot matter (docs/testing.md lists the survivors of the last run and why
each is left). Configuration: `[tool.mutmut]` in pyproject.toml; the modules and the fast, in-process tests that
cover each are MODULES below (mutmut only sees code the test process runs itself, not a `python -m invoke` child's).
It works in `mutants/` (git-ignored) and keeps results there: a later run tests again only what changed.

Not in CI's default run: the whole set takes hours on 2 cores. `invoke dev.mutate --modules reasons,sampler` runs
part; `--dry-run` prints what it would mutate and run.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from invoke import Collection

from doeks.taskkit import Int, task

ROOT = Path(__file__).resolve().parent.parent

# the fast tests of the checkpoint modules (not the ones that run the code in a child process, `invoke` or torchrun,
# nor the one that trains a model)
CHECKPOINT_TESTS = ["tests/test_checkpoint_decode.py", "tests/test_checkpoints_direct.py"] + [
    f"tests/test_checkpoints_connector.py::test_{name}" for name in (
        "s3_checkpoint_through_the_connector_restores_with_its_dcp_reader",
        "the_connector_clients_are_made_once_per_process_not_per_checkpoint",
        "a_resume_asks_s3_only_what_it_needs",
        "a_prefetched_checkpoint_loads_from_memory_and_one_that_failed_as_usual",
        "a_prefetch_counts_every_rank_of_the_node_against_its_memory")]

# name -> (file, the mutant names to run (mutmut's: module.x_function / module.xǁClassǁmethod), tests that cover it)
MODULES = {
    "reasons": ("doeks/pod/reasons.py", "doeks.pod.reasons.*",
                ["tests/test_reasons.py", "tests/test_status_local.py::test_taxonomy_decides_permanent_or_transient",
                 "tests/test_your_own_script.py::test_an_exception_is_the_scripts_reason_only_when_its_own_code_raised_it"]),
    "sampler": ("doeks/workload/train.py", "doeks.workload.train.xǁResumableSamplerǁ*", ["tests/test_sampler.py"]),
    "settings": ("doeks/settings.py", "doeks.settings.*", ["tests/test_settings.py", "tests/test_config.py"]),
    "keys": ("doeks/keys.py", "doeks.keys.*", ["tests/test_settings.py", "tests/test_config.py"]),
    "stager": ("doeks/datastage.py", "doeks.datastage.*", ["tests/test_stage.py"]),
    "manifests": ("doeks/jobspec.py", "doeks.jobspec.*", ["tests/test_jobspec.py", "tests/test_kubeflow_pytorchjob.py"]),
    "audit": ("doeks/audit.py", "doeks.audit.*", ["tests/test_first_run.py"]),
    "teardown": ("doeks/storage.py", "doeks.storage.*",
                 ["tests/test_csi.py", "tests/test_stage_fsx.py",
                  "tests/test_teardown.py::test_fsx_delete_keeps_role_and_group_until_the_driver_deleted_its_file_system"]),
    "guard": ("doeks/cluster/guard.py", "doeks.cluster.guard.*", ["tests/test_network_guard.py"]),
    "checkpoints": ("doeks/workload/checkpoints.py", "doeks.workload.checkpoints.*", CHECKPOINT_TESTS),
    "checkpoint-read": ("doeks/workload/checkpoint_read.py", "doeks.workload.checkpoint_read.*", CHECKPOINT_TESTS),
    "checkpoint-s3": ("doeks/workload/checkpoint_s3.py", "doeks.workload.checkpoint_s3.*", CHECKPOINT_TESTS),
    "torchrun": ("doeks/pod/torchrun.py", "doeks.pod.torchrun.*",
                 ["tests/test_rendezvous_wait.py"] + [f"tests/test_script_errors.py::test_{name}" for name in (
                     "an_agent_that_finds_its_runs_rendezvous_closed_ends_in_a_pod_only_after_a_while",
                     "an_agent_that_ended_for_good_keeps_its_container_a_while_in_a_pod",
                     "the_jobs_manifest_tells_its_containers_to_wait_before_they_end_for_good")]),
    "watchdog": ("doeks/pod/watchdog.py", "doeks.pod.watchdog.*", ["tests/test_watchdog_local.py"]),
    "kueue": ("doeks/kueue.py", "doeks.kueue.*", [f"tests/test_kueue.py::test_{name}" for name in (
        "queue_label_and_one_block_on_both_job_kinds", "without_a_queue_jobs_carry_nothing_of_kueue",
        "bad_queue_settings_name_the_key", "doctor_rule_for_kueue_and_trainer",
        "simulated_p5_nodes_are_eks_shaped_and_spread_in_blocks",
        "on_doeks_cluster_the_simulated_type_is_a_tas_flavor_beside_the_node")]),
    "jobpaths": ("doeks/jobpaths.py", "doeks.jobpaths.*",
                 ["tests/test_job_role.py",
                  "tests/test_job_identity.py::test_the_job_name_comes_from_the_code_and_the_folders_from_one_function",
                  "tests/test_eks_outputs.py::test_the_target_decides_where_checkpoints_and_the_model_go_when_the_user_"
                  "names_nothing"]),
    "catalog": ("doeks/catalog.py", "doeks.catalog.*", ["tests/test_first_run.py"]),
    "follow": ("doeks/targets/follow.py", "doeks.targets.follow.*",
               ["tests/test_status_eks.py::test_follow_ends_a_job_with_a_permanent_reason",
                "tests/test_status_eks.py::test_follow_of_a_succeeded_job_waits_for_its_replicas_still_leaving",
                "tests/test_status_eks.py::test_a_replica_still_running_after_the_wait_is_named_with_how_to_stop_it"]),
}
SCORE = re.compile(r"^\s*(?P<name>\S+): (?P<status>killed|survived|no tests|timeout|suspicious|skipped|not checked|"
                   r"segfault|check was interrupted by user|caught by type check)$")


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(1)


def _chosen(modules: str) -> list[str]:
    names = [m.strip() for m in modules.split(",") if m.strip()] if modules else list(MODULES)
    unknown = [m for m in names if m not in MODULES]
    if unknown or not names:
        _fail(f"--modules {modules!r}: {', '.join(unknown) or 'none given'} not among {', '.join(MODULES)}")
    return names


def _mutmut(*args: str) -> list[str]:
    return [sys.executable, "-m", "mutmut", *args]


def summarize(results: str, names: list[str]) -> tuple[dict[str, dict[str, int]], list[str]]:
    """Counts by module and status, and the survivors, from `mutmut results --all true`."""
    counts: dict[str, dict[str, int]] = {n: {} for n in names}
    survivors = []
    for line in results.splitlines():
        match = SCORE.match(line)
        if not match:
            continue
        mutant = match["name"]
        module = next((n for n in names if re.fullmatch(MODULES[n][1].replace(".", r"\.").replace("*", ".*"),
                                                        mutant)), None)
        if module is None:
            continue
        counts[module][match["status"]] = counts[module].get(match["status"], 0) + 1
        if match["status"] == "survived":
            survivors.append(mutant)
    return counts, survivors


@task(help={"modules": f"comma-separated, of: {', '.join(MODULES)} (default: all; hours on 2 cores)",
            "dry_run": "print the files it would mutate, the tests and the commands; run nothing",
            "max_children": "mutants tested at once (default 0: mutmut's, the CPU count)"},
      flags={"max_children": Int(0, 256)})
def mutate(c, modules="", dry_run=False, max_children=0):
    """Mutation run over the modules where a wrong line costs most; prints each one's score and the survivors."""
    names = _chosen(modules)
    files = sorted({MODULES[n][0] for n in names})
    tests = sorted({t for n in names for t in MODULES[n][2]})
    env = {**os.environ, "DOEKS_SCHEMAS": os.environ.get("DOEKS_SCHEMAS", str(ROOT.parent / "shared" / "schemas"))}
    run = _mutmut("run", *(["--max-children", str(max_children)] if max_children else []), *(MODULES[n][1] for n in names))
    if dry_run:
        print(f"would mutate: {', '.join(files)} (in {ROOT / 'mutants'}, git-ignored)")
        print(f"with the tests that reach each function, of: {' '.join(tests)}")
        print("would run: python " + " ".join(run[1:]))
        print("would run: python " + " ".join(_mutmut("results", "--all", "true")[1:]))
        return
    try:
        import mutmut  # noqa: F401
    except ImportError:
        _fail("mutmut is not installed: pip install -e '.[mutation]'")
    configured = _configured()
    if configured != MODULES_TESTS:
        _fail("pyproject.toml's [tool.mutmut] differs from dev/tasks.py's MODULES: make them list the same files and tests")
    print("running: python " + " ".join(run[1:]), flush=True)
    ran = subprocess.run(run, cwd=ROOT, env=env, check=False)  # its progress on the terminal; its verdicts read below
    if ran.returncode != 0:  # its stats or the clean run failed: `results` would show an earlier run's verdicts
        _fail(f"mutmut run failed (exit {ran.returncode}): its output above says why (a test failing on the code "
              "as it is, or no test reaching the modules); no score is given for this run")
    results = subprocess.run(_mutmut("results", "--all", "true"), cwd=ROOT, env=env, capture_output=True, text=True)
    counts, survivors = summarize(results.stdout, names)
    for name in names:
        by = counts[name]
        unchecked = by.get("not checked", 0) + by.get("check was interrupted by user", 0)
        tested = sum(by.values()) - by.get("no tests", 0) - by.get("skipped", 0) - unchecked
        caught = by.get("killed", 0) + by.get("timeout", 0)
        score = f"{100 * caught / tested:.1f}%" if tested else "n/a"
        print(f"{name:9} {MODULES[name][0]:28} score {score:>6}: {caught} of {tested} killed, "
              f"{by.get('survived', 0)} survived, {by.get('no tests', 0)} reached by no fast test"
              + (f", {unchecked} not run (an interrupted run: run again)" if unchecked else ""))
    for mutant in survivors:
        print(f"survived: {mutant}  (python -m mutmut show {mutant})")
    if not any(counts[n] for n in names):
        _fail("mutmut reported no mutant: see its output above")


MODULES_TESTS = (sorted({m[0] for m in MODULES.values()}), sorted({t for m in MODULES.values() for t in m[2]}))


def _configured() -> tuple[list[str], list[str]]:
    """The files and tests pyproject.toml's [tool.mutmut] names (what mutmut itself reads)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: mutmut reads it with `toml`
        import toml as tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    return sorted(config["only_mutate"]), sorted(config["pytest_add_cli_args_test_selection"])


ns = Collection("dev", mutate)
