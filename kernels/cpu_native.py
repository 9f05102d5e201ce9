"""Builds and loads deepserve's native CPU kernels: the C++ sources in kernels/csrc/ (and the
headers they share), compiled once per machine with the system compiler (AVX2 + FMA, OpenMP
through torch's own thread pool) into `torch.ops.deepserve_cpu.*`.

Each source file registers its ops with `TORCH_LIBRARY_FRAGMENT(deepserve_cpu, m)`, so kernels
live in separate files and this module only compiles and loads them. `make setup` builds them, so
a server or a test run finds them already compiled (torch keeps the build keyed by the sources'
hash and rebuilds only when they change). What does not live here: when a model uses a native op
(kernels/reference.py decides) and the ops themselves (kernels/csrc/).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
NAME = "deepserve_cpu"
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-std=c++17"]


def supported() -> bool:
    """An x86 CPU with AVX2 and FMA: what the sources are compiled for."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@functools.cache
def load() -> bool:
    """Compile (when the sources changed) and load the ops; True when `torch.ops.deepserve_cpu`
    is usable. False, with a warning, on a CPU without AVX2 or a machine without a compiler:
    callers then keep torch's own ops."""
    if not supported():
        return False
    from torch.utils import cpp_extension

    sources = sorted(str(p) for p in CSRC.glob("*.cpp"))
    # torch rebuilds when the sources or flags change, not when a header does: the headers'
    # digest goes into the flags.
    headers = b"".join(p.read_bytes() for p in sorted(CSRC.glob("*.h")))
    digest = hashlib.sha256(headers).hexdigest()[:16]
    try:
        cpp_extension.load(
            NAME,
            sources,
            extra_cflags=[*FLAGS, f"-DDEEPSERVE_HEADERS_DIGEST={digest}"],
            is_python_module=False,
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError) as e:
        log.warning("native CPU kernels unavailable, using torch's ops: %s", e)
        return False
    return True


def ops():
    """`torch.ops.deepserve_cpu`; call `load()` first."""
    return getattr(torch.ops, NAME)


@functools.cache
def op(name: str) -> torch._ops.OpOverload:
    """One op's overload, looked up once: a decode step makes hundreds of calls, and resolving
    `torch.ops.deepserve_cpu.<name>(...)` anew costs a few microseconds each. Call `load()` first."""
    return getattr(ops(), name).default


if __name__ == "__main__":  # `python -m deepserve.kernels.cpu_native`: build now (make setup)
    logging.basicConfig(level=logging.INFO)
    raise SystemExit(0 if load() or not supported() else 1)
