"""`up --dry-run` on one screen: the units' plans are captured whole (the steps said on stderr, the manifests' YAML on
stdout) and written to STATE_DIR/plans/, and the screen shows each unit's steps cut to a line each: API requests
without their parameters, the identity line for its role's requests, consecutive manifests on one line, waits,
`kubectl apply -f -` (the manifests' line names what) and unknown lookups (counted once at the end) left out.
`up --dry-run --full` prints the whole plan as before.
"""
from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path

WIDTH = 118
# requests the `identity:` line before them stands for (the role, its policy, its association), and a security
# group's rules (its create line names it)
_FOLDED = re.compile(r"^would call: (iam\.|eks\.create_addon |eks\.create_pod_identity_association |"
                     r"ec2\.authorize_security_group_ingress )")
_MANIFEST = re.compile(r"^would create or change (.+?) \(the YAML on stdout\)$")
_DROPPED = ("unknown: ", "would run: kubectl rollout status ")
_STDIN_APPLY = re.compile(r"^would run: kubectl apply .* -f -$")  # the `would apply:` line after it names what
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class Captured:
    """What the units said while the plan was made: `err` (stderr), `out` (stdout)."""

    def __init__(self):
        self.err, self.out = io.StringIO(), io.StringIO()


@contextlib.contextmanager
def capture():
    """Everything the units print (rich's console writes to sys.stderr as it finds it at each print) goes to a
    Captured instead of the terminal."""
    held = Captured()
    try:
        with contextlib.redirect_stderr(held.err), contextlib.redirect_stdout(held.out):
            yield held
    except BaseException:  # a plan that failed: what it said before the failure, as it said it
        sys.stdout.write(held.out.getvalue())
        sys.stderr.write(held.err.getvalue())
        raise


def condensed(text: str) -> list[str]:
    """The plan's stderr as the screen shows it (see the module docstring)."""
    lines: list[str] = []
    applied: list[str] = []

    def flush():
        if applied:
            lines.append("would apply: " + ", ".join(applied))
            applied.clear()

    for line in text.splitlines():
        line = _ANSI.sub("", line).rstrip()
        if not line or line.startswith(_DROPPED) or _FOLDED.match(line) or _STDIN_APPLY.match(line):
            continue
        manifest = _MANIFEST.match(line)
        if manifest:
            applied.append(manifest.group(1))
            continue
        flush()
        if line.startswith("would call: "):
            line = line.split(" {", 1)[0]
        lines.append(line)
    flush()
    return [line if len(line) <= WIDTH else line[:WIDTH - 1] + "…" for line in lines]


def save(settings, verb: str, held: Captured) -> tuple[Path, Path]:
    """Write the whole plan (steps, manifests) to STATE_DIR/plans/<verb>-<TARGET>.{txt,yaml}; returns both paths."""
    folder = settings.state_dir / "plans"
    folder.mkdir(parents=True, exist_ok=True)
    steps, manifests = folder / f"{verb}-{settings.target}.txt", folder / f"{verb}-{settings.target}.yaml"
    steps.write_text(held.err.getvalue())
    manifests.write_text(held.out.getvalue())
    return steps, manifests


def show(settings, verb: str, held: Captured) -> None:
    """The condensed plan on stderr, then where the whole one is."""
    from . import ui

    steps, manifests = save(settings, verb, held)
    for line in condensed(held.err.getvalue()):
        ui.say(line)
    documents = sum(1 for line in held.out.getvalue().splitlines() if line == "---")
    ui.say(f"the whole plan: {steps} (every step and request), {manifests} ({documents} manifests); "
           f"`invoke {verb} --dry-run --full` prints it", style="bold")
    sys.stderr.flush()
