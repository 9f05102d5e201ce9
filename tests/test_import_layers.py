"""Imports run one way between the top-level folders, server -> router -> disagg -> engine ->
kernels / kvcache, and the frontend process never loads torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Each folder may import only folders of a higher rank (further down the request path).
RANK = {"server": 0, "router": 1, "disagg": 2, "engine": 3, "kernels": 4, "kvcache": 4}


def imported_folders(path: Path) -> set[str]:
    """The other top-level folders a module imports, function-level imports included."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return {n.split(".")[1] for n in names if n.startswith("deepserve.") and n.count(".") >= 1}


def upward_imports() -> list[str]:
    found = []
    for folder, rank in RANK.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            for target in imported_folders(path) - {folder}:
                if target in RANK and RANK[target] <= rank:
                    found.append(f"{path.relative_to(ROOT)} imports {target}/")
    return found


def test_no_folder_imports_one_above_or_beside_it():
    assert upward_imports() == []


def test_the_check_sees_a_real_import():
    # The scan must find the imports that are allowed, or an empty result would prove nothing.
    assert "engine" in imported_folders(ROOT / "server" / "admission.py")
    assert "kernels" in imported_folders(ROOT / "engine" / "loading" / "loader.py")


def test_importing_the_frontend_does_not_load_torch():
    code = "import deepserve.server.frontend, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_cli_does_not_load_torch_before_a_command_needs_it():
    code = "import deepserve.server.cli, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
