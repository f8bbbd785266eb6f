"""The shape of the package: each concern on its own floor (:data:`FLOORS`: no import, be it
at the top of a file or inside a function, climbs a floor; evaluation and training import
nothing from the benchmarks), registries that hold their functions, never a
``"module:function"`` string naming one, imports at the top of their files (function-local ones only in ``cli/`` and for
optional dependencies, each with its reason), no import cycles between modules, every module
imports on its own in a fresh interpreter, functions short enough to read at once, no private
names imported across modules, and docstrings and comments that speak of the product
(sources, not process)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from focus_attention.utils.io import read_toml

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
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


# ---------------------------------------------------------------------------------------------
# floors
# ---------------------------------------------------------------------------------------------

#: the floors of the package, bottom to top: a module imports from its own unit and from the
#: units of lower floors only, never from another unit of its floor or from above. A unit is
#: a subpackage, the top-level ``settings`` module, or ``focus_attention`` (the package's own
#: ``__init__``, its front door); the ``__main__`` entry points stand above every floor.
FLOORS: tuple[tuple[str, ...], ...] = (
    ("utils",),  # plumbing: files, checks, the record of versions and hardware
    ("ops", "assets"),  # the attention ops; models, corpora and benchmark data on disk
    ("hf",),  # the adapter for transformers models, its files and the run-folder format
    ("settings",),  # the settings groups the commands compose
    ("evaluation",),  # perplexity, groups, calibration, the needle prompts
    ("deploy",),  # export and serving
    ("training",),  # the training methods on transformers.Trainer
    ("bench",),  # the benchmarks
    ("experiments",),  # studies and ablation grids
    ("focus_attention",),  # the front door: the package's own names, loaded lazily
    ("cli",),  # the focus command
)
FLOOR = {unit: i for i, units in enumerate(FLOORS) for unit in units}
#: a function named by a string, ``"focus_attention.module:function"``, which no registry
#: holds: a registry imports its functions, so that every arrow shows
REGISTRY_STRING = re.compile(r"^(focus_attention(?:\.\w+)+):(\w+)$")
#: what a function-local import may load besides the extras of pyproject.toml: modules
#: that are heavy or optional and that few callers need, and why
OPTIONAL_BEYOND_EXTRAS = {
    "matplotlib": "heavy, used only to draw plots",
    "langdetect": "if-verifiable's own dependency (the instruct extra)",
    "pyarrow": "counts the rows of saved datasets where it is installed; in no extra",
    "torch.utils.cpp_extension": "the C++ build tools of the optional fused CPU kernel",
    "datasets": "lm-eval's dependency (the bench extra), read for IFEval's prompts",
}
#: modules that import without torch (settings read by ``--help`` and the result files'
#: readers, tests/cli/test_help.py): they may import torch, or a module that imports it,
#: inside the function that needs it, with a comment saying why
TORCH_FREE = {
    "focus_attention.settings",
    "focus_attention.bench.settings",
    "focus_attention.bench.results",
    "focus_attention.bench.run_record",
    "focus_attention.hf.config",
}


def _optional_modules() -> dict[str, str]:
    """``{module: why it is optional}``: the distributions of pyproject's extras (by import
    name) and :data:`OPTIONAL_BEYOND_EXTRAS`."""
    extras = read_toml(ROOT / "pyproject.toml", "project file")["project"]["optional-dependencies"]
    out = dict(OPTIONAL_BEYOND_EXTRAS)
    for extra, requirements in extras.items():
        for requirement in requirements:
            name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
            out.setdefault(name.lower().replace("-", "_"), f"the {extra} extra")
    return out


OPTIONAL = _optional_modules()


def _unit(module: str) -> str:
    """``focus_attention.ops.sparse.api`` -> ``ops``; the package itself -> its own name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _entry_point(module: str) -> bool:
    return module.endswith("__main__")


@dataclass(frozen=True)
class Arrow:
    """``source`` uses ``target`` (modules of the package) at ``line``, in a ``kind`` of
    way: ``import``, ``local import`` (inside a function) or ``lazy export`` (a package's
    ``exports_of`` table)."""

    source: str
    target: str
    line: int
    kind: str

    def __str__(self) -> str:
        where = MODULES[self.source].relative_to(SRC)
        return f"{where}:{self.line}: {self.kind} of {self.target}"


def _package_of(name: str) -> str:
    return name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]


def _relative(package: str, level: int, rest: str) -> str:
    base = package.split(".")
    base = base[: len(base) - level + 1]
    return ".".join(base + ([rest] if rest else []))


def _import_targets(node: ast.AST, package: str) -> list[str]:
    """Every module name ``node`` (an import) may load, most specific last."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    target = _relative(package, node.level, node.module or "") if node.level else node.module
    return [target or ""] + [f"{target}.{a.name}" for a in node.names]


def _local_imports(tree: ast.AST) -> list[ast.AST]:
    """The import statements inside functions (nested ones included), once each."""
    found: dict[int, ast.AST] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    found[id(node)] = node
    return list(found.values())


def _exported_modules(tree: ast.AST) -> list[ast.Constant]:
    """The relative module strings of a package's lazy export table (``exports_of``)."""
    out = []
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "exports_of":
            out += [c for a in call.args for c in ast.walk(a)
                    if isinstance(c, ast.Constant) and isinstance(c.value, str)
                    and c.value.startswith(".")]  # fmt: skip
    return out


