"""doeks: distributed PyTorch training on EKS, SageMaker or this machine, driven by Invoke tasks."""

__version__ = "0.1.0"

_last_report: list[float] = []
_beat: list[float] = []  # when this process last told its node's watchdog (doeks.pod.watchdog) about its progress


def checkpoints(uri: str | None = None, keep: int | None = None):
    """The job's checkpoints, for a script of your own (docs/your-own-script.md): a Store on DOEKS_CHECKPOINT_URI
    (s3://bucket/prefix or a folder; SageMaker: its checkpoint folder), keeping DOEKS_KEEP_CHECKPOINTS:

        ck = doeks.checkpoints(); meta = ck.resume(state)   # state = {"model": model, "optimizer": optimizer, ...}
        ck.save(state, step)                                 # every rank, every N steps: step-N/ (async), then latest

    `resume` loads the newest complete checkpoint into `state` in place and returns its meta ({"step": N, ...}), or
    None; `save` stalls only for the copy to CPU memory (PyTorch Distributed Checkpoint). doeks.workload.checkpoints."""
    import os

    from .workload.checkpoints import Store

    where = uri or os.environ.get("DOEKS_CHECKPOINT_URI") or os.environ.get("DOEKS_CHECKPOINT_DIR") or "/opt/ml/checkpoints"
    return Store(where, keep=keep or int(os.environ.get("DOEKS_KEEP_CHECKPOINTS", "3") or 3))


def save_model(obj, name: str = "model.pt", uri: str | None = None) -> str:
    """Save your script's final model where doeks keeps the job's model (docs/your-own-script.md): torch.save(obj) as
    `name` at DOEKS_MODEL_URI (TARGET=eks: s3://S3_BUCKET/doeks/models/<JOB_NAME>, which `invoke down` keeps; else
    MODEL_URI or the shared volume's models/<JOB_NAME>; SageMaker: SM_MODEL_DIR), whole or not at all. Call it from
    rank 0 once training is done:

        if dist.get_rank() == 0: doeks.save_model(model.state_dict())

    Returns where it went (the s3:// URI or the file). doeks.workload.checkpoints.save_file."""
    import os

    from .workload.checkpoints import save_file

    where = (uri or os.environ.get("DOEKS_MODEL_URI") or os.environ.get("DOEKS_MODEL_DIR")
             or os.environ.get("SM_MODEL_DIR") or "/opt/ml/model")
    return save_file(where, name, obj)


def report(step: int, loss: float | None = None, samples: int | None = None, total: int | None = None,
           productive: float | None = None) -> str:
    """Print one progress line in the format doeks reads from any training script's log (docs/your-own-script.md):

        doeks: step=<int> [loss=<float>] [samples/s=<float>] [world=<int>] [total=<int>] [productive=<float>s]

    `samples`: samples this process trained since its last report (the rate is over the time between two calls),
    `total`: the steps the run will take (for the progress bar), `productive`: the seconds of step time the model's
    state holds (carried in your checkpoint; `status` and `history` show goodput from it). Call it from rank 0 alone,
    or from every rank: doeks shows the highest step. Each call also tells the node's watchdog that this rank made
    progress (DOEKS_PROGRESS_DIR, set by doeks' torchrun), and the first makes SIGUSR1 dump its stacks
    (faulthandler), which the watchdog asks for when it made none for HANG_TIMEOUT seconds. Standard library only,
    so a script may also print the line itself."""
    import os
    import time

    now = time.monotonic()
    _heartbeat(int(step))
    parts = [f"doeks: step={int(step)}"]
    if loss is not None:
        parts.append(f"loss={float(loss):.6g}")
    if samples is not None and _last_report:
        elapsed = now - _last_report[0]
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if elapsed > 0:
            parts.append(f"samples/s={samples * world / elapsed:.1f}")
    if os.environ.get("WORLD_SIZE"):
        parts.append(f"world={int(os.environ['WORLD_SIZE'])}")
    if total is not None:
        parts.append(f"total={int(total)}")
    if productive is not None:
        parts.append(f"productive={float(productive):.1f}s")
    _last_report[:] = [now]
    line = " ".join(parts)
    print(line, flush=True)
    return line


def _heartbeat(step: int) -> None:
    """DOEKS_PROGRESS_DIR/<rank>: `step wall-time`, at most once a second (what doeks.pod.watchdog reads)."""
    import os
    import time

    folder = os.environ.get("DOEKS_PROGRESS_DIR")
    now = time.time()
    if not folder or (_beat and now - _beat[0] < 1.0):
        return
    if not _beat:
        try:
            import faulthandler
            import signal

            faulthandler.register(signal.SIGUSR1, all_threads=True)
        except (ValueError, RuntimeError, AttributeError):  # not the main thread, or no SIGUSR1 here
            pass
    _beat[:] = [now]
    path = os.path.join(folder, os.environ.get("RANK", "0"))
    try:
        with open(path + ".tmp", "w") as f:
            f.write(f"{step} {now:.3f}\n")
        os.replace(path + ".tmp", path)
    except OSError:
        pass
