"""docs/architecture.md lists every module of the package and names no module that does not exist
(issue 37, item 7), and the layer rules its picture shows hold on the source.

Convention: the page names a module by its path relative to ``rayfed_proto/`` (``runtime/driver.py``,
``config.py``, ``algorithms/__init__.py``). An ``__init__.py`` that holds no code (a docstring at
most) need not be listed. Only the source is read (``ast``): nothing is imported, no Ray, no torch.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "rayfed_proto"
DOC = REPO / "docs" / "architecture.md"

# a path not preceded by a path character, so that ``config.py`` does not match inside ``x/config.py``
_BEFORE = r"(?<![\w/.-])"
_PATH = re.compile(_BEFORE + r"((?:[A-Za-z_][\w]*/)*[A-Za-z_][\w]*\.py)(?![\w/])")

# the picture's rules (docs/architecture.md, "The layers")
NEVER_RAY = ["algorithms/", "data/", "models/", "messages.py", "config.py", "registry.py", "numbers.py", "system.py",
             "optim.py", "runtime/core.py", "runtime/client_core.py", "runtime/server_core.py", "runtime/stepping.py",
             "training/", "runtime/policies.py", "runtime/inflight.py",
             "runtime/simclock.py", "runtime/evaluations.py", "runtime/parking.py"]
SHARED = {"async_weights", "base", "common", "schedules"}  # algorithms/ modules that are not methods


def _holds_code(tree: ast.Module) -> bool:
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    return bool(body)


def package_modules() -> dict[str, ast.Module]:
    """Path relative to the package (posix) -> parsed source, for every module the page must list."""
    mods = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(f.read_text(encoding="utf-8"), filename=str(f))
        if f.name == "__init__.py" and not _holds_code(tree):
            continue
        mods[f.relative_to(PACKAGE).as_posix()] = tree
    return mods


def _named(doc: str, rel: str) -> bool:
    return re.search(_BEFORE + re.escape(rel) + r"(?![\w/])", doc) is not None


def test_every_module_is_listed():
    doc = DOC.read_text(encoding="utf-8")
    missing = [rel for rel in package_modules() if not _named(doc, rel)]
    assert not missing, (f"docs/architecture.md does not list {len(missing)} module(s) of rayfed_proto/: "
                         f"{', '.join(missing)}; add each, by its path relative to rayfed_proto/, with one line "
                         "saying what it holds, under its layer in 'Package layout'")


def unknown_paths(doc: str) -> list[str]:
    """The module paths ``doc`` names that are not files of the package. A path under one of the
    package's folders (or spelt ``rayfed_proto/...``) must be that file; a bare name
    (``scheduler.py``) must be a module somewhere in the package. Paths elsewhere (``tests/...``,
    ``bench/...``, a plug-in's ``my_pkg/...``) are not the package's and are not checked."""
    subpackages = {d.name for d in PACKAGE.iterdir() if d.is_dir() and (d / "__init__.py").exists()}
    basenames = {f.name for f in PACKAGE.rglob("*.py")}
    unknown = set()
    for path in _PATH.findall(doc):
        if path.startswith("rayfed_proto/"):
            ok = (PACKAGE / path.removeprefix("rayfed_proto/")).is_file()
        elif "/" not in path:
            ok = path in basenames
        elif path.split("/")[0] in subpackages:
            ok = (PACKAGE / path).is_file()
        else:
            continue
        if not ok:
            unknown.add(path)
    return sorted(unknown)


def test_every_module_path_named_exists():
    unknown = unknown_paths(DOC.read_text(encoding="utf-8"))
    assert not unknown, (f"docs/architecture.md names module paths that do not exist: {', '.join(unknown)}; "
                         "a module was renamed or removed: update the page")


def _imports(tree: ast.Module, module_level_only: bool = False) -> list[tuple[str, int]]:
    """(imported module, line) for each import statement; ``module_level_only``: not inside a function."""
    skip: set[int] = set()
    if module_level_only:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                skip.update(id(n) for n in ast.walk(node))
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.module, node.lineno)]
            found += [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
    return found


def _is_ray(name: str) -> bool:
    return name == "ray" or name.startswith("ray.")


def test_the_layer_rules_of_the_picture_hold():
    mods = package_modules()
    # a method's module: what algorithms/__init__.py imports so that it registers (not the shared ones)
    methods = {f"rayfed_proto.algorithms.{Path(m).stem}" for m in mods
               if m.startswith("algorithms/") and Path(m).stem not in SHARED and not Path(m).stem.startswith("_")}
    assert methods, "no method module found under algorithms/"
    broken = []
    for rel, tree in mods.items():
        if any(rel == rule or (rule.endswith("/") and rel.startswith(rule)) for rule in NEVER_RAY):
            broken += [f"{rel}:{line} imports {name} (never Ray)" for name, line in _imports(tree) if _is_ray(name)]
        if rel.startswith("tracking/"):
            broken += [f"{rel}:{line} imports {name} at module level (tracking has no Ray)"
                       for name, line in _imports(tree, module_level_only=True) if _is_ray(name)]
        if rel != "cli.py" and not rel.startswith("__main__"):  # the CLI is a front end: nothing imports it
            broken += [f"{rel}:{line} imports {name} (the API and the library never depend on the CLI)"
                       for name, line in _imports(tree) if name == "rayfed_proto.cli" or name.startswith("rayfed_proto.cli.")]
        if not rel.startswith("algorithms/"):  # nothing outside algorithms/ names a method's module
            broken += [f"{rel}:{line} imports {name} (the runtime never names an algorithm)"
                       for name, line in _imports(tree) if name in methods]
    assert not broken, "the layers of docs/architecture.md are broken:\n" + "\n".join(broken)