def _arrows(name: str) -> list[Arrow]:
    """Every use of another module of the package by module ``name``."""
    tree = ast.parse(MODULES[name].read_text())
    package, local = _package_of(name), {id(n) for n in _local_imports(tree)}
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        kind = "local import" if id(node) in local else "import"
        targets = _import_targets(node, package)
        out += [Arrow(name, t, node.lineno, kind) for t in targets if t in MODULES and t != name]
    for node in _exported_modules(tree):
        level = len(node.value) - len(node.value.lstrip("."))
        target = _relative(package, level, node.value.lstrip("."))
        if target in MODULES:
            out.append(Arrow(name, target, node.lineno, "lazy export"))
    return out


ARROWS = [a for name in MODULES if not _entry_point(name) for a in _arrows(name)]


def test_the_floors_name_every_unit_once():
    units = [u for floor in FLOORS for u in floor]
    assert len(units) == len(set(units))
    assert set(units) == {_unit(m) for m in MODULES}


def test_no_import_climbs_a_floor():
    climbing = [
        str(a)
        for a in ARROWS
        if _unit(a.source) != _unit(a.target) and FLOOR[_unit(a.target)] >= FLOOR[_unit(a.source)]
    ]
    assert climbing == []


def test_training_imports_nothing_from_bench():
    assert [str(a) for a in ARROWS if (_unit(a.source), _unit(a.target)) == ("training", "bench")] == []  # fmt: skip


def test_evaluation_imports_nothing_from_bench():
    """The retrieval ranking and the calibration that uses it live with evaluation: no
    function of a benchmark reaches them, by import or as an argument the command passes."""
    assert [str(a) for a in ARROWS if (_unit(a.source), _unit(a.target)) == ("evaluation", "bench")] == []  # fmt: skip


def test_bench_is_used_by_the_command_and_the_studies_only():
    users = {"bench", "cli", "experiments"}
    assert [str(a) for a in ARROWS if _unit(a.target) == "bench" and _unit(a.source) not in users] == []  # fmt: skip


def test_no_function_is_named_by_a_string():
    """A registry (the benchmarks', the report's views) holds its functions, imported at the
    top of its module, so that editors, type checkers and this test follow them; the
    command stays light by importing a registry when it runs, not by names in strings."""
    found = [f"{MODULES[name].relative_to(SRC)}:{node.lineno}: {node.value}"
             for name in MODULES for node in ast.walk(ast.parse(MODULES[name].read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str)
             and REGISTRY_STRING.match(node.value)]  # fmt: skip
    assert found == []


def test_no_benchmark_registry_entry_is_a_string():
    from focus_attention.bench.registry import BENCHMARKS  # imports every benchmark (torch)

    parts = [(name, part, getattr(row, part)) for name, row in BENCHMARKS.items()
             for part in ("run", "table", "plot", "notes")]  # fmt: skip
    assert [f"{name}.{part}: {value!r}" for name, part, value in parts
            if isinstance(value, str) or not (value is None or callable(value))] == []  # fmt: skip
    assert all(callable(row.run) and callable(row.table) for row in BENCHMARKS.values())


def _optional(module: str) -> bool:
    return any(module == o or module.startswith(o + ".") for o in OPTIONAL)


def _loads_optional(name: str) -> bool:
    """Module ``name`` of the package imports an optional dependency at its top."""
    tree = ast.parse(MODULES[name].read_text())
    local, package = {id(n) for n in _local_imports(tree)}, _package_of(name)
    return any(_optional(t) for n in ast.walk(tree)
               if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in local
               for t in _import_targets(n, package))  # fmt: skip


def _local_import_offence(name: str, node: ast.AST, lines: list[str]) -> str | None:
    """Why the function-local import ``node`` of module ``name`` breaks the rule, or None."""
    targets = _import_targets(node, _package_of(name))
    ours = [t for t in targets if t in MODULES]
    allowed = any(_optional(t) for t in targets) or (ours and _loads_optional(ours[-1]))
    if not (allowed or name in TORCH_FREE):
        return "not an optional dependency: import it at the top of the file"
    above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
    if "#" not in lines[node.lineno - 1] and not above.startswith("#"):
        return "no reason: say why in a comment on or above the line"
    return None


def test_function_local_imports_only_in_the_command_or_of_optional_dependencies():
    """Imports sit at the top of their files, so that every arrow shows; inside a function
    only in ``cli/`` (a command imports its work when it runs, so that ``--help`` loads no
    torch) and for an optional dependency (:data:`OPTIONAL`), with a comment saying why."""
    offenders = []
    for name, path in MODULES.items():
        if _unit(name) == "cli" or _entry_point(name):
            continue
        text = path.read_text()
        lines = text.splitlines()
        for node in sorted(_local_imports(ast.parse(text)), key=lambda n: n.lineno):
            why = _local_import_offence(name, node, lines)
            if why is not None:
                offenders.append(f"{path.relative_to(SRC)}:{node.lineno}: {lines[node.lineno - 1].strip()}: {why}")  # fmt: skip
    assert not offenders, "function-local imports:\n" + "\n".join(offenders)
