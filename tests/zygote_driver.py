"""Drives doeks.zygote as the agent does (tests/test_zygote.py): `python zygote_driver.py SCENARIO FOLDER`."""
import json
import os
import subprocess
import sys
from pathlib import Path

from doeks import zygote

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
