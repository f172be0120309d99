"""PNG charts (matplotlib, Agg backend): training curves, scaling, bandwidth and metric series.

Each chart is built by a `*_figure` function that returns the matplotlib Figure (tests inspect its axes: scales,
labels with units, legend texts, limits), and written by a function that saves it. Every chart file goes under
`STATE_DIR/plots` unless the task's `--out` says otherwise (`plot_path`), named after its input or job.
"""
from __future__ import annotations

import csv
from pathlib import Path

from .errors import DoeksError, FlagError


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, out: Path, dpi: int = 100) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def _save(plt, fig, out: Path, dpi: int = 100) -> Path:  # kept for callers outside this module
    return save(fig, out, dpi)


def plot_path(settings, name: str, out: str | Path | None = None) -> Path:
    """Where a chart goes: `--out` (a .png file, or a folder to put `name` in), else STATE_DIR/plots/name."""
    if out:
        out = Path(out)
        if out.suffix.lower() == ".png":
            return out
        if out.suffix and not out.is_dir():  # `--out chart.jpg` became a folder named chart.jpg with `name` inside
            raise FlagError(f"--out {str(out)!r}: expected a .png file or a folder")
        return out / name
    return settings.state_dir / "plots" / name


def read_metrics(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        raise DoeksError(f"no metrics at {path}: run the job first (invoke elasticjob.deploy)")
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def training_figure(rows: list[dict[str, str]], title: str = "training", source: str = "metrics"):
    """Loss, accuracy (train and validation) and throughput against optimizer step; a labelled dotted line wherever
    the world size changed (elastic scaling, a lost node), in every panel's legend."""
    train = [r for r in rows if r["kind"] == "train"]
    val = [r for r in rows if r["kind"] == "val"]
    if not train:
        raise DoeksError(f"{source} has no training rows yet")
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    steps = [int(r["step"]) for r in train]
    axes[0].plot(steps, [float(r["loss"]) for r in train], color="tab:red", label="train loss")
    axes[0].set(title="loss", xlabel="optimizer step", ylabel="cross-entropy loss")
    axes[1].plot(steps, [float(r["accuracy"]) for r in train], label="train (batch)", alpha=0.6)
    if val:
        axes[1].plot([int(r["step"]) for r in val], [float(r["accuracy"]) for r in val], "o-", label="validation")
    axes[1].set(title="accuracy", xlabel="optimizer step", ylabel="top-1 accuracy (fraction)", ylim=(0, 1.02))
    axes[2].plot(steps, [float(r["samples_per_s"]) for r in train], color="tab:green", label="all ranks")
    axes[2].set(title="throughput", xlabel="optimizer step", ylabel="samples/s")
    changes = [(int(b["step"]), a["world_size"], b["world_size"]) for a, b in zip(train, train[1:])
               if a["world_size"] != b["world_size"]]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax in axes:
        for i, (step, before, after) in enumerate(changes):
            ax.axvline(step, color=colors[(i + 3) % len(colors)], linestyle=":", linewidth=1.5,
                       label=f"world size {before} → {after} (step {step})")
        ax.legend(fontsize="small")
    first = train[0]["world_size"]
    fig.suptitle(f"{title} (world size {first} at start)" if first else title)
    return fig


def training(metrics_csv: Path, out: Path, title: str = "") -> Path:
    return save(training_figure(read_metrics(metrics_csv), title or "training", str(metrics_csv)), out)


def scaling_figure(points: list[tuple[int, float]], unit: str = "processes"):
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
    return fig


def scaling(points: list[tuple[int, float]], out: Path, unit: str = "processes") -> Path:
    return save(scaling_figure(points, unit), out)


def human_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:g}{unit}"
        size /= 1024
    return f"{size:g}TiB"


def series_figure(named: dict[str, list[tuple[float, float]]], title: str, xlabel: str, ylabel: str,
                  logx: bool = False, logy: bool = False, xbytes: bool = False):
    """Lines by name (legend), optional log axes (base 2 for message sizes); `xbytes` labels x ticks 8B..1GiB."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, points in named.items():
        points = [(x, y) for x, y in points if not logy or y > 0]  # a log axis has no place for 0 GB/s
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, "o-", label=name, markersize=3)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    if xbytes:
        from matplotlib.ticker import FuncFormatter, LogLocator

        ax.xaxis.set_major_locator(LogLocator(base=2, numticks=12))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: human_bytes(x)))
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()
    return fig


def series(named: dict[str, list[tuple[float, float]]], out: Path, title: str, xlabel: str, ylabel: str,
           logx: bool = False, logy: bool = False) -> Path:
    return save(series_figure(named, title, xlabel, ylabel, logx=logx, logy=logy), out)
