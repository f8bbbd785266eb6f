"""One implementation of each core computation: the package's masked softmax over attention
logits is ``ops.reference.masked_softmax`` (every other ``softmax`` or ``logsumexp`` call in
``src`` is listed below with what it normalises), and its packer of group memberships into
bit codes is ``ops.masks.group_codes`` (no other function builds powers of two of a range).
Kernels (Triton, C++) keep their own online softmax and are not Python calls."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "focus_attention"

#: the calls that normalise scores
NORMALISERS = frozenset({"softmax", "log_softmax", "logsumexp"})
#: ``module:function`` -> what its normalisation is over; everything else calls the primitive
SOFTMAX_ALLOWED = {
    "ops.reference:masked_softmax": "the masked softmax over attention logits",
    "ops.reference:sinkhorn": "Sinkhorn's row and column sums over groups (routing, not keys)",
    "ops.reference:gated_attention": "soft-gated logits, the mask folded into the gate's bias",
    "training.objectives:distill_step": "the vocabulary (distillation)",
    "training.objectives:attention_kl": "groups of query-key routing (routing, not keys)",
    "training.objectives:group_kl": "groups of query-key routing (routing, not keys)",
    "training.objectives:_query_key_coverage": "groups of query-key routing (routing, not keys)",
    "evaluation.instructions:_log_probs": "the vocabulary (answer log-likelihoods)",
    "bench.kernel:run_gate_benchmark.eager": "the timed baseline: transformers' eager attention",
}
#: the only function that builds the bit weights of group codes
PACKER = "ops.masks:_bits"
#: calls that raise 2 to a power, or shift 1 left by it
POWERS = frozenset({"pow", "pow_", "bitwise_left_shift", "exp2", "ldexp"})


def _name(call: ast.Call) -> str | None:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)


def _sites(tree: ast.AST, match) -> list[str]:
    """The qualified names (``outer.inner``; ``<module>`` at the top) of the functions
    holding a node for which ``match(node)`` is true, one entry per node."""
    found = []

    def walk(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = [*scope, child.name]
            if match(child):
                found.append(".".join(scope) or "<module>")
            walk(child, inner)

    walk(tree, [])
    return found


def _normalises(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and _name(node) in NORMALISERS


def _powers_of_a_range(node: ast.AST) -> bool:
    """``2 ** arange``, ``1 << arange``, ``pow(2, arange)``, ...: the bit weights of codes."""
    is_power = isinstance(node, ast.Call) and _name(node) in POWERS
    is_power |= isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Pow, ast.LShift))
    ranges = (n for n in ast.walk(node) if isinstance(n, ast.Call) and _name(n) == "arange")
    return is_power and any(True for _ in ranges)


def _offences(match, allowed) -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        for site in _sites(ast.parse(path.read_text()), match):
            if f"{module}:{site}" not in allowed:
                out.append(f"{path.relative_to(ROOT)}: {site}")
    return out


def test_the_finders_find_planted_code():
    planted = ast.parse(
        "def attend(q, k):\n"
        "    def inner(x):\n"
        "        return x.softmax(-1)\n"
        "    return torch.logsumexp(q @ k, -1), inner(q)\n"
        "def pack(g):\n"
        "    return (g * (1 << torch.arange(g.shape[-1]))).sum(-1)\n"
        "W = 2 ** torch.arange(8)\n"
    )
    assert sorted(_sites(planted, _normalises)) == ["attend", "attend.inner"]
    assert _sites(planted, _powers_of_a_range) == ["pack", "<module>"]


def test_one_masked_softmax():
    """A softmax or log-sum-exp over attention logits outside the primitive is a second
    implementation to keep exact: call ``ops.reference.masked_softmax`` (or
    ``masked_attention``) instead."""
    offences = _offences(_normalises, SOFTMAX_ALLOWED)
    assert not offences, "softmax outside the primitive:\n" + "\n".join(offences)


def test_the_allowed_normalisations_exist():
    """Every entry of :data:`SOFTMAX_ALLOWED` still normalises (no stale exemption)."""
    seen = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        seen |= {f"{module}:{s}" for s in _sites(ast.parse(path.read_text()), _normalises)}
    assert set(SOFTMAX_ALLOWED) <= seen, sorted(set(SOFTMAX_ALLOWED) - seen)


def test_one_group_code_packer():
    """Bit codes of memberships come from ``ops.masks.group_codes`` (``group_code_words``
    for any number of groups, ``code_groups`` back): no other function builds bit weights."""
    offences = _offences(_powers_of_a_range, {PACKER})
    assert not offences, "bit weights outside ops.masks:\n" + "\n".join(offences)
    assert _offences(_powers_of_a_range, set()) == ["src/focus_attention/ops/masks.py: _bits"]
