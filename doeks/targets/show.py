"""The job's status as the tasks show it: the replica table, then the reason and its fix (`elasticjob.status`,
`elasticjob.describe` and the root `invoke status`)."""
from __future__ import annotations

from .. import ui
from .base import COLUMNS, FAILED, JobStatus
from .runs import settle


def status(target) -> JobStatus:
    st = target.describe()
    record = settle(target.settings, st) or {}
    title = f"job {st.name} on {st.target}: {st.state}"
    if st.run:
        title += f" (run {st.run})"
    if st.desired is not None:
        title += f", {st.desired} nodes wanted"
    title += f", {st.restarts} restarts"
    if st.replicas:
        ui.table(title, COLUMNS, st.rows())
    else:
        ui.say(title)
    if st.queue:
        ui.say(st.queue)
    if st.replicas and all(r.step is None for r in st.replicas) and not _builtin(target.settings):
        ui.say("no step count: the script reports none (print `doeks: step=N loss=L` lines or call "
               "doeks.report(step=..., loss=..., samples=...): docs/your-own-script.md)")
    for note in st.notes:  # what the job went through: the hang watchdog's steps, a lost node
        ui.say(note, style="yellow")
    if record.get("goodput") is not None:
        ui.say(f"goodput: {record['goodput']:.2f} (productive step time {record['productive']:.0f} s of "
               f"{record['wall']:.0f} s since the deploy)")
    if st.reason:
        ui.say(f"reason: {st.reason}" + (" (permanent: restarts cannot help)" if st.permanent else ""),
               style="red" if st.state == FAILED else "yellow")
    if st.fix:
        ui.say(f"fix: {fix_of(target, st)}")
    return st


def fix_of(target, st: JobStatus) -> str:
    """The status' fix with the job's own folders in it (a reason names the checkpoint folder as CHECKPOINTS)."""
    from ..pod.reasons import CHECKPOINTS

    if CHECKPOINTS not in st.fix:
        return st.fix
    try:
        where = target.artifacts().get("checkpoints") or "the job's checkpoint folder"
    except Exception:  # noqa: BLE001 - a target that cannot say: the words stand for it
        where = "the job's checkpoint folder"
    return st.fix.replace(CHECKPOINTS, where)


def _builtin(settings) -> bool:
    from ..code import resolve
    from ..errors import DoeksError

    try:
        return resolve(settings).builtin
    except DoeksError:  # the script was moved since: status still shows what runs
        return False
