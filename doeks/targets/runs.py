"""Every deploy is a run: an id (the rendezvous id the job's manifests carry), its target, when it started and ended,
and how it ended. The index is STATE_DIR/runs/<job>.json on the machine that deployed; `elasticjob.history` shows it.

A run's end is recorded when someone sees it (a status, a follow, a delete, the next deploy), from its target's
JobStatus; a run replaced before anyone saw its end is recorded as such. Each time its status is seen the run also
keeps what it went through (the hang watchdog's steps, a lost node: JobStatus.notes, one line each) and its goodput:
the productive step time its replicas report (the seconds of steps the model's state holds; steps done again after a
restart count once) over its wall time since the deploy.

A target that removes a failed job to end it (a cluster's PyTorchJob, deleted so that no pod crash-loops on GPUs that
bill) keeps what said why first (`keep_end`): its pods' logs in STATE_DIR/runs/<job>/<run>.log (`elasticjob.logs
[--run] [--errors]` read them) and its last status and events in STATE_DIR/runs/<job>/ended.json (`status` and
`describe` show it while no job of that name is there), until `elasticjob.delete` or the next deploy of the job.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def index_path(settings) -> Path:
    return settings.state_dir / "runs" / f"{settings.job_name}.json"


def read(settings) -> list[dict[str, Any]]:
    try:
        records = json.loads(index_path(settings).read_text())
    except (OSError, ValueError):
        return []
    return [r for r in records if isinstance(r, dict) and r.get("run")] if isinstance(records, list) else []


def _write(settings, records: list[dict[str, Any]]) -> None:
    path = index_path(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(records, indent=2))
    os.replace(tmp, path)


def start(settings, target: str, run: str, train_args: list[str] | None = None, code=None) -> None:
    """Record a submitted run; any earlier run still open was replaced by it (and a kept end is no longer the job's)."""
    forget_end(settings)
    records = read(settings)
    now = time.time()
    for record in records:
        if record.get("end") is None:
            record.update(end=now, result="Replaced", reason=f"run {run} was deployed before its end was seen")
    records.append({"run": run, "target": target, "job": settings.job_name, "start": now, "end": None,
                    "result": "Running", "reason": "", "script": script_of(settings, train_args, code),
                    "code": _code_of(settings, code),
                    "train_args": list(train_args or [])})
    _write(settings, records)


def script_of(settings, train_args=None, code=None) -> str:
    """The run's code as `history` shows it: the script (relative to the project when inside it, `-m module`, or
    `built-in`) and its arguments (TRAIN_ARGS, then --train-args)."""
    import shlex

    from ..code import resolve
    from ..errors import DoeksError
    from ..settings import PROJECT_ROOT

    try:
        code = code or resolve(settings)
    except DoeksError:
        return settings.train_script
    if code.builtin:
        shown = "built-in (doeks/workload/train.py)"
    elif code.module:
        shown = f"-m {code.entry}"
    else:
        path = code.source / code.entry
        shown = str(path.relative_to(PROJECT_ROOT)) if PROJECT_ROOT in path.parents else str(path)
    args = list(code.args) + list(train_args or [])
    return shown + (f" {shlex.join(args)}" if args and not code.builtin else "")


def _code_of(settings, code=None) -> str:
    from ..code import resolve
    from ..errors import DoeksError

    try:
        return (code or resolve(settings)).shown()
    except DoeksError:
        return settings.train_script


def refuse_other_code(settings, code, fresh: bool) -> None:
    """A job's name stands for one script: its checkpoints, metrics and model are that script's. Two scripts named
    alike (fit.py in two projects) would read each other's state: the second is refused, in one line, unless it
    starts the name over (--fresh) or takes a name of its own."""
    from ..errors import DoeksError

    before = next((r.get("code") for r in reversed(read(settings)) if r.get("code")), None)
    if fresh or before is None or before == code.shown():
        return
    raise DoeksError(f"job {settings.job_name} ran {before}, not {code.shown()}: its checkpoints and model are that "
                     f"script's; deploy this one with --job-name <another name> (or --fresh to start {settings.job_name} "
                     "over with it)")


def settle(settings, status) -> dict[str, Any] | None:
    """Record what a JobStatus says of its run: its notes and goodput so far, and its end once it is final (Succeeded,
    Failed, Stopped). Returns the run's record (None: not a run deployed from here)."""
    if not status.run:
        return None
    records = read(settings)
    for record in records:
        if record["run"] != status.run:
            continue
        changed = False
        notes = record.setdefault("notes", [])
        for note in status.notes:
            if note not in notes:
                notes.append(note)
                changed = True
        productive = max((r.productive for r in status.replicas if r.productive is not None), default=None)
        if productive is not None and record.get("end") is None and (status.ended or not status.finished):
            wall = max((status.ended or time.time()) - record["start"], 1e-6)
            record.update(productive=round(productive, 1), wall=round(wall, 1), goodput=round(min(productive / wall, 1.0), 3))
            changed = True
        if status.finished and record.get("end") is None:
            record.update(end=status.ended or time.time(), result=status.state, reason=status.reason)
            changed = True
        if changed:
            _write(settings, records)
        return record
    return None


def settle_quietly(target) -> None:
    """settle() from the target's own describe(), ignoring a target that cannot be read now."""
    from ..errors import DoeksError

    try:
        settle(target.settings, target.describe())
    except DoeksError:
        pass


def kept_folder(settings) -> Path:
    return settings.state_dir / "runs" / settings.job_name


def keep_end(settings, target: str, status: dict[str, Any], lines: list[str], events: list[str]) -> Path:
    """Keep a failed run's end before its target removes it: `status` (a JobStatus as a dict: state, run, replicas,
    restarts, reason, fix...), its log `lines` (prefixed with their replica) and its `events`. Returns the log file."""
    folder = kept_folder(settings)
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / f"{status['run'] or 'unknown'}.log"
    log.write_text("".join(f"{line}\n" for line in lines), errors="replace")
    ended = folder / "ended.json"
    tmp = ended.with_name(f".ended.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**status, "target": target, "events": list(events), "log": str(log)}, indent=2))
    os.replace(tmp, ended)
    return log


def kept_end(settings, target: str) -> dict[str, Any] | None:
    """The kept end of the job's last run on `target` (keep_end's status with its events), None when there is none."""
    try:
        ended = json.loads((kept_folder(settings) / "ended.json").read_text())
    except (OSError, ValueError):
        return None
    return ended if isinstance(ended, dict) and ended.get("target") == target else None


def forget_end(settings) -> None:
    """The job was deleted or deployed again: its last end is no longer its status (the run's log stays, for
    `elasticjob.logs --run`)."""
    (kept_folder(settings) / "ended.json").unlink(missing_ok=True)


def kept_logs(settings, run: str) -> list[str] | None:
    """The log lines kept for `run`, None when none were kept."""
    try:
        return (kept_folder(settings) / f"{run}.log").read_text(errors="replace").splitlines()
    except OSError:
        return None


def kept_runs(settings) -> list[str]:
    """The runs whose logs were kept, oldest first."""
    folder = kept_folder(settings)
    return sorted(p.stem for p in folder.glob("*.log")) if folder.is_dir() else []


def jobs(settings, target: str) -> list[str]:
    """The names of the jobs deployed from this machine (STATE_DIR) to `target`, sorted."""
    folder = settings.state_dir / "runs"
    found = set()
    for path in folder.glob("*.json") if folder.is_dir() else []:
        try:
            records = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(records, list) and any(isinstance(r, dict) and r.get("target") == target for r in records):
            found.add(next((r.get("job") for r in records if isinstance(r, dict) and r.get("job")), path.stem))
    return sorted(found)


def rows(settings) -> list[list[str]]:
    def when(t):
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else ""

    out = []
    for r in read(settings):
        took = f"{r['end'] - r['start']:.0f}s" if r.get("end") and r.get("start") else ""
        goodput = f"{r['goodput']:.2f}" if r.get("goodput") is not None else ""
        out.append([r["run"], r.get("target", ""), r.get("script", ""), when(r.get("start")), when(r.get("end")), took,
                    r.get("result", ""), goodput, r.get("reason", "")])
    return out


def note_lines(settings) -> list[str]:
    """What each run went through (the watchdog's steps, a lost node), one line each: `<run>: <note>`."""
    return [f"{r['run']}: {note}" for r in read(settings) for note in r.get("notes", [])]


COLUMNS = ["run", "target", "script", "start", "end", "took", "result", "goodput", "reason"]
