"""Parse nccl-tests output (all_reduce_perf and friends) into rows, a summary and the transport NCCL used.

Handles the formats of several nccl-tests versions: with or without the `root` column (2.13+ prints it), `error`
floats or `#wrong` counts, `N/A` cells, and lines prefixed by `mpirun --tag-output` (`[1,0]<stdout>:`) or by
`kubectl logs --prefix` (`[pod/NAME/CONTAINER] `) or a pod name (`[NAME] `). The transport decides whether EFA was really used: NCCL silently
falls back to sockets (TCP) when the OFI plugin or the EFA device is missing. doeks' stand-in on its own cluster (an MPI
all-reduce on CPU, no NCCL) says `transport: mpi/tcp`: never EFA.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

_PREFIX = re.compile(r"^(\[\d+,\d+\]<std(?:out|err)>:|\[[^\]\s]+\]\s)")
_TYPES = {"float", "half", "bfloat16", "double", "int8", "uint8", "int32", "uint32", "int64", "uint64", "fp8_e4m3", "fp8_e5m2"}
_EFA = re.compile(r"NET/OFI Selected [Pp]rovider is efa", re.I)
_SOCKET = re.compile(r"(NET/Socket|Using network Socket|NET/OFI Selected [Pp]rovider is (tcp|sockets))", re.I)
_IB = re.compile(r"(NET/IB|Using network IB)", re.I)
_MPI_TCP = re.compile(r"transport: mpi/tcp")  # doeks' CPU stand-in of all_reduce_perf (doeks/cluster/images/nccl-tests)
_AVG = re.compile(r"#\s*Avg bus bandwidth\s*:\s*([\d.]+)")


@dataclass
class Row:
    size: int
    count: int
    dtype: str
    oop_time_us: float | None
    oop_algbw: float | None
    oop_busbw: float | None
    ip_time_us: float | None
    ip_algbw: float | None
    ip_busbw: float | None


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    avg_busbw: float | None = None
    transport: str = "unknown"  # efa, socket, ib, gloo, mpi-tcp (doeks' CPU stand-in) or unknown

    @property
    def max_busbw(self) -> float:
        values = [v for r in self.rows for v in (r.oop_busbw, r.ip_busbw) if v is not None]
        return max(values) if values else 0.0

    @property
    def efa(self) -> bool:
        return self.transport == "efa"


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None  # N/A


def strip_prefix(line: str) -> str:
    return _PREFIX.sub("", line.rstrip("\n"), count=1)


def parse(text: str) -> Report:
    report = Report()
    transports = set()
    for raw in text.splitlines():
        line = strip_prefix(raw)
        if _EFA.search(line):
            transports.add("efa")
        elif _SOCKET.search(line):
            transports.add("socket")
        elif _IB.search(line):
            transports.add("ib")
        elif "transport: gloo" in line:
            transports.add("gloo")
        elif _MPI_TCP.search(line):
            transports.add("mpi-tcp")
        average = _AVG.search(line)
        if average:
            report.avg_busbw = float(average.group(1))
            continue
        tokens = line.split()
        if len(tokens) < 8 or not tokens[0].isdigit() or tokens[2] not in _TYPES:
            continue
        rest = tokens[4:]  # after size count type redop
        if len(rest) in (9, 5):  # a root column (nccl-tests >= 2.13)
            rest = rest[1:]
        if len(rest) not in (8, 4):
            continue
        oop = [_number(x) for x in rest[:3]]
        ip = [_number(x) for x in rest[4:7]] if len(rest) == 8 else [None, None, None]
        report.rows.append(Row(int(tokens[0]), int(tokens[1]), tokens[2], *oop, *ip))
    # EFA counts only if nothing fell back; a socket line anywhere means some rank used TCP
    for kind in ("socket", "efa", "ib", "gloo", "mpi-tcp"):
        if kind in transports:
            report.transport = kind
            break
    if report.avg_busbw is None and report.rows:
        values = [r.oop_busbw for r in report.rows if r.oop_busbw is not None]
        report.avg_busbw = sum(values) / len(values) if values else None
    return report


def human_size(size: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size}{unit}"
        size //= 1024
    return f"{size}TiB"


def table_rows(report: Report) -> list[list[str]]:
    def cell(value):
        return "N/A" if value is None else f"{value:.2f}"

    return [[human_size(r.size), r.dtype, cell(r.oop_time_us), cell(r.oop_algbw), cell(r.oop_busbw),
             cell(r.ip_algbw), cell(r.ip_busbw)] for r in report.rows]


def busbw_points(report: Report, in_place: bool = False) -> list[tuple[int, float]]:
    """(size, bus bandwidth GB/s) for a chart. nccl-tests prints bandwidth with two decimals, so every message below
    ~1 KiB reads 0.00 (the seed's p4d log: 8 B..1 KiB): there it is size / time x (busbw / algbw), the collective's
    own factor (2(n-1)/n for all_reduce) taken from the rows large enough to print it exactly."""
    def cells(r):
        return (r.ip_time_us, r.ip_algbw, r.ip_busbw) if in_place else (r.oop_time_us, r.oop_algbw, r.oop_busbw)

    ratios = sorted(b / a for _, a, b in map(cells, report.rows) if a is not None and b is not None and a >= 1)
    factor = ratios[len(ratios) // 2] if ratios else None
    points = []
    for row in report.rows:
        time_us, _, busbw = cells(row)
        if busbw is None:
            continue
        if busbw < 0.1 and factor and time_us:
            busbw = row.size / (time_us * 1e3) * factor
        points.append((row.size, busbw))
    return points


def chart_figure(report: Report, title: str):
    """Bus bandwidth against message size: both axes logarithmic (sizes 8 B..GiB in powers of 2, bandwidth from
    MB/s to hundreds of GB/s: on a linear axis everything below ~1 MiB lies flat on zero)."""
    from .plots import series_figure

    return series_figure({"out-of-place": busbw_points(report), "in-place": busbw_points(report, in_place=True)},
                         title=title, xlabel="message size (bytes, log2)", ylabel="bus bandwidth (GB/s, log)",
                         logx=True, logy=True, xbytes=True)


def chart(report: Report, out, title: str):
    from .plots import save

    return save(chart_figure(report, title), out)


def report(text: str, png, title: str, require_efa: bool) -> Report:
    """Show a saved or fresh nccl-tests (or doeks' stand-in) log as a table and a bus-bandwidth chart; with
    `require_efa`, raise unless NCCL used EFA (what `efa.test` and `efa.report --require-efa` demand)."""
    from . import ui
    from .errors import DoeksError

    found = parse(text)
    if not found.rows:
        raise DoeksError("no nccl-tests result rows found in the output: is it all_reduce_perf output?")
    ui.table(title, ["size", "type", "time us", "algbw GB/s", "busbw GB/s", "in-place algbw", "in-place busbw"],
             table_rows(found))
    png = chart(found, png, title)
    ui.say(f"transport: {found.transport}; avg bus bandwidth {found.avg_busbw or 0:.3f} GB/s; max {found.max_busbw:.2f} GB/s")
    ui.say(f"chart: {png}")
    if require_efa and found.transport == "mpi-tcp":
        raise DoeksError("no EFA: this log is doeks' CPU stand-in of all_reduce_perf (an MPI all-reduce over TCP on "
                         "doeks' own cluster; no NCCL, GPU or EFA)")
    if require_efa and not found.efa:
        raise DoeksError(f"NCCL did not use EFA (transport: {found.transport}; no 'Selected Provider is efa' line): "
                         "check the EFA device plugin, the pod's vpc.amazonaws.com/efa request and the aws-ofi-nccl plugin")
    return found
