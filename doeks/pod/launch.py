"""The training image's default command (`doeks-launch`, the image's ENTRYPOINT; `train` on its PATH too): the job's
code under torchrun, with the distributed settings taken from whatever started the container, so any tool can run the
image without naming a command.

What it reads, by the first argument:
- `train`: SageMaker's bring-your-own-container convention (SageMaker runs `docker run IMAGE train`): the hosts from
  /opt/ml/input/config/resourceconfig.json (else SM_HOSTS / SM_CURRENT_HOST), the script's arguments from
  hyperparameters.json (every one but sagemaker_* as `--key value`, as the sagemaker-training toolkit passes them),
  the script `sagemaker_program` in /opt/ml/code when the job brought its code there, else the image's own; the SM_*
  folders (and doeks' DOEKS_* names for them) set for the script as the toolkit sets them; torchrun with one node per
  host, this host's index as its rank, the first host as the master.
- an executable (`bash`, `python3 -c ...`, `torchrun ...`): run as it is.
- anything else (or nothing): torchrun's own options first (`--nnodes 2 --nproc-per-node 4 ...`), then a script
  (`x.py`, `-m package.module`) or, when none is named, the image's (DOEKS_TRAIN_SCRIPT), then the script's arguments
  (after `--` when they could be taken for torchrun's); with none given, DOEKS_TRAIN_ARGS (shell-quoted). torchrun
  reads the PET_* variables itself: Kubeflow Trainer's torch plugin (PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
  PET_MASTER_ADDR, PET_MASTER_PORT) and the training operator v1 (the same, or PET_RDZV_* for an elastic job) need
  nothing more. Where only MASTER_ADDR / MASTER_PORT / WORLD_SIZE / RANK are set (the training operator before 1.7,
  or `torch.distributed.launch`'s convention) they become one process per pod: --nnodes WORLD_SIZE --node-rank RANK.

Standard library only (torch's parser names torchrun's options); in the image it runs without the rest of doeks.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

SCRIPT_ENV = "DOEKS_TRAIN_SCRIPT"   # the image's script: /workspace/train.py, or `-m package.module`
ARGS_ENV = "DOEKS_TRAIN_ARGS"       # the script's arguments when the command line gives none (shell-quoted)
WORKDIR = "/workspace"

# SageMaker's folders (docs.aws.amazon.com/sagemaker/latest/dg/your-algorithms-training-algo-running-container.html)
ML = "/opt/ml"
SM_CODE = f"{ML}/code"
SAGEMAKER_PORT = "7777"            # what the sagemaker-training toolkit's torch_distributed runner gives torchrun
SAGEMAKER_ENV = {"SM_MODEL_DIR": f"{ML}/model", "SM_OUTPUT_DATA_DIR": f"{ML}/output/data", "SM_OUTPUT_DIR": f"{ML}/output",
                 "SM_INPUT_DIR": f"{ML}/input", "SM_INPUT_CONFIG_DIR": f"{ML}/input/config",
                 "SM_CHECKPOINT_DIR": f"{ML}/checkpoints"}
# doeks' names for the same folders (doeks.sagemaker.ENVIRONMENT; a test keeps them equal)
DOEKS_ON_SAGEMAKER = {"DOEKS_DATA_DIR": f"{ML}/input/data/training", "DOEKS_CHECKPOINT_DIR": f"{ML}/checkpoints",
                      "DOEKS_CHECKPOINT_URI": f"{ML}/checkpoints",
                      "DOEKS_MODEL_DIR": f"{ML}/model", "DOEKS_OUTPUT_DIR": f"{ML}/output/data"}


class LaunchError(Exception):
    pass


@dataclass
class Launch:
    argv: list[str]                          # what is exec'd
    env: dict[str, str] = field(default_factory=dict)   # set for it (on top of the container's)
    cwd: str | None = None
    source: str = ""                         # which convention it read, for the one line it prints


def torchrun_options() -> dict[str, int]:
    """Every option string torchrun accepts -> how many values it takes (0 for a flag), from torch's own parser."""
    from torch.distributed.run import get_args_parser

    found = {}
    for action in get_args_parser()._actions:
        for option in action.option_strings:
            found[option] = 0 if action.nargs == 0 else 1
    return found


def split(args: list[str], options: dict[str, int]) -> tuple[list[str], list[str] | None, list[str] | None]:
    """(torchrun's options, the script as torchrun takes it or None for the image's, the script's arguments or None
    when the command line gives none)."""
    ours: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return ours, None, args[i + 1:]
        if arg in ("-m", "--module"):
            if i + 1 >= len(args):
                raise LaunchError(f"{arg} names no module")
            return ours, ["-m", args[i + 1]], args[i + 2:]
        name = arg.split("=", 1)[0]
        if arg.startswith("-") and name in options:
            takes = 0 if "=" in arg else options[name]
            if i + takes >= len(args):
                raise LaunchError(f"torchrun's {arg} needs a value")
            ours += args[i:i + 1 + takes]
            i += 1 + takes
            continue
        if not arg.startswith("-") and (arg.endswith(".py") or os.path.isfile(arg)):
            return ours, [arg], args[i + 1:]
        return ours, None, args[i:]   # the image's script, with these as its arguments
    return ours, None, None


