"""The code's shape, read from its syntax trees: modules of at most 450 lines and functions of at most 80 in the
packages held to it (ASSERTED: every package without an entry in ALLOWED), and no test importing a private name (a
leading underscore) from serve_app.

The other packages' modules and functions over the limits are listed in ALLOWED with their sizes when the limits
came in; the test prints any that is new or has grown (`pytest -s`), and the list may only shrink: take an entry
out once it is within the limits (its package is then held to them once it has no entry left)."""

from __future__ import annotations

import ast
from pathlib import Path

from serve_app.package import PACKAGES

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 450, 80
ALLOWED = {  # module, or module:function (its qualified name) -> lines
}
# held to the limits: every package without an entry in ALLOWED
ASSERTED = tuple(p for p in PACKAGES if not any(name.startswith(f"{p}/") for name in ALLOWED))


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
    for package in PACKAGES:
        found = oversized(package)
        if package in ASSERTED:
            assert not found, f"{package}: over {MAX_MODULE_LINES} lines a module or {MAX_FUNCTION_LINES} a " \
                              f"function: {found}"
        for name, lines in found.items():
            if lines > ALLOWED.get(name, 0):
                print(f"over the limits, {'new' if name not in ALLOWED else 'grown'}: {name} ({lines} lines)")


def test_the_size_check_sees_what_it_limits():
    source = "class A:\n    def f(self):\n" + "        x = 1\n" * 90 + "        def g():\n            pass\n"
    assert dict(_functions(ast.parse(source))) == {"A.f": 93, "A.f.g": 2}


def private_imports(source: str, package: str = "serve_app") -> list[str]:
    """`line: names` of the imports in `source` that name a private module or name of `package`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == package:
            names = node.module.split(".") + [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            names = [part for a in node.names if a.name.split(".")[0] == package for part in a.name.split(".")]
        else:
            continue
        if private := [n for n in names if n.startswith("_") and not n.startswith("__")]:
            found.append(f"{node.lineno}: {', '.join(private)}")
    return found


def test_no_test_imports_a_private_name_from_serve_app():
    assert private_imports("from serve_app.ingress import app, _Shown\nimport serve_app._x\nfrom os import _exit\n"
                           "from serve_app import __version__") == ["1: _Shown", "2: _x"]
    found = {path.relative_to(ROOT).as_posix(): private_imports(path.read_text())
             for path in sorted((ROOT / "tests").rglob("*.py"))}
    assert not {k: v for k, v in found.items() if v}
