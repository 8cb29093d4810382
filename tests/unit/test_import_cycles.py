"""No import cycles among the package's modules (issue 23, item 4).

Every import statement counts, lazy ones inside functions and ``TYPE_CHECKING`` blocks too: a
cycle hidden in a function is still a cycle in the design. The rules are those of the shared
``tools/import_cycles.py``, implemented here so the test needs nothing outside the repository:
imports of the package root are not edges, and a module may import its own parent packages
(``rayfed_proto.data.datasets`` registers in ``rayfed_proto.data``'s ``DATASETS``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "rayfed_proto"
SHARED_TOOL = Path(__file__).resolve().parents[3] / "shared" / "tools" / "import_cycles.py"


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` under the package folder ``root``."""
    mods = {}
    for f in sorted(root.rglob("*.py")):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def _imported_names(mod: str, mods: dict[str, Path], node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:  # relative: from the module's package (a package's __init__ is its own package)
        base = mod.split(".") if mods[mod].name == "__init__.py" else mod.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        name = ".".join(base + ([node.module] if node.module else []))
    else:
        name = node.module or ""
    # ``from pkg import sub`` imports the module pkg.sub; ``from pkg import obj`` the module pkg
    return [f"{name}.{a.name}" if f"{name}.{a.name}" in mods else name for a in node.names]


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package modules it imports, anywhere in its source."""
    mods = module_files(root)
    pkg = root.name
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"), filename=str(f))):
            for target in _imported_names(mod, mods, node):
                while target and target not in mods:  # an object of a module: that module
                    target = target.rpartition(".")[0]
                if (target and target != mod and target.startswith(pkg) and target != pkg
                        and not mod.startswith(target + ".")):
                    edges[mod].add(target)
    return edges


def import_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def _report(cycles: list[list[str]]) -> str:
    return "\n".join("cycle: " + " <-> ".join(c) for c in cycles)


def test_the_package_has_no_import_cycles():
    edges = import_graph(PACKAGE)
    assert "rayfed_proto.config" in edges and "rayfed_proto.tuning.spec" in edges  # the walk found the package
    cycles = import_cycles(edges)
    assert not cycles, "import cycles (lazy imports count):\n" + _report(cycles)


def test_config_imports_no_module_that_registers_checks_in_it():
    # the modules that register config checks import config; config must not import them back
    deps = import_graph(PACKAGE)["rayfed_proto.config"]
    assert not {d for d in deps if d == "rayfed_proto.system" or d.startswith("rayfed_proto.data")}, deps


_BARE_CONFIG = """
from rayfed_proto.config import ConfigError, build_config
try:
    build_config({"data": {"name": "nosuch", "partition": {"name": "nope"}}, "federation": {"rounds": 1},
                  "system": {"cost_per_sample": {"no_arch": 1.0}}})
except ConfigError as e:
    print(sorted(i.key for i in e.issues))
"""


def test_importing_only_config_still_gets_the_registered_checks():
    # a fresh interpreter that imports nothing but rayfed_proto.config: the package's __init__
    # registers the data and system checks, so unknown names and profiles are still refused
    out = subprocess.run([sys.executable, "-c", _BARE_CONFIG], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == str(sorted(["data.name", "data.partition.name", "federation.eval_every",
                                             "system.cost_per_sample.no_arch"])), out.stdout + out.stderr[-2000:]


def test_the_check_finds_a_cycle_through_a_lazy_import(tmp_path):
    pkg = tmp_path / "demo"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from demo import a\n")  # imports of the root are not edges
    (pkg / "a.py").write_text("import demo\nfrom demo.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n")  # lazy, relative
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from demo.a import X\n")
    (pkg / "sub" / "__init__.py").write_text("REG = {}\nfrom demo.sub import impl\n")
    (pkg / "sub" / "impl.py").write_text("from demo.sub import REG\nfrom ..a import f\n")  # own package: allowed
    edges = import_graph(pkg)
    assert edges["demo.b"] == {"demo.c"} and edges["demo.sub.impl"] == {"demo.a"}
    assert import_cycles(edges) == [["demo.a", "demo.b", "demo.c"]]
    (pkg / "b.py").write_text("def f():\n    pass\n")
    assert import_cycles(import_graph(pkg)) == []


@pytest.mark.skipif(not SHARED_TOOL.is_file(), reason="no ../shared/tools/import_cycles.py (the check above covers it)")
def test_the_shared_tool_agrees():
    out = subprocess.run([sys.executable, str(SHARED_TOOL), str(PACKAGE)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
