"""Seconds to route one call of every routed layer of a query-key adapter, with the centroids
folded into the attention's query and key maps (``QueryKeyRouter.folded_scores``) against
recomputing the pre-rotary queries and keys, timed in turns on the adapter's own base model.
The hidden states are the base model's at each layer's input, for the first ``N`` tokens of
the validation book (a prefill) and for one token after them (a decoding step); the two
paths' memberships are compared as well.

usage: python experiments/routing-diagnostic/folded_routing.py ADAPTER OUT.json \
    [--lengths 8192 1] [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from focus_attention.assets.corpora import load_corpus
from focus_attention.assets.models import load_model
from focus_attention.bench.timing import interleaved_median_seconds
from focus_attention.hf import FocusModel
from focus_attention.hf.architectures import attention_modules, get_architecture
from focus_attention.utils.env import environment
from focus_attention.utils.io import write_json_atomic


def layer_inputs(fm: FocusModel, modules: dict, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """The hidden state entering each routed layer's attention (dense layers left out), ``{layer: [1, N, d_model]}``."""
    seen: dict[int, torch.Tensor] = {}

    def keep(i: int):
        def hook(_module, args, kwargs) -> None:
            seen.setdefault(i, kwargs.get("hidden_states", (args or [None])[0]))

        return hook

    routed = [int(i) for i in fm.routers if int(i) not in set(fm.focus_config.dense_layers or ())]
    hooks = [modules[i].register_forward_pre_hook(keep(i), with_kwargs=True) for i in routed]
    with torch.no_grad(), fm.disable_focus():
        fm(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    return seen


@contextlib.contextmanager
def recomputed(routers):
    """Routers that recompute the pre-rotary states (no folded maps)."""
    for r in routers:
        r.folded_scores = lambda *_a: None
    try:
        yield
    finally:
        for r in routers:
            del r.folded_scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("adapter")
    parser.add_argument("out")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 1])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base, tokenizer = load_model("smollm2-135m", quiet=True)
    fm = FocusModel.from_pretrained(base, args.adapter).eval()
    cfg = fm.focus_config
    top_ks = (cfg.top_k, cfg.resolved_query_top_k)
    modules = attention_modules(fm.base_model, get_architecture(fm.base_model))
    text = "\n".join(load_corpus("austen", quiet=True).texts("validation"))
    tokens = tokenizer(text, add_special_tokens=False)["input_ids"][: max(args.lengths) + 1]
    rows = []
    for n in args.lengths:
        ids = torch.as_tensor(tokens[: max(n, 2)])[None]
        inputs = {i: h[:, -n:] for i, h in layer_inputs(fm, modules, ids).items()}
        pairs = [(modules[i], fm.routers[str(i)], h) for i, h in inputs.items()]

        def route(pairs=pairs):
            with torch.no_grad():
                return [r.group_sets(m, h, top_ks) for m, r, h in pairs]

        folded = route()
        with recomputed([r for _, r, _ in pairs]):
            plain = route()
        differ = sum(int((a != b).any(-1).sum()) for f, p in zip(folded, plain, strict=True) for a, b in zip(f, p, strict=True))  # fmt: skip
        times = interleaved_median_seconds(
            {"folded": route, "recomputed": route}, args.repeats, warmup=1,
            contexts={"recomputed": lambda p=pairs: recomputed([r for _, r, _ in p])},
        )  # fmt: skip
        rows.append({"tokens": n, "layers": len(pairs), "folded_seconds": times["folded"][0],
                     "recomputed_seconds": times["recomputed"][0],
                     "speedup": times["recomputed"][0] / times["folded"][0],
                     "memberships_differing": differ})  # fmt: skip
        print(f"{n} tokens, {len(pairs)} layers: folded {times['folded'][0] * 1e3:.2f} ms, "
              f"recomputed {times['recomputed'][0] * 1e3:.2f} ms; {differ} token-head rows differ")  # fmt: skip
    write_json_atomic(args.out, {"config": vars(args), "rows": rows, "environment": environment()})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
