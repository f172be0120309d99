"""Build the cluster's binaries from the Go module proxy, once per version, into the user cache folder.

- `doeks-node`: kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and kube-proxy of k8s.io/kubernetes
  in one executable (one link instead of five). `k8s.io/kubernetes` cannot be `go install`ed: it is built as a
  dependency of a small module whose go.mod `replace`s every staging module (k8s.io/api, client-go, ...) by its
  published v0.x.y, as kubernetes-sigs/scheduler-plugins does.
- `etcd` (go.etcd.io/etcd/server/v3) for the API server, `coredns` with only the plugins doeks' Corefile uses.
- `pause`, a static C program, for the pod sandboxes.

The Go sources are doeks' own (doeks/cluster/go/*/main.go); go.mod is written here from the pinned versions. The Go
build and module caches stay where Go keeps them, so a second build (or a later run on the same machine) is quick.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from .. import ui
from ..errors import DoeksError, MissingTool
from . import versions

SOURCES = Path(__file__).resolve().parent / "go"
PAUSE_SOURCE = Path(__file__).resolve().parent / "images" / "pause" / "pause.c"
BINARIES = ("doeks-node", "etcd", "coredns", "pause")


def built() -> dict[str, Path]:
    """The binaries already built for the pinned versions."""
    return {name: versions.bin_dir() / name for name in BINARIES if (versions.bin_dir() / name).exists()}


def missing() -> list[str]:
    return [name for name in BINARIES if not (versions.bin_dir() / name).exists()]


def go() -> str:
    found = shutil.which("go") or ("/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists() else None)
    if not found:
        raise MissingTool("go is not installed: doeks builds its cluster from the Go module proxy (Go 1.25 or newer)")
    return found


def _env(static: bool = True) -> dict[str, str]:
    """Go's environment: static binaries (CGO off) for what goes into an image FROM scratch; the host's binaries are
    built as Go builds by default."""
    env = dict(os.environ)
    env.setdefault("GOTOOLCHAIN", "local")
    if static:
        env["CGO_ENABLED"] = "0"
    env["GOFLAGS"] = "-mod=mod"
    return env


def _go(args: list[str], cwd: Path, what: str, log, static: bool = True) -> None:
    """One go command with its output in the build log and a line of progress per minute (and per module fetched)."""
    argv = [go()] + args
    log.write(f"$ {' '.join(argv)}  (in {cwd})\n")
    log.flush()
    started = time.monotonic()
    process = subprocess.Popen(argv, cwd=cwd, env=_env(static), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    assert process.stdout is not None
    fetched = 0
    last_said = started
    tail: list[str] = []
    for line in process.stdout:
        log.write(line)
        tail = (tail + [line.rstrip()])[-5:]
        if line.startswith("go: downloading"):
            fetched += 1
        now = time.monotonic()
        if now - last_said > 30:
            ui.say(f"  {what}: {now - started:.0f}s" + (f", {fetched} modules fetched" if fetched else ""), style="dim")
            last_said = now
    # go prints nothing while it compiles: say how long it has been once a minute until it ends
    while process.poll() is None:
        time.sleep(1)
    if process.wait() != 0:
        detail = "; ".join(line for line in tail if line)[-400:]
        raise DoeksError(f"{what} failed ({detail}): the whole log is in {log.name}")


def _compile(argv: list[str], cwd: Path, what: str, log, static: bool = True) -> None:
    """A long compile: a line every 60 s so a user sees it is alive (go build is silent while it works)."""
    import threading

    started = time.monotonic()
    done = threading.Event()

    def tick():
        while not done.wait(60):
            ui.say(f"  {what}: still compiling, {time.monotonic() - started:.0f}s", style="dim")

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        _go(argv, cwd, what, log, static)
    finally:
        done.set()


def staging_replaces(kubernetes_dir: Path, version: str) -> list[tuple[str, str]]:
    """Every staging module k8s.io/kubernetes replaces with ./staging/..., mapped to its published v0.MINOR.PATCH."""
    text = (kubernetes_dir / "go.mod").read_text()
    staged = re.findall(r"^\s*(k8s\.io/[\w.-]+)\s+=>\s+\./staging/", text, flags=re.M)
    if not staged:
        raise DoeksError(f"no staging modules found in {kubernetes_dir / 'go.mod'}: is this k8s.io/kubernetes?")
    published = "v0." + version.split(".", 1)[1]
    return [(module, published) for module in staged]


def _module_dir(module: str, version: str, cwd: Path, log) -> Path:
    argv = [go(), "mod", "download", "-json", f"{module}@{version}"]
    result = subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True)
    log.write(result.stdout + result.stderr)
    if result.returncode != 0:
        reason = (result.stderr.strip().splitlines() or result.stdout.strip().splitlines() or ["no output"])[-1]
        raise DoeksError(f"go mod download {module}@{version} failed: {reason}")
    import json

    return Path(json.loads(result.stdout)["Dir"])


def write_module(name: str, where: Path, log) -> Path:
    """The build module for one binary: doeks' main.go and a go.mod for the pinned versions."""
    where.mkdir(parents=True, exist_ok=True)
    shutil.copy(SOURCES / name / "main.go", where / "main.go")
    lines = [f"module doeks.local/{name}", "", "go 1.25.0", ""]
    if name == "node":
        k8s = _module_dir("k8s.io/kubernetes", f"v{versions.KUBERNETES}", where, log)
        lines += [f"require k8s.io/kubernetes v{versions.KUBERNETES}", "", "replace ("]
        lines += [f"\t{module} => {module} {version}" for module, version in staging_replaces(k8s, versions.KUBERNETES)]
        lines += [")"]
    elif name == "etcd":
        lines += [f"require go.etcd.io/etcd/server/v3 v{versions.ETCD}"]
    elif name == "coredns":
        lines += [f"require github.com/coredns/coredns v{versions.COREDNS}"]
    (where / "go.mod").write_text("\n".join(lines) + "\n")
    return where


