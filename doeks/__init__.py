"""doeks: distributed PyTorch training on EKS, SageMaker or this machine, driven by Invoke tasks."""

__version__ = "0.1.0"

_last_report: list[float] = []


def report(step: int, loss: float | None = None, samples: int | None = None, total: int | None = None) -> str:
    """Print one progress line in the format doeks reads from any training script's log (docs/your-own-script.md):

        doeks: step=<int> [loss=<float>] [samples/s=<float>] [world=<int>] [total=<int>]

    `samples`: samples this process trained since its last report (the rate is over the time between two calls),
    `total`: the steps the run will take (for the progress bar). Call it from rank 0 alone, or from every rank:
    doeks shows the highest step. Standard library only, so a script may also print the line itself."""
    import os
    import time

    now = time.monotonic()
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
    _last_report[:] = [now]
    line = " ".join(parts)
    print(line, flush=True)
    return line
