"""`invoke setup`'s work in the background (doeks.background, doeks.cluster.prefetch): a failure is one line naming
the step and its log at the wait, a wait is bounded and stops what it gave up on, a failed module prefetch is a
warning and the build goes on, and a machine with everything built starts nothing."""
from __future__ import annotations

import os
import shutil
import time

import pytest

from doeks.background import Background
from doeks.errors import DoeksError


def test_a_failed_step_is_one_line_naming_it_and_its_log_and_the_chain_stops(tmp_path):
    log = tmp_path / "bg.log"
    bg = Background("images", log, stop_on_failure=True)
    bg.add("base image", lambda b: b.run(["sh", "-c", "echo fetching; echo 'E: no route to deb.debian.org' >&2; exit 3"],
                                         timeout=30))
    bg.add("stand-in image", lambda b: "built")
    bg.start()
    with pytest.raises(DoeksError) as raised:
        bg.wait(limit=30)
    said = str(raised.value)
    assert len(said.splitlines()) == 1 and said.startswith("base image (images) failed: 'sh -c ")
    assert "exit code 3: E: no route to deb.debian.org" in said and said.endswith(f"see {log}")
    assert bg.failed["stand-in image"] == "not run: base image failed" and "stand-in image" not in bg.said
    assert "E: no route to deb.debian.org" in log.read_text()


def test_a_wait_past_its_limit_says_so_and_stops_the_command(tmp_path):
    marker = tmp_path / "still-running"
    bg = Background("images", tmp_path / "bg.log")
    bg.add("slow", lambda b: b.run(["sh", "-c", f"sleep 30; touch {marker}"], timeout=60))
    bg.start()
    started = time.monotonic()
    with pytest.raises(DoeksError, match=r"^slow \(images\) did not finish in 2 s: see .*bg\.log$"):
        bg.wait(limit=2)
    assert time.monotonic() - started < 15  # cancel stopped the sleep's process group
    assert bg.done["slow"].wait(5) and not marker.exists()


def test_a_command_past_its_own_limit_fails_its_step(tmp_path):
    bg = Background("images", tmp_path / "bg.log")
    bg.add("slow", lambda b: b.run(["sleep", "30"], timeout=1))
    bg.start()
    with pytest.raises(DoeksError, match=r"slow \(images\) failed: 'sleep 30' did not end in 1 s: see "):
        bg.wait(limit=30)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DOEKS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_nothing_is_prefetched_where_every_build_is_there(cache):
    from doeks.cluster import build, operators, prefetch, registry

    assert [name for name, _ in prefetch.plan()] == ["etcd", "coredns", "training-operator", "trainer", "jobset",
                                                      "mpi-operator", "registry", "eksctl"]
    for path in [build.versions.bin_dir() / name for name in build.BINARIES] + \
                [operators.binary(op) for op in operators.OPERATORS.values()] + [registry.binary()]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    assert prefetch.plan() == []
    assert prefetch.Prefetch().bg is None  # setup run again starts no thread and says nothing of it


@pytest.mark.skipif(shutil.which("go") is None and not os.path.exists("/usr/local/go/bin/go"), reason="no go")
def test_a_failed_prefetch_is_a_warning_naming_its_log_and_the_build_goes_on(cache, tmp_path, monkeypatch, capsys):
    """Go with no proxy and an empty module cache: etcd's `go mod tidy` fails at once; its build would fetch the
    modules itself (and fail there, in its own one line, if the network is really gone)."""
    from doeks.cluster import prefetch

    monkeypatch.setenv("GOPROXY", "off")
    monkeypatch.setenv("GOMODCACHE", str(tmp_path / "gomod"))
    monkeypatch.setenv("GOCACHE", str(tmp_path / "gocache"))
    fetch = prefetch.Prefetch(steps=[("etcd", prefetch._tidy("etcd"))])
    fetch.ready("etcd")  # starts it (the first compile was not reached), waits for it: no exception
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "etcd (prefetch of the Go modules of the later builds) failed: 'go mod tidy' failed " \
                                "with exit code 1" in warned[0], err
    assert warned[0].endswith(f"see {fetch.bg.log} (its build fetches the modules itself)"), warned
    fetch.ready("etcd")
    fetch.finish()
    assert "warning:" not in capsys.readouterr().err  # said once


def test_the_base_image_made_in_the_background_fails_setup_in_one_line_naming_its_log(cache, tmp_path, monkeypatch,
                                                                                        capsys):
    """debootstrap failing (here a stand-in on PATH; nothing reaches docker): setup's end is one error line naming the
    step, debootstrap's last words and the log; the stand-in image after it in the chain is not attempted."""
    from doeks import machine
    from doeks.runner import Runner

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "debootstrap").write_text("#!/bin/sh\necho 'I: Retrieving InRelease'\n"
                                         "echo 'E: Failed getting release file http://deb.debian.org/debian/dists/"
                                         "bookworm/Release' >&2\nexit 1\n")
    (bin_dir / "debootstrap").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setattr(machine, "_base_image_present", lambda runner, name: False)
    from doeks.cluster import images

    monkeypatch.setattr(images, "recipe_built", lambda ref, folder: False)
    bg = machine.start_images(Runner())
    assert f"in the background, beside the Go builds: base image {machine.BASE_IMAGE} (debootstrap, docker import); " \
           "then the nccl-tests stand-in image (docker build nccl-tests/: Open MPI, OpenSSH)" in capsys.readouterr().err
    with pytest.raises(DoeksError) as raised:
        machine.finish_images(bg)
    said = str(raised.value)
    assert len(said.splitlines()) == 1 and said.startswith(f"base image {machine.BASE_IMAGE} (setup's images) failed: "
                                                           "'debootstrap --variant=minbase bookworm' failed with exit code 1: "
                                                           "E: Failed getting release file"), said
    assert said.endswith(f"see {cache / 'setup-images.log'}")
    assert bg.failed["the nccl-tests stand-in image"] == f"not run: base image {machine.BASE_IMAGE} failed"
