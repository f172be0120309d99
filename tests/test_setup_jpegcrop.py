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


@pytest.fixture
def without_module(tmp_path):
    """The module as a fresh clone has it: not built (what was built is put back afterwards)."""
    built = jpegcrop_build.target()
    kept = tmp_path / built.name
    if built.exists():
        shutil.move(built, kept)
    yield built
    if kept.exists():
        built.unlink(missing_ok=True)
        shutil.move(kept, built)


def test_setup_builds_the_loaders_region_decode_here_and_says_so(without_module):
    if jpegcrop_build.missing():
        pytest.skip(f"this machine cannot build it: {jpegcrop_build.missing()}")
    first = invoke("setup")
    assert first.returncode == 0, first.stderr[-2000:]
    assert f"loader: _jpegcrop (region decode) built: {without_module}" in first.stderr and without_module.is_file()
    stamp = without_module.stat().st_mtime
    again = invoke("setup")
    assert f"loader: _jpegcrop (region decode) built: {without_module}" in again.stderr
    assert without_module.stat().st_mtime == stamp and "build the loader" not in again.stderr  # idempotent
    probe = invoke("setup", "--dry-run")
    assert probe.returncode == 0


def test_setup_says_why_it_cannot_build_it(without_module, monkeypatch, capsys):
    monkeypatch.setattr(jpegcrop_build, "compiler", lambda: ["doeks-no-such-cc"])
    assert machine.ensure_jpegcrop(Runner(echo=False)) == "no C compiler (doeks-no-such-cc)"
    assert not without_module.exists()
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