def build(runner, force: bool = False, prefetch=None) -> dict[str, Path]:
    """Build what is missing (everything with `force`); print the time it took. `prefetch` (doeks.cluster.prefetch):
    started once doeks-node compiles, and waited for before each later Go build."""
    todo = list(BINARIES) if force else missing()
    out = versions.bin_dir()
    if not todo:
        ui.say(f"cluster binaries for Kubernetes {versions.KUBERNETES}: already built in {out}")
        return built()
    plan = {"doeks-node": f"Kubernetes v{versions.KUBERNETES} (kube-apiserver, kube-controller-manager, kube-scheduler, "
                          "kubelet, kube-proxy) as one binary",
            "etcd": f"etcd v{versions.ETCD}", "coredns": f"CoreDNS v{versions.COREDNS} (kubernetes, cache, health, "
                                                                 "ready, errors, log, loop, reload, loadbalance plugins)",
            "pause": f"pause {versions.PAUSE} (static C)"}
    if runner.dry_run:
        for name in todo:
            runner.step(f"build {plan[name]} from the Go module proxy into {out / name}", lambda: None)
        return {}
    go()
    out.mkdir(parents=True, exist_ok=True)
    log_path = versions.build_dir() / "build.log"
    started = time.monotonic()
    ui.say(f"building {len(todo)} binaries for doeks' cluster into {out} (log: {log_path}); a first build fetches "
           "the modules and compiles for tens of minutes on 2 cores", style="bold")
    with open(log_path, "a") as log:
        for name in todo:
            began = time.monotonic()
            ui.say(f"- {plan[name]}")
            if name == "pause":
                _pause(out, log)
            else:
                if prefetch is not None and name != "doeks-node":
                    prefetch.ready(name)  # its modules fetched while doeks-node compiled
                module = {"doeks-node": "node"}.get(name, name)
                where = write_module(module, versions.build_dir() / "src" / module, log)
                _go(["mod", "tidy"], where, f"{name}: go mod tidy", log)
                if prefetch is not None:
                    prefetch.start()  # the first compile: the later builds' modules are fetched meanwhile
                target = out / f".{name}.partial"
                _compile(["build", "-trimpath", f"-ldflags={ldflags(name)}", "-o", str(target), "."], where,
                         f"{name}: go build", log, static=name != "doeks-node")  # CoreDNS and etcd run FROM scratch or anywhere
                target.replace(out / name)
            ui.say(f"  {name}: built in {time.monotonic() - began:.0f}s")
    ui.say(f"cluster binaries built in {time.monotonic() - started:.0f}s ({out})", style="bold")
    return built()


def ldflags(name: str) -> str:
    """-s -w, and for Kubernetes the version its components report (upstream sets it the same way, with -X, in
    hack/lib/version.sh): without it the node says v0.0.0-master and clients cannot tell what they talk to."""
    flags = ["-s", "-w"]
    if name == "doeks-node":
        major, minor, _ = versions.KUBERNETES.split(".")
        values = {"gitVersion": f"v{versions.KUBERNETES}", "gitMajor": major, "gitMinor": minor,
                  "gitTreeState": "clean", "buildDate": "1970-01-01T00:00:00Z"}
        for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
            flags += [f"-X {package}.{key}={value}" for key, value in values.items()]
    return " ".join(flags)


def _pause(out: Path, log) -> None:
    cc = shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise MissingTool("gcc is not installed: apt-get install gcc (the pause program is a few lines of C)")
    argv = [cc, "-static", "-O2", "-o", str(out / "pause"), str(PAUSE_SOURCE)]
    result = subprocess.run(argv, capture_output=True, text=True)
    log.write(result.stdout + result.stderr)
    if result.returncode != 0:
        raise DoeksError(f"building pause failed: {(result.stderr.strip().splitlines() or ['?'])[-1]}")
