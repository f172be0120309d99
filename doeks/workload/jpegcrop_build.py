"""Build doeks/workload/_jpegcrop.c (the loader's region decode, docs/loader.md) next to train.py:
`python -m doeks.workload.jpegcrop_build [folder]` (`invoke setup` does it on this machine, the training image's build
in the image). Needs a C compiler, Python's headers and libjpeg-turbo >= 1.5's headers (Debian: gcc
libjpeg62-turbo-dev; Ubuntu: gcc libjpeg-turbo8-dev); the module then needs only libjpeg's runtime (libjpeg62-turbo /
libjpeg-turbo8). Without the module the loader decodes the whole image with simplejpeg."""
from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "_jpegcrop.c"


def target(folder: Path = HERE) -> Path:
    return Path(folder) / f"_jpegcrop{sysconfig.get_config_var('EXT_SUFFIX')}"


def compiler() -> list[str]:
    return (sysconfig.get_config_var("CC") or "cc").split()


def missing() -> str:
    """Why the module cannot be built here ("" when it can be tried): no C compiler, or no Python headers."""
    if shutil.which(compiler()[0]) is None:
        return f"no C compiler ({compiler()[0]})"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        return f"no Python headers ({sysconfig.get_paths()['include']}/Python.h)"
    return ""


def up_to_date(folder: Path = HERE) -> bool:
    """Built from the current _jpegcrop.c and loadable by this interpreter."""
    built = target(folder)
    if not built.is_file() or built.stat().st_mtime < SOURCE.stat().st_mtime:
        return False
    check = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(built.parent)!r}); import _jpegcrop"],
                           capture_output=True, text=True)
    return check.returncode == 0


def build(folder: Path = HERE, quiet: bool = False) -> Path:
    """Compile the module into `folder`; a failure raises CalledProcessError (`quiet`: with the compiler's output
    in it instead of on the terminal)."""
    built = target(folder)
    subprocess.run([*compiler(), "-O2", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}",
                    str(SOURCE), "-ljpeg", "-o", str(built)], check=True, capture_output=quiet, text=True)
    return built


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE))
