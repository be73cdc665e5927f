"""The code's shape, read from its syntax trees: modules of at most 450 lines and functions of at most 80 in every
package of the project, and no test importing a private name (a leading underscore) of them."""

from __future__ import annotations

import ast
from pathlib import Path

from serve_app.package import PACKAGES

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 450, 80


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, lines) of every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node.end_lineno - node.lineno + 1
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield from _functions(node, f"{prefix}{node.name}.")
        elif not isinstance(node, ast.expr):
            yield from _functions(node, prefix)


def oversized(package: str) -> dict[str, int]:
    """The package's modules over MAX_MODULE_LINES and functions over MAX_FUNCTION_LINES, with their lines."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        name, source = path.relative_to(ROOT).as_posix(), path.read_text()
        if (lines := len(source.splitlines())) > MAX_MODULE_LINES:
            out[name] = lines
        out.update({f"{name}:{fn}": n for fn, n in _functions(ast.parse(source)) if n > MAX_FUNCTION_LINES})
    return out


def test_modules_and_functions_within_the_limits():
    found = {name: lines for package in PACKAGES for name, lines in oversized(package).items()}
    assert not found, f"over {MAX_MODULE_LINES} lines a module or {MAX_FUNCTION_LINES} a function: {found}"


def test_the_size_check_sees_what_it_limits():
    source = "class A:\n    def f(self):\n" + "        x = 1\n" * 90 + "        def g():\n            pass\n"
    assert dict(_functions(ast.parse(source))) == {"A.f": 93, "A.f.g": 2}


def private_imports(source: str, packages=PACKAGES) -> list[str]:
    """`line: names` of the imports in `source` that name a private module or name of one of `packages`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in packages:
            names = node.module.split(".") + [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            names = [part for a in node.names if a.name.split(".")[0] in packages for part in a.name.split(".")]
        else:
            continue
        if private := [n for n in names if n.startswith("_") and not n.startswith("__")]:
            found.append(f"{node.lineno}: {', '.join(private)}")
    return found


def test_no_test_imports_a_private_name():
    assert private_imports("from serve_app.ingress import app, _Shown\nimport engines._x\nfrom os import _exit\n"
                           "from serve_app import __version__") == ["1: _Shown", "2: _x"]
    found = {path.relative_to(ROOT).as_posix(): private_imports(path.read_text())
             for path in sorted((ROOT / "tests").rglob("*.py"))}
    assert not {k: v for k, v in found.items() if v}
