"""A worker as doeks starts it (doeks.pod.worker: the image's torchrun, the local zygote): the script runs as `python -u
script.py` runs it, and the end of its process groups cannot hang.

The hang itself (a DDP script on gloo, `Running` for ever after its model was saved: `c10d::Reducer::~Reducer` ->
`~ProcessGroupGloo` -> `std::thread::join` with the GIL held, its gloo thread in `gil_scoped_acquire`, read with
`py-spy dump --native`) was seen in CI and once in ~36 local runs on 2 loaded cores; it is a race, and no script tried
here (a long GIL switch interval, a queued barrier) made it happen on demand. So these tests check its precondition on a
real gloo group (the reducer cannot be the group's last holder: doeks.pod.worker holds it until the script returns) and that
a script run through doeks.pod.worker sees what `python -u script.py` gives it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

# One process, a real gloo group, ended as PyTorch's DDP tutorial ends it (destroyed while the model is alive), then
# the model freed: how many groups doeks.pod.worker holds then, and after its release.
SCENARIO = """
import gc, sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from doeks.pod import worker
if sys.argv[1] == "held":
    worker.hold_process_groups()
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
ddp = DistributedDataParallel(torch.nn.Linear(4, 1))
ddp(torch.randn(8, 4)).sum().backward()
world = dist.group.WORLD
dist.destroy_process_group()
del ddp
gc.collect()  # a DDP model is in reference cycles: gc frees it (in a script, after main's frame is gone)
print("held", [g is world for g in worker._HELD], flush=True)
worker.release_process_groups()
print("after", len(worker._HELD), flush=True)
"""


def _scenario(tmp_path, mode: str) -> str:
    result = subprocess.run([sys.executable, "-c", SCENARIO, mode, str(tmp_path / f"store-{mode}")], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip()


def test_a_group_the_script_destroyed_is_held_until_the_script_returns(tmp_path):
    """The hang's precondition gone: the group a script destroyed stays held by doeks.pod.worker past its DDP model (whose
    reducer would otherwise be its last holder) and is dropped from Python when the script has returned."""
    assert _scenario(tmp_path, "torch") == "held []\nafter 0"  # torch alone: nothing but the model holds it
    assert _scenario(tmp_path, "held") == "held [True]\nafter 0"


def _run(folder, script: str, *args: str, nproc: int = 2, preload: bool = True) -> subprocess.CompletedProcess:
    """The image's torchrun on `script`: its workers forked from the zygote (doeks.pod.zygote, the image's default), or
    (`preload=False`, DOEKS_PRELOAD=0) started as `python -u -m doeks.pod.worker fit.py`."""
    (folder / "fit.py").write_text(script)
    env = {**os.environ, "DOEKS_PRELOAD": "1" if preload else "0"}
    return subprocess.run([sys.executable, "-m", "doeks.pod.torchrun", "--standalone", "--nproc-per-node", str(nproc),
                           "--max-restarts", "0", "fit.py", *args], cwd=folder, capture_output=True, text=True,
                          timeout=180, env=env)


def test_the_images_torchrun_runs_the_script_as_python_does_through_doeks_worker(tmp_path):
    """`python -u script.py args` as seen from the script: its argv, `__main__`, `__file__`, sys.path[0]; a gloo group
    it leaves open is destroyed when it returns (an interpreter ending with gloo's threads alive can abort, exit -6);
    its own exception is shown from its own frame with exit 1; a missing script is python's own line and exit 2."""
    probe = ("import atexit, os, sys\nimport torch.distributed as dist\n"
             "def main():\n"
             "    dist.init_process_group('gloo')\n"
             "    parent = open(f'/proc/{os.getpid()}/cmdline').read().split(chr(0))\n"
             "    print('argv', sys.argv, 'name', __name__, 'file', __file__, 'path0', sys.path[0], 'cmd', parent[1:5], flush=True)\n"
             "    atexit.register(lambda: print('at exit the group is', 'open' if dist.is_initialized() else 'gone', flush=True))\n"
             "if __name__ == '__main__':\n    main()\n")
    seen = f"argv ['{tmp_path}/fit.py', '--steps', '3'] name __main__ file {tmp_path}/fit.py path0 {tmp_path} cmd "
    for preload in (False, True):  # a new interpreter's `-m doeks.pod.worker`, and a zygote's fork (doeks.pod.worker.run)
        ran = _run(tmp_path, probe, "--steps", "3", preload=preload)
        assert ran.returncode == 0, ran.stderr[-3000:]
        lines = [line for line in ran.stdout.splitlines() if line.startswith("argv")]
        assert len(lines) == 2, ran.stdout
        assert all(line.startswith(seen) for line in lines), lines
        if not preload:
            assert lines[0].endswith("cmd ['-u', '-m', 'doeks.pod.worker', 'fit.py']"), lines
        assert ran.stdout.count("at exit the group is gone") == 2, ran.stdout

    raised = _run(tmp_path, "def main():\n    raise ValueError('bad input at step 2')\nif __name__ == '__main__':\n    main()\n")
    assert raised.returncode == 1
    trace = [line for line in raised.stderr.splitlines() if "Traceback" in line or 'File "' in line or "ValueError" in line]
    assert f'File "{tmp_path}/fit.py", line 4, in <module>' in trace[1] and "doeks" not in " ".join(trace[:4]), trace

    missing = subprocess.run([sys.executable, "-m", "doeks.pod.worker", "gone.py"], cwd=tmp_path, capture_output=True,
                             text=True, timeout=60)
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"{sys.executable}: can't open file {os.path.join(str(tmp_path), 'gone.py')!r}: " \
                                     "[Errno 2] No such file or directory"
