"""Workers forked from a preloaded zygote behave like `python -u script.py` started by torchrun (doeks.pod.zygote)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from doeks.services import pid_alive

DRIVER = Path(__file__).with_name("zygote_driver.py")
ROOT = DRIVER.parent.parent
SCRIPTS = {
    "ok.py": "print('hello from a forked worker')\n",
    "three.py": "import sys\nsys.exit(3)\n",
    "raises.py": "raise ValueError('broken on purpose')\n",
    "killed.py": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
    "sleeps.py": "import time\ntime.sleep(60)\n",
    "reports.py": (
        "import json, os, sys\nimport numpy as np\n"
        "print(json.dumps({'argv': sys.argv, 'value': os.environ.get('DOEKS_TEST_VALUE'), 'pid': os.getpid(),\n"
        "                  'session_leader': os.getsid(0) == os.getpid(), 'torch_preloaded': 'torchvision' in sys.modules,\n"
        "                  'cmdline': open('/proc/self/cmdline').read().replace(chr(0), ' '),\n"
        "                  'parent_cmdline': open(f'/proc/{os.getppid()}/cmdline').read().replace(chr(0), ' '),\n"
        "                  'main': __name__, 'path0': sys.path[0], 'numpy_draw': int(np.random.randint(2**31))}))\n"),
}


def drive(scenario: str, folder: Path) -> dict:
    for name, text in SCRIPTS.items():
        (folder / name).write_text(text)
    result = subprocess.run([sys.executable, str(DRIVER), scenario, str(folder)], capture_output=True, text=True,
                            timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_exit_codes_are_those_of_a_plain_interpreter(tmp_path):
    codes = drive("exits", tmp_path)
    assert codes == {"ok": 0, "three": 3, "raises": 1, "killed": -9, "timeout": "raised", "sleeps": -9}
    assert (tmp_path / "ok.log").read_text() == "hello from a forked worker\n"
    assert "ValueError: broken on purpose" in (tmp_path / "raises.log").read_text()


@pytest.mark.slow
def test_worker_gets_torchruns_argv_environment_and_session(tmp_path):
    outcome = drive("environment", tmp_path)
    assert outcome["code"] == 0
    report = json.loads((tmp_path / "reports.log").read_text())
    assert report["argv"] == [str(tmp_path / "reports.py"), "--flag", "value"]
    assert report["value"] == "42" and report["main"] == "__main__" and report["path0"] == str(tmp_path)
    assert report["pid"] == outcome["pid"] and report["session_leader"]
    assert report["torch_preloaded"]  # the point of the zygote: nothing left to import
    assert report["cmdline"].startswith(f"{sys.executable} -u {tmp_path / 'reports.py'} --flag value")  # ps shows the worker
    assert report["parent_cmdline"].startswith("doeks-zygote")
    twin = json.loads((tmp_path / "twin.log").read_text())
    assert outcome["twin"] == 0 and twin["numpy_draw"] != report["numpy_draw"]  # numpy reseeded as in a fresh interpreter


@pytest.mark.slow
def test_zygote_and_its_workers_go_when_the_agent_dies(tmp_path):
    pids = drive("agent-dies", tmp_path)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (pid_alive(pids["worker"]) or pid_alive(pids["zygote"])):
        time.sleep(0.1)
    assert not pid_alive(pids["worker"]) and not pid_alive(pids["zygote"])


def test_torch_closing_a_worker_the_zygote_has_already_reaped_is_not_an_error(tmp_path):
    """torch's close() signals a worker's process group when poll() said it runs; a forked worker is reaped by the
    zygote and its exit code reaches the agent a moment later, so on a loaded machine torch's killpg found no such
    group and the agent died with ProcessLookupError (CI on issue 33's code, whose image torchrun forks its workers
    the same way) instead of restarting its workers. The window held open here: the close is quiet, the exit code
    still comes."""
    said = drive("reaped-unreported", tmp_path)
    assert said == {"forked": True, "unreported": True, "close": "ok", "code": 0}, said
