"""PNG charts (matplotlib, Agg backend): training curves, scaling, bandwidth and metric series."""
from __future__ import annotations

import csv
from pathlib import Path

from .errors import DoeksError


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, out: Path, dpi: int = 100) -> Path:
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def read_metrics(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        raise DoeksError(f"no metrics at {path}: run the job first (invoke elasticjob.deploy)")
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def training(metrics_csv: Path, out: Path, title: str = "") -> Path:
    """Loss, accuracy (train and validation) and throughput against optimizer step."""
    rows = read_metrics(metrics_csv)
    train = [r for r in rows if r["kind"] == "train"]
    val = [r for r in rows if r["kind"] == "val"]
    if not train:
        raise DoeksError(f"{metrics_csv} has no training rows yet")
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    steps = [int(r["step"]) for r in train]
    axes[0].plot(steps, [float(r["loss"]) for r in train], color="tab:red")
    axes[0].set(title="loss", xlabel="step")
    axes[1].plot(steps, [float(r["accuracy"]) for r in train], label="train (batch)", alpha=0.6)
    if val:
        axes[1].plot([int(r["step"]) for r in val], [float(r["accuracy"]) for r in val], "o-", label="validation")
    axes[1].set(title="accuracy", xlabel="step", ylim=(0, 1.02))
    axes[1].legend()
    axes[2].plot(steps, [float(r["samples_per_s"]) for r in train], color="tab:green")
    axes[2].set(title="throughput (samples/s, all ranks)", xlabel="step")
    # dotted lines where the world size changed (elastic scaling, a lost node)
    changes = [int(b["step"]) for a, b in zip(train, train[1:]) if a["world_size"] != b["world_size"]]
    for ax in axes:
        for step in changes:
            ax.axvline(step, color="grey", linestyle=":", linewidth=1)
    fig.suptitle(title or "training")
    return _save(plt, fig, out)


def scaling(points: list[tuple[int, float]], out: Path, unit: str = "processes") -> Path:
    """Epoch time against workers, with ideal linear scaling from the smallest run (dotted)."""
    points = sorted(points)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    workers = [p[0] for p in points]
    times = [p[1] for p in points]
    base_n, base_t = points[0]
    ax.plot(workers, times, "o-", label="measured")
    ax.plot(workers, [base_t * base_n / n for n in workers], "r:", label="ideal linear scaling")
    ax.set(xlabel=unit, ylabel="epoch time (s)", title="epoch time vs workers", xticks=workers)
    ax.legend()
    return _save(plt, fig, out)


def series(named: dict[str, list[tuple[float, float]]], out: Path, title: str, xlabel: str, ylabel: str,
           logx: bool = False) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, points in named.items():
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, "o-", label=name, markersize=3)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.legend()
    return _save(plt, fig, out)
