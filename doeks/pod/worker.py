"""A training script's process as doeks starts it on every target: what `python -u script.py args...` does (its
arguments, sys.path[0], `__main__`, `__file__`, its traceback and exit code; sys.argv[0] is the script's absolute path),
with the end of torch's process groups made safe.

torchrun starts each worker as `python -u script.py`; the training image's torchrun (doeks.pod.torchrun) starts
`python -u -m doeks.pod.worker script.py` instead, and doeks.pod.zygote (the local agent's and the image's torchrun's
preloaded workers) runs `run()` in each fork.

Why: a script that ends as PyTorch's DDP tutorial ends (`dist.destroy_process_group()` while its DistributedDataParallel
model is still alive) can hang for ever on gloo after its work is done. destroy_process_group drops the group from
torch's tables; the model's C++ reducer then holds the group's last reference, and when the script's function returns
the reducer is freed with the GIL held: the group's destructor joins gloo's threads while one of them waits for the GIL
to free what its last collective kept (pytorch/pytorch#56297). Seen here: a worker of examples/sagemaker-style at
`<module>` under `c10d::Reducer::~Reducer` -> `~ProcessGroupGloo` -> `std::thread::join`, its gloo thread in
`gil_scoped_acquire`, the job `Running` after its model was saved (CI; here once in ~36 runs on 2 loaded cores). Here every
group the script destroys is kept until the script has returned and is then dropped from Python (a group's Python
binding frees it with the GIL released). A gloo group the script left open is destroyed when it returns: otherwise the
interpreter's end can abort with gloo's threads alive (`terminate called without an active exception`, exit -6: the
job's work done, its pod failed and restarted). An NCCL group left open is left to torch.

Standard library, and torch.distributed where torch is installed (imported before the script: it imports torch
anyway): staged into the training image beside doeks.pod.torchrun.
"""
from __future__ import annotations

import os
import sys

_HELD: list = []  # the process groups the script destroyed, until it has returned


def runnable(args) -> bool:
    """True for the command torchrun builds for a script: `<this python> -u script.py ...`."""
    return len(args) >= 3 and args[0] == sys.executable and args[1] == "-u" and str(args[2]).endswith(".py")


def command(args) -> list[str]:
    """torchrun's `python -u script.py args` as `python -u -m doeks.pod.worker script.py args` (others unchanged)."""
    args = list(args)
    return [args[0], "-u", "-m", "doeks.pod.worker", *args[2:]] if runnable(args) else args


def hold_process_groups() -> None:
    """Keep every process group the script destroys until release_process_groups (see the module's docstring)."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None:
        try:
            import torch.distributed.distributed_c10d as c10d
        except ImportError:  # no torch: nothing to hold
            return
    destroy = c10d.destroy_process_group
    if getattr(destroy, "_doeks_held", False):
        return

    def destroy_process_group(group=None, *args, **kwargs):
        try:
            _HELD.extend([group] if group is not None else list(c10d._world.pg_map))
        except Exception:  # noqa: BLE001 - torch's internals moved: destroy as torch does
            pass
        return destroy(group, *args, **kwargs)

    destroy_process_group._doeks_held = True
    destroy_process_group.__doc__ = destroy.__doc__
    c10d.destroy_process_group = destroy_process_group
    import torch.distributed as dist

    dist.destroy_process_group = destroy_process_group


def release_process_groups() -> None:
    """After the script returned: destroy a gloo default group it left open, then drop the groups it destroyed."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo":
            dist.destroy_process_group()
    finally:
        _HELD.clear()


def run(script: str, args: list[str]) -> None:
    """Run `script` with `args` as `python -u script args` would, in this process; ends it (SystemExit)."""
    import runpy

    if not os.path.isfile(script):  # as python says it, with its exit code (2: no restart can help)
        print(f"{sys.executable}: can't open file {os.path.abspath(script)!r}: [Errno 2] No such file or directory",
              file=sys.stderr, flush=True)
        sys.exit(2)
    # its __file__ and its frames' file absolute, as python 3.9+ has them (and sys.argv[0]: runpy sets it so)
    path = os.path.abspath(script)
    sys.argv = [path, *args]
    sys.path[0] = os.path.dirname(path)
    hold_process_groups()  # where torch is installed
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as stop:
        if stop.code in (None, 0):
            release_process_groups()
        raise
    except Exception as error:  # noqa: BLE001 - shown as `python script.py` shows it, then exit 1 as it does
        trace = error.__traceback__
        while trace is not None and trace.tb_frame.f_code.co_filename != path:
            trace = trace.tb_next  # doeks' and runpy's frames are not the script's
        error = error.with_traceback(trace or error.__traceback__)  # Python prints the exception's own traceback
        sys.excepthook(type(error), error, error.__traceback__)  # torch's, once the script made its process group
        sys.exit(1)
    release_process_groups()
    sys.exit(0)


def main() -> None:
    if len(sys.argv) < 2:
        print("usage: python -m doeks.pod.worker script.py [args...]", file=sys.stderr)
        sys.exit(2)
    run(sys.argv[1], sys.argv[2:])


if __name__ == "__main__":
    main()
