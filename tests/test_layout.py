"""The shape of the package: no import cycles between modules (function-local imports
included), every module imports on its own in a fresh interpreter, functions short enough to
read at once, no private names imported across modules, and docstrings and comments that
speak of the product (sources, not process)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "focus_attention"
#: the longest function (lines, decorators and docstring included) the package accepts
MAX_FUNCTION_LINES = 80
#: words of a development process that do not belong in the code
PROCESS_WORDS = re.compile(r"\bissue\s*#?\d|\bproduct decision\b|\bspec section\b", re.I)


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """Modules of the package that ``name`` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        found.update(c for c in candidates if c in MODULES and c != name)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (a list of nodes, first = last), or None."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt, stack)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [])):
            return found
    return None


def test_cycle_finder_finds_a_planted_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles_between_modules():
    # a package's __init__ re-exporting its children is not a cycle: leave packages out
    plain = {m for m, p in MODULES.items() if p.name != "__init__.py"}
    graph = {m: _imports(m, MODULES[m]) & plain for m in plain}
    assert _cycle(graph) is None


def _subpackage(module: str) -> str | None:
    """``focus_attention.ops.sparse.api`` -> ``ops``; None for the top-level package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_subpackages_depend_on_each_other_one_way():
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        src = _subpackage(name)
        if src is None or name.endswith("__main__"):  # entry points sit on top of it all
            continue
        deps = {_subpackage(d) for d in _imports(name, path)} - {None, src}
        graph.setdefault(src, set()).update(deps)
    assert _cycle(graph) is None


def _import_alone(name: str) -> tuple[str, str]:
    proc = subprocess.run(
        [sys.executable, "-c", f"import {name}"], capture_output=True, text=True, timeout=300
    )
    return name, proc.stderr.strip().splitlines()[-1] if proc.returncode else ""


@pytest.mark.slow
def test_every_module_imports_alone_in_a_fresh_interpreter():
    names = [m for m in MODULES if not m.endswith("__main__")]
    with ThreadPoolExecutor(max_workers=2) as pool:
        failures = {n: err for n, err in pool.map(_import_alone, names) if err}
    assert failures == {}


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            yield node.name, node.end_lineno - start + 1


def test_functions_are_short():
    long = {
        f"{path.relative_to(SRC)}:{fn}": n
        for path in MODULES.values()
        for fn, n in _functions(ast.parse(path.read_text()))
        if n > MAX_FUNCTION_LINES
    }
    assert long == {}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_private_names_imported_across_modules():
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (
                node.level or "focus_attention" in (node.module or "")
            ):
                found += [f"{name}: {a.name}" for a in node.names if _private(a.name)]
    assert found == []


def test_docstrings_and_comments_cite_sources_not_process():
    hits = [
        f"{path.relative_to(SRC)}:{i}"
        for path in MODULES.values()
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if PROCESS_WORDS.search(line)
    ]
    assert hits == []
