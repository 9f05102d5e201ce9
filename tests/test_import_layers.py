"""Imports run one way between the top-level folders, server -> router -> disagg -> engine ->
kernels / kvcache, no folder's modules import each other in a circle, kernels/'s backends stay
apart from the models, and the frontend process never loads torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

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


def module_name(path: Path) -> str:
    """`deepserve.<folder>.<...>` of a source file (a package's __init__.py is the package)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("deepserve", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for folder in RANK for p in sorted((ROOT / folder).rglob("*.py"))}


def imported_modules(path: Path, modules: dict[str, Path]) -> set[str]:
    """The deepserve modules a module imports, function-level imports included: `from a import b`
    counts as an import of `a.b` when that is a module, else of `a`."""
    found = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path.parent)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package upwards
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {name for name in found if name in modules}


def import_graph(folder: str) -> dict[str, set[str]]:
    """Module -> the modules of the same folder it imports."""
    modules = all_modules()
    prefix = f"deepserve.{folder}"
    inside = {m: p for m, p in modules.items() if m == prefix or m.startswith(prefix + ".")}
    return {m: imported_modules(p, modules) & inside.keys() for m, p in inside.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or one importing itself), by
    Tarjan's algorithm: each is a set of modules that import each other in a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


@pytest.mark.parametrize("folder", list(RANK))
def test_no_modules_of_a_folder_import_each_other_in_a_circle(folder):
    assert import_cycles(import_graph(folder)) == []


def test_the_cycle_check_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert import_cycles(graph) == [["a", "b", "c"], ["e"]]
    assert "deepserve.kernels.kernel_set" in import_graph("kernels")["deepserve.kernels.registry"]


# A kernel backend is a sub-package of kernels/ (reference/, cpu/, triton/, ...); the modules at
# kernels/'s top are the registry, the KernelSet contract and the plain types every layer shares.
def is_backend(module: str) -> bool:
    parts = module.split(".")
    return (
        parts[:2] == ["deepserve", "kernels"]
        and len(parts) > 2
        and (ROOT / "kernels" / parts[2]).is_dir()
    )


def test_the_reference_kernels_import_nothing_native_or_triton():
    """The oracle must not run what it checks: no module kernels/reference/ reaches, directly or
    through others, is of the native CPU or the Triton backend, nor is triton itself."""
    modules = all_modules()
    seen: set[str] = set()
    todo = [m for m in modules if m.startswith("deepserve.kernels.reference")]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += imported_modules(modules[module], modules)
    bad = {m for m in seen if m.startswith(("deepserve.kernels.cpu", "deepserve.kernels.triton"))}
    assert bad == set()
    for module in seen:
        tree = ast.parse(modules[module].read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not any(name.split(".")[0] == "triton" for name in names), module


def test_models_and_the_sampler_reach_kernels_only_through_the_kernel_set():
    engine = ROOT / "engine"
    users = [
        p
        for p in sorted(engine.rglob("*.py"))
        if "models" in p.relative_to(engine).parts[:-1] or p.name == "sampler.py"
    ]
    assert any(p.name == "llama.py" for p in users) and any(p.name == "sampler.py" for p in users)
    assert is_backend("deepserve.kernels.cpu.ops") and not is_backend("deepserve.kernels.registry")
    modules = all_modules()
    direct = [
        f"{p.relative_to(ROOT)} imports {m}"
        for p in users
        for m in sorted(imported_modules(p, modules))
        if is_backend(m)
    ]
    assert direct == []
