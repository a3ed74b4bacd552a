"""JIT build of the CUDA paging kernels (``csrc/``) with ``torch.utils.cpp_extension``.

The extension is a Python module (``megatron_paging_kernels``: ``copy``, the handle classes
``Pool`` / ``Layout``, ``bulk_supported``). It is built with ninja into
:func:`megatron_paging.env.extension_cache_dir`, one folder per target architecture, and
rebuilt only when a source, a header or a flag changes.

``python -m megatron_paging.kernels.build --arch 9.0 --verbose`` compiles for sm_90 without a GPU
and prints where the shared library is.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import shutil
import sys
from pathlib import Path

import torch

from megatron_paging.env import extension_cache_dir

EXTENSION_NAME = "megatron_paging_kernels"
CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (CSRC / "paging_tile.cu", CSRC / "paging_bulk.cu", CSRC / "paging_ops.cpp",
           CSRC / "weighted_swiglu.cu", CSRC / "weighted_swiglu_ops.cpp")
HEADERS = (CSRC / "paging.h", CSRC / "paging_device.cuh", CSRC / "paging_launch.cuh",
           CSRC / "paging_bulk_pipe.cuh", CSRC / "weighted_swiglu.h")
_DEFAULT_CUDA_HOME = "/usr/local/cuda"


class BuildError(RuntimeError):
    """The extension could not be built; the message says what is missing."""


def find_cuda_home() -> Path:
    """A CUDA toolkit with ``bin/nvcc`` and ``include/cuda_runtime.h``.

    Checked in order: ``CUDA_HOME``, ``CUDA_PATH``, ``/usr/local/cuda``, the folder above the
    ``nvcc`` on ``PATH`` (a wrapper script there does not count: it has no headers beside it).
    """
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), _DEFAULT_CUDA_HOME]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    for candidate in candidates:
        if not candidate:
            continue
        home = Path(candidate)
        if (home / "bin" / "nvcc").exists() and (home / "include" / "cuda_runtime.h").exists():
            return home
    tried = ", ".join(c for c in candidates if c)
    raise BuildError(
        f"no CUDA toolkit found (need bin/nvcc and include/cuda_runtime.h; tried {tried}); "
        "install the CUDA toolkit or set CUDA_HOME"
    )


def resolve_arch(arch: str | None) -> str:
    """The target compute capability, e.g. ``"9.0"``: the argument, the first entry of
    ``TORCH_CUDA_ARCH_LIST``, or the current GPU's."""
    if arch is None:
        env = os.environ.get("TORCH_CUDA_ARCH_LIST", "").replace(";", " ").split()
        if env:
            arch = env[0]
        elif torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            arch = f"{major}.{minor}"
        else:
            raise BuildError(
                "no GPU to build for: pass --arch (e.g. 9.0) or set TORCH_CUDA_ARCH_LIST"
            )
    # "9.0a" / "9.0+PTX": the copy kernels use no arch-specific instructions, plain sm_90 serves.
    arch = arch.removesuffix("+PTX").removesuffix("a")
    parts = arch.split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise BuildError(f"arch must look like '9.0', got {arch!r}")
    return arch


def build_directory(arch: str) -> Path:
    return extension_cache_dir() / f"sm{arch.replace('.', '')}"


def _check_toolchain() -> Path:
    if torch.version.cuda is None:
        raise BuildError(f"torch {torch.__version__} is a CPU-only build; a CUDA build is needed")
    cuda_home = find_cuda_home()
    # torch guesses its toolkit once, at import; a wrapper nvcc on PATH can mislead that guess.
    os.environ["CUDA_HOME"] = str(cuda_home)
    from torch.utils import cpp_extension

    cpp_extension.CUDA_HOME = str(cuda_home)
    if not cpp_extension.is_ninja_available():
        raise BuildError(
            "ninja is not available: pip install ninja (or apt-get install ninja-build)"
        )
    torch_include = Path(cpp_extension.include_paths()[0])
    if not (torch_include / "torch" / "library.h").exists():
        raise BuildError(f"torch C++ headers are missing under {torch_include}")
    return cuda_home


def _headers_digest() -> str:
    digest = hashlib.sha256()
    for header in HEADERS:
        digest.update(header.read_bytes())
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def _one_build_at_a_time(build_dir: Path):
    """Builds into ``build_dir`` take turns under an OS file lock, which dies with its process.

    torch's own build lock is a plain file (``lock``) that a killed build leaves behind, and
    every later build then waits on it forever. Whoever holds our lock knows no other build of
    ours is running, so a ``lock`` file found then is stale: it is removed, and said so."""
    with open(build_dir / "build.flock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            print(f"megatron-paging: removing {stale}, left by a build that was stopped",
                  file=sys.stderr)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def load(arch: str | None = None, verbose: bool = False):
    """Build (if needed) and import the extension module; it needs no GPU to load.

    ``library_path(module)`` is where its shared library is.
    """
    arch = resolve_arch(arch)
    _check_toolchain()
    from torch.utils import cpp_extension

    build_dir = build_directory(arch)
    build_dir.mkdir(parents=True, exist_ok=True)
    cc = arch.replace(".", "")
    try:
        with _one_build_at_a_time(build_dir):
            module = _jit_load(cpp_extension, build_dir, cc, verbose)
    except Exception as exc:  # noqa: BLE001 - re-raised with the build folder named
        raise BuildError(
            f"building {EXTENSION_NAME} for sm_{cc} in {build_dir} failed: {exc}"
        ) from exc
    if not library_path(module).is_file():
        raise BuildError(f"the build finished but left no {EXTENSION_NAME}*.so in {build_dir}")
    sys.modules[EXTENSION_NAME] = module  # torch imports it without registering it
    return module


def _jit_load(cpp_extension, build_dir: Path, cc: str, verbose: bool):
    return cpp_extension.load(
        name=EXTENSION_NAME,
        sources=[str(s) for s in SOURCES],
        # Our own -gencode keeps torch from adding its arch list and makes the arch part
        # of the flags that decide whether a cached build is reused.
        extra_cuda_cflags=[
            # torch decides whether a cached build is current from the sources and flags
            # only: the headers' digest in the flags makes a header edit rebuild too.
            f"-DMEGATRON_PAGING_HEADERS={_headers_digest()}",
            "-O3",
            "-lineinfo",
            "-std=c++17",
            f"-gencode=arch=compute_{cc},code=sm_{cc}",
            f"-gencode=arch=compute_{cc},code=compute_{cc}",
        ],
        extra_cflags=["-O2", "-std=c++17", f"-DMEGATRON_PAGING_HEADERS={_headers_digest()}"],
        build_directory=str(build_dir),
        is_python_module=True,
        verbose=verbose,
    )


def library_path(module) -> Path:
    """The shared library a loaded extension module came from."""
    return Path(module.__file__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", help="compute capability to build for, e.g. 9.0")
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    try:
        module = load(args.arch, args.verbose)
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(library_path(module))
    return 0


if __name__ == "__main__":
    sys.exit(main())
