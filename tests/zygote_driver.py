"""Drives doeks.pod.zygote as the agent does (tests/test_zygote.py): `python zygote_driver.py SCENARIO FOLDER`."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from doeks.pod import zygote

scenario, folder = sys.argv[1], Path(sys.argv[2])
z = zygote.start()  # in a worker this runs the script and exits


def spawn(script: str, *args: str, env=None, out: str | None = None):
    return z.spawn([sys.executable, "-u", str(folder / script), *args], {**os.environ, **(env or {})},
                   out and str(folder / out), out and str(folder / out))


if scenario == "exits":
    codes = {name: spawn(f"{name}.py", out=f"{name}.log").wait(timeout=30) for name in ("ok", "three", "raises", "killed")}
    slow = spawn("sleeps.py")
    try:
        slow.wait(timeout=0.2)
        codes["timeout"] = "no"
    except subprocess.TimeoutExpired:
        codes["timeout"] = "raised"
    slow.kill()
    codes["sleeps"] = slow.wait(timeout=10)
    print(json.dumps(codes))
elif scenario == "environment":
    worker = spawn("reports.py", "--flag", "value", env={"DOEKS_TEST_VALUE": "42"}, out="reports.log")
    twin = spawn("reports.py", out="twin.log")
    print(json.dumps({"code": worker.wait(timeout=30), "twin": twin.wait(timeout=30), "pid": worker.pid, "zygote": z.pid}))
elif scenario == "agent-dies":
    worker = spawn("sleeps.py")
    print(json.dumps({"worker": worker.pid, "zygote": z.pid}), flush=True)
    os._exit(0)  # like a SIGKILLed agent: no cleanup
elif scenario == "reaped-unreported":
    # torch's close of a worker its poll() said runs, when the zygote has reaped it and its exit code is on its way:
    # the agent's reader of the zygote's reports is held (it waits for the lock this thread holds), so the window that
    # a loaded machine opens for milliseconds stays open
    from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler

    from doeks.pod import torchrun

    torchrun.patch_worker_start(z)
    handler = SubprocessHandler(sys.executable, ("-u", str(folder / "ok.py")), {}, None, None, 0, None)
    said = {"forked": isinstance(handler.proc, zygote.ForkedWorker)}
    with z._cond:
        for _ in range(200):
            try:
                os.kill(handler.proc.pid, 0)
            except ProcessLookupError:
                break  # reaped by the zygote
            time.sleep(0.05)
        said["unreported"] = handler.proc.poll() is None
        try:
            handler.close()
            said["close"] = "ok"
        except ProcessLookupError as error:
            said["close"] = repr(error)
    said["code"] = handler.proc.wait(timeout=30)
    print(json.dumps(said))
