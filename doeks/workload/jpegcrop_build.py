"""Build doeks/workload/_jpegcrop.c (the loader's region decode, docs/loader.md) next to train.py:
`python -m doeks.workload.jpegcrop_build [folder]`. Needs a C compiler, Python's headers and libjpeg-turbo >= 1.5's
headers (Debian: gcc libjpeg62-turbo-dev; Ubuntu: gcc libjpeg-turbo8-dev); the module then needs only libjpeg's
runtime (libjpeg62-turbo / libjpeg-turbo8). Without the module the loader decodes the whole image with simplejpeg."""
from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent


def build(folder: Path = HERE) -> Path:
    target = Path(folder) / f"_jpegcrop{sysconfig.get_config_var('EXT_SUFFIX')}"
    compiler = (sysconfig.get_config_var("CC") or "cc").split()
    subprocess.run([*compiler, "-O2", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}",
                    str(HERE / "_jpegcrop.c"), "-ljpeg", "-o", str(target)], check=True)
    return target


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE))
