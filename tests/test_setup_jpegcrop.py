"""The loader's fast path on the host: `invoke setup` builds `_jpegcrop` next to doeks/workload/train.py where a C
compiler and libjpeg-turbo's headers are (the local target ran without it: only the training image built it, and
the bench measured 1.77x instead of 2.00-2.13x without saying which), or says why not; the bench names the decode
path it measured."""
from __future__ import annotations

import shutil
import sys

import pytest

from doeks import machine
from doeks.runner import Runner
from doeks.workload import jpegcrop_build

from .conftest import ROOT, invoke


# what a fresh clone lacks, or what `invoke setup` does not need, left out of the test's copy of the checkout
NOT_COPIED = shutil.ignore_patterns(".git", ".doeks", "mutants", "__pycache__", "*.egg-info", ".pytest_cache",
                                    ".hypothesis", "build", "dist", ".whl", ".gl", ".build", "_jpegcrop*.so")


@pytest.fixture
def project(tmp_path):
    """A copy of the checkout as a fresh clone has it (the module not built): `invoke setup` builds into the copy, and
    the checkout's own module stays where tests beside this one (another xdist worker) train with it (moved away, a
    run's decode changed in the middle: docs/loader.md, the region path's chroma)."""
    copy = tmp_path / "project"
    shutil.copytree(ROOT, copy, ignore=NOT_COPIED)
    return copy


def test_setup_builds_the_loaders_region_decode_here_and_says_so(project):
    if jpegcrop_build.missing():
        pytest.skip(f"this machine cannot build it: {jpegcrop_build.missing()}")
    built = jpegcrop_build.target(project / "doeks" / "workload")
    assert not built.exists()
    first = invoke("setup", cwd=project)
    assert first.returncode == 0, first.stderr[-2000:]
    assert f"loader: _jpegcrop (region decode) built: {built}" in first.stderr and built.is_file()
    stamp = built.stat().st_mtime
    again = invoke("setup", cwd=project)
    assert f"loader: _jpegcrop (region decode) built: {built}" in again.stderr
    assert built.stat().st_mtime == stamp and "build the loader" not in again.stderr  # idempotent
    probe = invoke("setup", "--dry-run", cwd=project)
    assert probe.returncode == 0


def test_setup_says_why_it_cannot_build_it(tmp_path, monkeypatch, capsys):
    target, up_to_date = jpegcrop_build.target, jpegcrop_build.up_to_date
    monkeypatch.setattr(jpegcrop_build, "target", lambda folder=tmp_path: target(folder))  # a folder without it
    monkeypatch.setattr(jpegcrop_build, "up_to_date", lambda folder=tmp_path: up_to_date(folder))
    monkeypatch.setattr(jpegcrop_build, "compiler", lambda: ["doeks-no-such-cc"])
    assert machine.ensure_jpegcrop(Runner(echo=False)) == "no C compiler (doeks-no-such-cc)"
    assert not jpegcrop_build.target().exists()
    assert "loader: _jpegcrop not built (no C compiler (doeks-no-such-cc)): simplejpeg decodes whole images" in \
        capsys.readouterr().err.replace("\n", " ")


def test_the_bench_names_the_decode_path_it_measured(monkeypatch):
    sys.path.insert(0, str(ROOT / "bench"))
    import train_throughput

    from doeks.workload import loader

    monkeypatch.setattr(loader, "CROP_DECODE", {"region": 672, "scaled": 0, "fallback": 0})
    assert train_throughput.decode_path() == "_jpegcrop region decode"
    monkeypatch.setattr(loader, "CROP_DECODE", {"region": 0, "scaled": 672, "fallback": 0})
    monkeypatch.setattr(loader, "_jpegcrop", lambda: None)
    assert train_throughput.decode_path() == ("simplejpeg whole-image decode: _jpegcrop not built (`invoke setup` "
                                              "builds it)")
