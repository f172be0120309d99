"""docs/mechanism.md's map says where each unit's logic lives (issue 37: a unit folder and its core module do not
always share a name, so one table says which file holds each); this keeps it true: every unit `tasks.py` mounts is in
it, and every folder, file and target verb it names exists."""
from __future__ import annotations

import re

from .conftest import ROOT


def _rows() -> list[list[str]]:
    text = (ROOT / "docs" / "mechanism.md").read_text()
    table = text.split("<!-- unit-map:start -->")[1].split("<!-- unit-map:end -->")[0]
    lines = [line for line in table.strip().splitlines()[2:] if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def _paths(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_every_unit_is_in_the_map_and_every_name_in_it_exists():
    import importlib.util

    from doeks.targets.base import Target

    spec = importlib.util.spec_from_file_location("doeks_root_tasks", ROOT / "tasks.py")
    tasks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tasks)
    rows = _rows()
    folders = {row[0].strip("`") for row in rows}
    # the units of `up`/`down` (a collection without UNIT, as dev/'s tools, is no unit)
    assert folders == {path.split("/")[0] + "/" for name, path in tasks.UNIT_FILES.items()
                       if getattr(tasks.UNITS[name], "UNIT", None)}
    for folder, task_files, modules, verbs in rows:
        assert (ROOT / folder.strip("`")).is_dir(), folder
        for path in _paths(task_files) + _paths(modules):
            assert (ROOT / path).exists(), f"{folder}: {path} does not exist"
        for verb in _paths(verbs):
            assert callable(getattr(Target, verb, None)), f"{folder}: Target has no verb {verb}"
