"""The native CPU kernels (kernels/cpu/csrc/) build on this machine and run on torch's own thread pool."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepserve.kernels.cpu import native as cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.supported(), reason="needs an AVX2 CPU")


def test_native_kernels_build_and_load():
    assert cpu_native.load()
    assert cpu_native.ops().abi_version() == 1


def test_native_parallel_loops_use_torchs_thread_count():
    cpu_native.load()
    assert cpu_native.ops().parallel_threads(64) == torch.get_num_threads()


def test_process_keeps_one_openmp_runtime():
    # A second libgomp would mean a second thread pool: both stop spin-waiting and slow down.
    cpu_native.load()
    cpu_native.ops().parallel_threads(64)
    torch.matmul(torch.randn(256, 256), torch.randn(256, 256))
    with open("/proc/self/maps") as maps:
        gomps = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(gomps) <= 1, gomps


def _built_library() -> Path:
    """The library this process loaded: the set-up's prebuilt one, else torch's build."""
    from torch.utils import cpp_extension

    assert cpu_native.load()
    if cpu_native.prebuilt_path().is_file():
        return cpu_native.prebuilt_path()
    return Path(cpp_extension._get_build_directory(cpu_native.NAME, False)) / "deepserve_cpu.so"


def _without_a_compiler(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PATH": str(tmp_path / "no-bin"),  # no c++, no ninja
        "CXX": str(tmp_path / "no-bin" / "c++"),
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "missing" / "extensions"),
    }


def test_prebuilt_library_loads_without_compiler_or_writable_build_folder(tmp_path):
    """What the Docker image does: a non-root user, no compiler, an install it cannot write."""
    prebuilt = tmp_path / "prebuilt"
    prebuilt.mkdir()
    name = cpu_native.prebuilt_path().name
    shutil.copyfile(_built_library(), prebuilt / name)
    prebuilt.chmod(0o555)
    script = (
        "import sys; from pathlib import Path; from deepserve.kernels.cpu import native as c;"
        "c.PREBUILT = Path(sys.argv[1]); ok = c.load();"
        "print(ok, c.ops().abi_version() if ok else None)"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(prebuilt)],
        env=_without_a_compiler(tmp_path),
        capture_output=True,
        text=True,
    )
    assert result.stdout.split() == ["True", "1"], result.stderr
    assert not (tmp_path / "missing").exists()


def test_a_start_after_set_up_maps_the_prebuilt_library_and_compiles_nothing(tmp_path):
    """`make setup` installs the library prebuilt, so `.venv/bin/deepserve serve` (or any start
    outside make, without its TORCH_EXTENSIONS_DIR) only maps it: no compiler is needed."""
    script = "from deepserve.kernels.registry import kernels_in_use; print(kernels_in_use('cpu'))"
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=_without_a_compiler(tmp_path),
        capture_output=True,
        text=True,
    )
    assert result.stdout.split() == ["native"], result.stderr
    assert not (tmp_path / "missing").exists()


def test_prebuilt_name_changes_with_the_sources(tmp_path, monkeypatch):
    before = cpu_native.prebuilt_path().name
    csrc = tmp_path / "csrc"
    shutil.copytree(cpu_native.CSRC, csrc)
    with open(next(csrc.glob("*.cpp")), "a") as f:
        f.write("\n// changed\n")
    monkeypatch.setattr(cpu_native, "CSRC", csrc)
    assert cpu_native.prebuilt_path().name != before


def test_a_build_killed_midway_does_not_block_the_next(tmp_path: Path) -> None:
    # torch's lock file stays behind when its builder is killed; the next build must not wait on it
    build = tmp_path / "deepserve_cpu"
    build.mkdir()
    (build / "lock").write_text("")
    with cpu_native._build_lock(build):
        assert not (build / "lock").exists()
