"""The shape of the Focus layer and of the op's dispatch (docs/contributing.md, "The Focus
layer"): one dispatcher runs every backend and nothing reaches a backend around the registry;
one declaration says how many queries make a call decoding-sized; the layer's main path
(hf/attention.py) reads in one sitting; and no module-level or per-thread state carries
tensors from the pre-hook to the attention function."""

from __future__ import annotations

import ast
import re

from test_layout import MODULES, PACKAGE

from focus_attention.ops.sparse import dispatch

#: the longest main path of the Focus layer (hf/attention.py, lines)
MAX_MAIN_PATH_LINES = 200
#: the one module that runs a backend, and the one decoding-sized bound it declares
DISPATCHER = "focus_attention.ops.sparse.dispatch"
DECODE_BOUND = (DISPATCHER, "MAX_DECODE_QUERIES")
#: the entry points of this package's kernels, which only a backend calls
KERNELS = ("bucket_decode", "bucket_decode_reference", "group_prefill")
#: modules outside ops/sparse that import a module of it other than its public face
#: (``focus_attention.ops.sparse``), with the reason
BEYOND_THE_FACE = {
    "focus_attention.ops.gates": "flex: the soft gates run FlexAttention with the same block mask",
    "focus_attention.hf.config": "dispatch.backend_names, imported lazily (settings without torch)",
}
#: the Focus layer's modules, which hold no state between a pre-hook and its attention call
LAYER_MODULES = (
    "hf/attention.py",
    "hf/layer_handle.py",
    "hf/layer_call.py",
    "hf/route.py",
    "hf/heads.py",
    "hf/focus_cache.py",
    "hf/records.py",
    "hf/base_attention.py",
    "hf/compiled.py",
)


TREES = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}


def _names_used(tree: ast.AST) -> set[str]:
    """Every name a module reads or imports (``x``, ``a.x``, ``from m import x``)."""
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            used.update(a.name for a in node.names)
    return used


def _defined(tree: ast.AST) -> set[str]:
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)}


def test_backends_run_only_in_the_dispatcher():
    """``backend.run(...)`` appears in the dispatcher alone, and a backend's run function is
    named only by the module that declares it (in its ``SparseBackend``)."""
    runs = {b.run.__name__: b.run.__module__ for b in dispatch._REGISTRY.values()}
    assert set(runs) >= {"run_triton", "run_gather", "run_masked", "run_math"}
    calls, named = [], []
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            is_run = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            if is_run and node.func.attr == "run" and name != DISPATCHER:
                owner = ast.unparse(node.func.value)
                if owner not in ("asyncio", "subprocess"):
                    calls.append(f"{name}: {ast.unparse(node)}")
        named += [f"{name}: {fn}" for fn, home in runs.items()
                  if home != name and fn in _names_used(tree)]  # fmt: skip
    assert calls == [] and named == []


def test_the_kernels_are_run_by_backends_only():
    """The kernels' entry points are called by the modules of registered backends (and the
    module that defines each), never by a layer, a cache or a benchmark directly."""
    backends = {b.run.__module__ for b in dispatch._REGISTRY.values()}
    found = []
    for name, tree in TREES.items():
        for kernel in KERNELS:
            if kernel in _names_used(tree) and kernel not in _defined(tree) and name not in backends:  # fmt: skip
                found.append(f"{name}: {kernel}")
    assert found == []


def test_nothing_reaches_a_backend_around_the_registry():
    """Outside ``ops/sparse`` the op is reached through its public face
    (``focus_attention.ops``, ``focus_attention.ops.sparse``): no layer, cache, benchmark or
    command imports a backend's module."""
    face = "focus_attention.ops.sparse"
    found = []
    for name, tree in TREES.items():
        if name.startswith(face) or name in BEYOND_THE_FACE:
            continue
        package = name.rpartition(".")[0] if MODULES[name].name != "__init__.py" else name
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module  # fmt: skip
            if target and target.startswith(face + "."):
                found.append(f"{name}: {target}")
    assert found == []


def test_one_declaration_says_what_is_decoding_sized():
    """Exactly one module-level constant bounds a decoding-sized call
    (``MAX_DECODE_QUERIES``); no other module declares a number of queries, or a decoding
    bound, of its own."""
    pattern = re.compile(r"QUERIES|DECOD")
    found = []
    for name, tree in TREES.items():
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, ast.AnnAssign) else [])  # fmt: skip
            value = getattr(node, "value", None)
            is_number = isinstance(value, ast.Constant) and isinstance(value.value, int)
            for target in targets:
                if isinstance(target, ast.Name) and pattern.search(target.id) and is_number:
                    found.append((name, target.id))
    assert found == [DECODE_BOUND]


def test_the_main_path_of_the_layer_reads_in_one_sitting():
    lines = (PACKAGE / "hf" / "attention.py").read_text().count("\n")
    assert lines <= MAX_MAIN_PATH_LINES


def test_no_module_state_carries_tensors_between_hooks():
    """The Focus layer's modules keep no per-thread state (``threading.local``, a dict keyed
    by ``threading.get_ident()``) and no module-level container but the compiled operator's
    weak registry of layers: the hidden state and the cache layer travel as arguments."""
    found = []
    for rel in LAYER_MODULES:
        source = (PACKAGE / rel).read_text()
        found += [f"{rel}: {word}" for word in ("threading", "get_ident", "contextvars", "local(")
                  if word in source]  # fmt: skip
        for node in ast.parse(source).body:
            if not isinstance(node, ast.Assign | ast.AnnAssign) or "__all__" in ast.unparse(node):
                continue
            if isinstance(node.value, ast.Dict | ast.List | ast.Set | ast.Call):
                text = ast.unparse(node)
                if not re.search(r"WeakValueDictionary\(\)|itertools\.count\(\)|Callable\[", text):
                    found.append(f"{rel}: {text}")
    assert found == []
