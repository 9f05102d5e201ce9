"""Builds and loads deepserve's native CPU kernels: the C++ sources in kernels/cpu/csrc/ (and the
headers they share), compiled with the system compiler (AVX2 + FMA, OpenMP through torch's own
thread pool) into `torch.ops.deepserve_cpu.*`. The AVX-512 and AVX512-BF16 paths of the linear,
attention and bfloat16 elementwise ops are compiled into the same library for their own targets
(kernels/cpu/csrc/isa.h);
AVX-512 is taken at run time when cpuid reports it, and `use_isa` forces any path the CPU has.

Each source file registers its ops with `TORCH_LIBRARY_FRAGMENT(deepserve_cpu, m)`, so kernels
live in separate files and this module only compiles and loads them. Two ways to get the library:

- compiled on demand (`make setup` does it once per machine): torch keeps the build under
  TORCH_EXTENSIONS_DIR keyed by the sources' hash and rebuilds only when they change; this needs a
  compiler and a writable build folder (builds are serialised by a lock that dies with its holder).
- prebuilt (`python -m deepserve.kernels.cpu.native --prebuild`, what the Docker image does at
  build time): the library is copied next to this module under a name carrying the sources' digest, and
  `load()` then only maps it. No compiler, no lock, no write: a read-only install and a non-root
  user load it. A prebuilt library of other sources is never loaded.

Nothing here imports deepserve (the Docker build runs this file by path). What does not live
here: the ops' Python calls (ops.py), when a model uses them (kernelset.py, kernels/registry.py),
and the ops themselves (csrc/).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
PREBUILT = Path(__file__).parent / "prebuilt"
NAME = "deepserve_cpu"
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-std=c++17"]


def supported() -> bool:
    """An x86 CPU with AVX2 and FMA: what the sources are compiled for."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _sources() -> list[str]:
    return sorted(str(p) for p in CSRC.glob("*.cpp"))


def _headers_digest() -> str:
    # torch rebuilds when the sources or flags change, not when a header does: the headers'
    # digest goes into the flags.
    headers = b"".join(p.read_bytes() for p in sorted(CSRC.glob("*.h")))
    return hashlib.sha256(headers).hexdigest()[:16]


def _cflags() -> list[str]:
    return [*FLAGS, f"-DDEEPSERVE_HEADERS_DIGEST={_headers_digest()}"]


def prebuilt_path() -> Path:
    """Where the prebuilt library of exactly these sources, flags and torch release lives."""
    h = hashlib.sha256(torch.__version__.encode())
    for flag in _cflags():
        h.update(flag.encode())
    for path in [*_sources(), *sorted(map(str, CSRC.glob("*.h")))]:
        h.update(Path(path).name.encode())
        h.update(Path(path).read_bytes())
    return PREBUILT / f"{NAME}-{h.hexdigest()[:16]}.so"


def _compile(build_directory: str | None = None) -> None:
    from torch.utils import cpp_extension

    if build_directory is None:
        build_directory = cpp_extension._get_build_directory(NAME, verbose=False)
    with _build_lock(Path(build_directory)):
        cpp_extension.load(
            NAME,
            _sources(),
            extra_cflags=_cflags(),
            build_directory=build_directory,
            is_python_module=False,
            verbose=False,
        )


@contextlib.contextmanager
def _build_lock(build_directory: Path) -> Iterator[None]:
    """Serialise builds with a lock the kernel releases when its holder dies, and clear torch's
    own lock file under it: torch's file is only removed by a build that finishes, so a process
    killed mid-build (a server stopped by its health-check timeout) left every later start
    waiting on it forever."""
    import fcntl

    build_directory.mkdir(parents=True, exist_ok=True)
    with open(build_directory.parent / f"{build_directory.name}.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        (build_directory / "lock").unlink(missing_ok=True)  # stale: no live builder holds ours
        yield


@functools.cache
def load() -> bool:
    """Load the ops, prebuilt when there is a matching library, else compiled (when the sources
    changed); True when `torch.ops.deepserve_cpu` is usable. False, with a warning, on a CPU
    without AVX2 or a machine without a compiler: callers then keep torch's own ops."""
    if not supported():
        return False
    prebuilt = prebuilt_path()
    try:
        if prebuilt.is_file():
            torch.ops.load_library(str(prebuilt))
        else:
            _compile()
    except (OSError, RuntimeError, ImportError) as e:
        log.warning("native CPU kernels unavailable, using torch's ops: %s", e)
        return False
    return True


def prebuild() -> Path:
    """Compile into a scratch folder and install the library as `prebuilt_path()`."""
    target = prebuilt_path()
    with tempfile.TemporaryDirectory() as build:
        _compile(build)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(build) / f"{NAME}.so", target)
    target.chmod(0o644)
    return target


def ops():
    """`torch.ops.deepserve_cpu`; call `load()` first."""
    return getattr(torch.ops, NAME)


@functools.cache
def op(name: str) -> torch._ops.OpOverload:
    """One op's overload, looked up once: a decode step makes hundreds of calls, and resolving
    `torch.ops.deepserve_cpu.<name>(...)` anew costs a few microseconds each. Call `load()` first."""
    return getattr(ops(), name).default


def supported_isas() -> list[str]:
    """The kernels' paths this CPU can run, from cpuid ("avx2", "avx512", "avx512_bf16"); call
    `load()` first."""
    return list(ops().supported_isas())


def isa() -> str:
    """The path the kernels take now: the widest the CPU has (AVX512-BF16, AVX-512, AVX2), unless
    `use_isa` chose another (kernels/cpu/csrc/isa.cpp)."""
    return ops().isa()


def set_isa(name: str) -> str:
    """Run the kernels on path `name` from now on (process-wide: the engine's `--cpu-isa`);
    returns the path that was in use. RuntimeError when the CPU lacks it."""
    return ops().set_isa(name)


@contextlib.contextmanager
def use_isa(name: str) -> Iterator[None]:
    """Run the kernels on path `name` inside the block (process-wide: for tests and benchmarks
    that compare paths, not for serving); raises RuntimeError when the CPU lacks it."""
    previous = set_isa(name)
    try:
        yield
    finally:
        set_isa(previous)


def main(argv: list[str]) -> int:
    """`python -m deepserve.kernels.cpu.native`: compile now (make setup); with `--prebuild`,
    install the prebuilt library (the Docker image's build stage)."""
    logging.basicConfig(level=logging.INFO)
    if not supported():
        return 0
    if argv == ["--prebuild"]:
        print(prebuild())
        return 0
    return 0 if load() else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
