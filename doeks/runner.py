"""The one place side effects go through: shell commands, mutating API calls and applied manifests.

With `dry_run` nothing changes: manifests are printed as a YAML stream on stdout (pipe it into `kubectl apply -f -`),
commands and API requests are printed on stderr. Secrets are masked everywhere.
"""
from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path
from typing import Any, Iterable, Sequence

from . import ui
from .errors import CONNECT_FIX, KUBE_NOISE, DoeksError, MissingTool, NotConnected, kube_unreachable


UNKNOWN: list[str] = []  # every lookup a dry run in this process could not make
PLANNED: set[str] = set()  # every line a dry run in this process printed: each is printed once (`down` runs
#                            several units' runners; csi's and eks' both remove the csi roles)


class Runner:
    def __init__(self, dry_run: bool = False, secrets: Iterable[str] = (), echo: bool = True):
        self.dry_run = dry_run
        self.secrets = [s for s in secrets if s]
        self.echo = echo
        self.planned: list[str] = []  # what a dry run would have done, in order
        self.unknowns: list[str] = []  # what a dry run could not look up (no credentials): shown as unknown

    # -- output ---------------------------------------------------------------------------------------------------
    def mask(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "****")
        return text

    def note(self, message: str) -> None:
        if self.echo:
            ui.say(self.mask(message), style="dim")

    def _plan(self, line: str) -> None:
        line = self.mask(line)
        self.planned.append(line)
        if self.dry_run and line in PLANNED:  # planned above by another unit: once is the plan
            return
        PLANNED.add(line)
        ui.say(("would " if self.dry_run else "") + line, style="cyan")

    def unknown(self, what: str, reason: str = "no credentials") -> str:
        """A dry run's lookup that could not be made: said once, recorded, and the plan goes on."""
        text = f"<unknown: {reason}>"
        if what not in self.unknowns:
            self.unknowns.append(what)
        if what not in UNKNOWN:  # said once per process (`up`/`down` run several units' runners)
            UNKNOWN.append(what)
            ui.say(self.mask(f"unknown: {what} {text}"), style="yellow")
        return text

    def was_unknown(self, what: str) -> bool:
        """Whether this dry run could not make the lookup `what` (it may exist: plan its deletion as unknown)."""
        return what in self.unknowns or what in UNKNOWN

    # -- commands -------------------------------------------------------------------------------------------------
    def run(self, argv: Sequence[str], *, mutating: bool = True, check: bool = True, capture: bool = False,
            env: dict[str, str] | None = None, cwd: str | None = None, input: str | None = None,
            ) -> subprocess.CompletedProcess | None:
        """Run a command; in a dry run a mutating command is only printed (returns None)."""
        argv = [str(a) for a in argv]
        line = "run: " + shlex.join(argv)
        if self.dry_run and mutating:
            self._plan(line)
            return None
        if self.echo:
            ui.say(self.mask("$ " + shlex.join(argv)), style="dim")
        if shutil.which(argv[0]) is None and "/" not in argv[0]:
            raise MissingTool(f"'{argv[0]}' is not installed or not on PATH: install it or use the management container (invoke build run)")
        kube = Path(argv[0]).name in ("kubectl", "helm")
        try:
            if kube and not capture:
                result = _run_filtered(argv, env=env, cwd=cwd, input=input)
            else:
                result = subprocess.run(argv, check=False, text=True, env=env, cwd=cwd, input=input,
                                        stdout=subprocess.PIPE if capture else sys.stderr,
                                        stderr=subprocess.PIPE if capture else None)
        except OSError as exc:
            raise DoeksError(f"could not start {argv[0]}: {exc.strerror}") from None
        if kube and result.returncode != 0 and kube_unreachable(result.stderr or ""):
            reason = next((line.strip() for line in (result.stderr or "").splitlines()
                           if line.strip() and not KUBE_NOISE.match(line) and kube_unreachable(line)), "no kubeconfig")
            raise NotConnected(self.mask(f"'{shlex.join([Path(argv[0]).name] + argv[1:3])}' cannot reach a cluster "
                                         f"({reason[:160]}): {CONNECT_FIX}"))
        if check and result.returncode != 0:
            detail = [line for line in (result.stderr or "").strip().splitlines() if not KUBE_NOISE.match(line)][-1:] \
                if (capture or kube) else []
            raise DoeksError(self.mask(f"'{shlex.join(argv[:3])}' failed with exit code {result.returncode}"
                                       + (f": {detail[0]}" if detail else "")))
        return result

    # -- API calls ------------------------------------------------------------------------------------------------
    def call(self, client: Any, operation: str, **params: Any) -> dict | None:
        """A mutating boto3 call; a dry run prints the request (service, operation, parameters) and returns None."""
        service = getattr(getattr(client, "meta", None), "service_model", None)
        name = service.service_name if service else type(client).__name__
        if self.dry_run:
            self._plan(f"call: {name}.{operation} {json.dumps(params, default=str, sort_keys=True)}")
            return None
        self.note(f"{name}.{operation}")
        return getattr(client, operation)(**params)

    def step(self, description: str, fn, *args, **kwargs):
        """A mutating step of another kind (start a process, write a file); a dry run only describes it."""
        if self.dry_run:
            self._plan(description)
            return None
        self.note(description)
        return fn(*args, **kwargs)

    # -- manifests ------------------------------------------------------------------------------------------------
    def emit(self, manifests: Sequence[dict]) -> str:
        """Print manifests as one YAML stream on stdout (always, so a run also shows what it applies)."""
        text = to_yaml_stream(manifests)
        sys.stdout.write(self.mask(text))
        sys.stdout.flush()
        return text


def _run_filtered(argv, env=None, cwd=None, input=None) -> subprocess.CompletedProcess:
    """kubectl/helm with stdout on our stderr as it comes and their stderr read line by line: client-go's logged
    retries (`E1122 ... memcache.go:265] ...`) are dropped, everything else is passed on and kept for the error."""
    process = subprocess.Popen(argv, text=True, env=env, cwd=cwd, stdout=sys.stderr, stderr=subprocess.PIPE,
                               stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL)
    if input is not None:
        def feed():
            try:
                process.stdin.write(input)
                process.stdin.close()
            except (BrokenPipeError, OSError):
                pass

        threading.Thread(target=feed, daemon=True).start()
    kept: deque = deque(maxlen=200)
    for line in process.stderr:
        kept.append(line)
        if not KUBE_NOISE.match(line) and not kube_unreachable(line):
            sys.stderr.write(line)
            sys.stderr.flush()
    process.wait()
    return subprocess.CompletedProcess(argv, process.returncode, None, "".join(kept))


def to_yaml_stream(manifests: Sequence[dict]) -> str:
    """Manifests as one YAML stream; an object used twice is written out twice, never as an anchor (&id001)."""
    import yaml

    class _Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data):
            return True

    return "".join("---\n" + yaml.dump(m, Dumper=_Dumper, sort_keys=False) for m in manifests)
