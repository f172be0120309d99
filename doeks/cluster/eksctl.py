"""eksctl, built here from its Go module by `build_binary()` (not by `invoke setup`: minutes to an hour on 2 cores) (github.com/weaveworks/eksctl
v0.215.0, the newest the Go module proxy serves; its go.mod replaces the Kubernetes libraries, so it is built as a
dependency of a small module that repeats those replaces, as doeks' node is). The EKS rehearsal runs its own
validation of doeks' ClusterConfig, `eksctl create cluster --dry-run -f`, against the rehearsal's account, with any
other address refused (a proxy on a closed loopback port)."""
from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

from .. import ui
from ..errors import DoeksError
from . import build, versions

MODULE = "github.com/weaveworks/eksctl"
VERSION = "v0.215.0"


def home() -> Path:
    return versions.cache_dir() / f"eksctl-{VERSION}"


def binary() -> Path:
    return home() / "eksctl"


def built() -> bool:
    return binary().exists()


def module() -> Path:
    """eksctl's module in Go's module cache (downloaded once): its schema is pkg/apis/eksctl.io/v1alpha5/assets."""
    from .operators import Operator, module_dir

    return module_dir(Operator("eksctl", MODULE, VERSION, "cmd/eksctl", "eksctl", "", ""))


def build_binary(runner=None) -> Path:
    """eksctl at VERSION, once (minutes: the AWS SDK and Kubernetes libraries)."""
    out = binary()
    if out.exists():
        return out
    if runner is not None and runner.dry_run:
        runner.step(f"build eksctl {VERSION} from the Go module proxy into {out}", lambda: None)
        return out
    where = home() / "src"
    where.mkdir(parents=True, exist_ok=True)
    source = module()
    replaces = re.search(r"^replace \($.*?^\)$", (source / "go.mod").read_text(), flags=re.M | re.S)
    (where / "go.mod").write_text(f"module doeks.local/eksctl\n\ngo 1.25.1\n\nrequire {MODULE} {VERSION}\n\n"
                                  + (replaces.group(0) + "\n" if replaces else ""))
    started = time.monotonic()
    ui.say(f"building eksctl {VERSION} from the Go module proxy (long: the AWS SDK and Kubernetes libraries)")
    with open(home() / "build.log", "a") as log:
        partial = out.with_suffix(".partial")
        build._compile(["build", "-trimpath", "-ldflags=-s -w", "-o", str(partial), f"{MODULE}/cmd/eksctl"], where,
                       "eksctl: go build", log)
        partial.replace(out)
    ui.say(f"  eksctl: built in {time.monotonic() - started:.0f}s")
    return out


def validate(settings, path: Path) -> None:
    """`eksctl create cluster --dry-run -f PATH`: eksctl's own checks of the config (one error line when it refuses
    it); said and skipped when eksctl is not built here."""
    if not built():
        ui.say(f"eksctl is not built here ({binary()}): the ClusterConfig is checked against eksctl's schema by the "
               "tests only", style="dim")
        return
    from .node import NO_PULL_ENV

    endpoint = settings.aws_endpoint_url or os.environ.get("AWS_ENDPOINT_URL")
    if not endpoint:
        raise DoeksError("eksctl --dry-run is run against the rehearsal's account only: no AWS_ENDPOINT_URL")
    env = {**os.environ, **NO_PULL_ENV, "AWS_ENDPOINT_URL": endpoint,
           "AWS_REGION": settings.aws_region, "AWS_EC2_METADATA_DISABLED": "true"}
    result = subprocess.run([str(binary()), "create", "cluster", "--dry-run", "-f", str(path)], capture_output=True,
                            text=True, env=env, timeout=300)
    if result.returncode != 0:
        reason = (result.stderr.strip().splitlines() or result.stdout.strip().splitlines() or ["?"])[-1]
        raise DoeksError(f"eksctl create cluster --dry-run refuses {path}: {reason}")
    ui.say(f"eksctl {VERSION} --dry-run accepts {path.name}")