def image_script(env: dict[str, str]) -> list[str]:
    script = env.get(SCRIPT_ENV, "").strip()
    if not script:
        raise LaunchError(f"no script named and the image has none ({SCRIPT_ENV} is empty): give one, "
                          "e.g. `train.py` or `-m package.module`")
    return shlex.split(script)


def given(options: list[str], *names: str) -> bool:
    return any(o.split("=", 1)[0] in names for o in options)


def from_environment(options: list[str], env: dict[str, str]) -> tuple[list[str], str]:
    """torchrun options for what the launcher's environment says and torchrun does not read itself, and which
    convention that was."""
    if "PET_NNODES" in env:
        return [], "Kubeflow (PET_* variables)"
    if given(options, "--nnodes", "--standalone"):
        return [], "torchrun options"
    if env.get("MASTER_ADDR") and env.get("WORLD_SIZE") and env.get("RANK"):
        return ["--nnodes", env["WORLD_SIZE"], "--node-rank", env["RANK"], "--nproc-per-node", "1",
                "--master-addr", env["MASTER_ADDR"], "--master-port", env.get("MASTER_PORT", "29500")], \
            "MASTER_ADDR / WORLD_SIZE / RANK (one process per pod)"
    return [], "torchrun options" if options else "one node (no launcher variables)"


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def sagemaker(args: list[str], env: dict[str, str], root: str = ML) -> Launch:
    """`train`: SageMaker's contract (see the module's docstring)."""
    config = Path(root) / "input" / "config"
    resources = _read_json(config / "resourceconfig.json") or {}
    hosts = resources.get("hosts") or json.loads(env.get("SM_HOSTS") or "[]")
    current = resources.get("current_host") or env.get("SM_CURRENT_HOST", "")
    if not hosts:
        hosts, current = ["algo-1"], current or "algo-1"
    if current not in hosts:
        raise LaunchError(f"this host {current!r} is not one of the job's hosts {hosts} (resourceconfig.json)")
    hyper = {k: str(v) for k, v in (_read_json(config / "hyperparameters.json") or {}).items()}
    script_args = [a for k, v in hyper.items() if not k.startswith("sagemaker_") for a in (f"--{k}", v)]
    program = hyper.get("sagemaker_program", "")
    code = Path(root) / "code"
    if program and (code / program).is_file():
        script, cwd = [f"{SM_CODE}/{program}"], SM_CODE
    else:
        script, cwd = image_script(env), WORKDIR if os.path.isdir(WORKDIR) else None
    channels = sorted((_read_json(config / "inputdataconfig.json") or {"training": {}}).keys())
    gpus = env.get("SM_NUM_GPUS", "0")
    nproc = env.get("PET_NPROC_PER_NODE") or (gpus if gpus.isdigit() and int(gpus) > 0 else "1")
    extra = {**SAGEMAKER_ENV, **DOEKS_ON_SAGEMAKER, "SM_HOSTS": json.dumps(hosts), "SM_CURRENT_HOST": current,
             "SM_NUM_GPUS": gpus, "SM_CHANNELS": json.dumps(channels),
             "SM_HPS": json.dumps({k: v for k, v in hyper.items() if not k.startswith("sagemaker_")})}
    extra.update({f"SM_CHANNEL_{c.upper()}": f"{ML}/input/data/{c}" for c in channels})
    extra = {k: v for k, v in extra.items() if k not in env}  # what the platform (or the user) set stays
    torchrun = ["--nnodes", str(len(hosts)), "--node-rank", str(hosts.index(current)), "--nproc-per-node", nproc,
                "--master-addr", hosts[0], "--master-port", env.get("MASTER_PORT", SAGEMAKER_PORT)]
    return Launch(["torchrun", *torchrun, *script, *script_args, *args], extra, cwd,
                  f"SageMaker (host {current} of {len(hosts)})")


def plan(args: list[str], env: dict[str, str], options: dict[str, int] | None = None, root: str = ML) -> Launch:
    """What `doeks-launch ARGS` runs in the environment `env`."""
    if args and args[0] == "train":
        return sagemaker(args[1:], env, root)
    if args and not args[0].startswith("-") and not args[0].endswith(".py") and (
            shutil.which(args[0], path=env.get("PATH")) or (os.path.isabs(args[0]) and os.access(args[0], os.X_OK))):
        return Launch(list(args), source="a command")
    if options is None:  # torch's parser only when there are options to tell apart (importing torch takes seconds)
        options = torchrun_options() if any(a.startswith("-") for a in args) else {}
    ours, script, script_args = split(list(args), options)
    if script is None:
        script = image_script(env)
    if script_args is None:
        script_args = shlex.split(env.get(ARGS_ENV, ""))
    added, source = from_environment(ours, env)
    return Launch(["torchrun", *added, *ours, *script, *script_args], source=source)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    env = dict(os.environ)
    try:
        launch = plan(args, env)
    except LaunchError as error:
        print(f"doeks-launch: error: {error}", file=sys.stderr, flush=True)
        return 2
    if launch.source != "a command":
        print(f"doeks-launch: {launch.source}: {shlex.join(launch.argv)}", file=sys.stderr, flush=True)
    if launch.cwd:
        os.chdir(launch.cwd)
    os.environ.update(launch.env)
    try:
        os.execvp(launch.argv[0], launch.argv)
    except OSError as error:
        print(f"doeks-launch: error: cannot run {launch.argv[0]}: {error.strerror}", file=sys.stderr, flush=True)
        return 127


if __name__ == "__main__":
    sys.exit(main())
