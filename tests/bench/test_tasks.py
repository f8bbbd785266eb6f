"""Zero-shot benchmarks through lm-evaluation-harness on a tiny random LLaMA: the ``focus``
model in lm-eval's registry, loglikelihoods equal to a direct forward and independent of the
batch size (1, 8, auto) on requests longer than the window, the scored-token statistics, the
local tasks being lm-eval's own task definitions on local data, and ``focus bench tasks`` /
``focus lm-eval`` end to end; plus one run on the real model (marked ``assets``)."""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from tiny import arrow_stream, piqa_rows, tuned_run  # noqa: E402
from tiny_assets import WORDS, make_model_dir, make_text  # noqa: E402

from focus_attention import cli  # noqa: E402
from focus_attention.assets.benchmarks import BENCHMARKS, benchmark_dir  # noqa: E402
from focus_attention.assets.cache import CACHE_FORMAT, MANIFEST_NAME  # noqa: E402
from focus_attention.bench import harness  # noqa: E402
from focus_attention.bench.harness import (  # noqa: E402
    FocusLM,
    scored_context_lengths,
    task_directory,
    token_statistics,
)
from focus_attention.hf import FocusConfig, FocusModel, get_focus_model  # noqa: E402

#: the tiny adapter: a 4-token window and one sink, so that most scored tokens are routed
FOCUS = dict(num_groups=4, window=4, top_k=1, sink_tokens=1, seed=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``(model directory, adapter directory)``: a tiny random LLaMA and fresh routers."""
    root = tmp_path_factory.mktemp("tiny-lm")
    model_dir = make_model_dir(root / "model", max_positions=256)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    get_focus_model(base, FocusConfig(**FOCUS)).save_pretrained(root / "adapter")
    return model_dir, root / "adapter"


def _requests(n: int = 12) -> list[Instance]:
    """Loglikelihood requests of 6 to 60 words (contexts longer than the window) with 1-3
    word continuations, lengths all different."""
    out = []
    for i in range(n):
        words = make_text(i, 6 + 5 * i).split()
        cut = len(words) - 1 - i % 3
        ctx, cont = " ".join(words[:cut]), " " + " ".join(words[cut:])
        out.append(Instance("loglikelihood", {}, (ctx, cont), idx=0, metadata=("tiny", i, 1)))
    return out


def _direct(lm: FocusLM, requests: list[Instance]) -> list[float]:
    """The oracle: each request alone through the wrapped model, unpadded, in fp32."""
    out = []
    for r in requests:
        ctx, cont = r.args
        whole, head = lm.tok_encode(ctx + cont), lm.tok_encode(ctx)
        ids = torch.tensor([whole])
        with torch.no_grad():
            logp = torch.log_softmax(lm.model(input_ids=ids[:, :-1]).logits.float(), -1)[0]
        targets = whole[len(head) :]
        rows = range(len(whole) - 1 - len(targets), len(whole) - 1)
        out.append(sum(float(logp[p, t]) for p, t in zip(rows, targets, strict=True)))
    return out


# --------------------------------------------------------------------------------------------
# scored tokens
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("context_len", [0, 1, 5, 30])
@pytest.mark.parametrize("continuation_len", [1, 3])
@pytest.mark.parametrize("max_length", [4, 16, 64])
def test_scored_context_lengths_follow_lm_evals_slicing(context_len, continuation_len, max_length):
    # lm-eval: inp = (ctx + cont)[-(max_length + 1):][:-1]; the logits of the last contlen
    # positions of inp score the continuation; position p attends p + 1 keys
    whole = list(range(context_len + continuation_len))
    inp = whole[-(max_length + 1) :][:-1]
    expected = [len(inp) - continuation_len + k + 1 for k in range(continuation_len)]
    expected = [e for e in expected if e >= 1]
    assert list(scored_context_lengths(context_len, continuation_len, max_length)) == expected


def test_scored_context_lengths_rejects_bad_counts():
    with pytest.raises(ValueError, match="continuation_len=0"):
        scored_context_lengths(3, 0, 16)


def test_token_statistics_shares():
    hist = {3: 2, 4: 1, 5: 3, 9: 4}  # context length: scored tokens
    stats = token_statistics(hist, window=4, sink_tokens=1)
    assert stats["scored_tokens"] == 10 and stats["max_context"] == 9
    assert stats["mean_context"] == pytest.approx((6 + 4 + 15 + 36) / 10)
    assert stats["beyond_window_share"] == pytest.approx(7 / 10)  # contexts 5 and 9
    assert stats["routed_share"] == pytest.approx(4 / 10)  # context 9 > 4 + 1
    assert "routed_share" not in token_statistics(hist, window=None)


# --------------------------------------------------------------------------------------------
# the lm-eval model
# --------------------------------------------------------------------------------------------


def test_focus_is_an_lm_eval_model(tiny):
    model_dir, adapter = tiny
    assert get_model(harness.MODEL_NAME) is FocusLM
    lm = get_model("focus").create_from_arg_string(
        f"pretrained={model_dir},adapter={adapter},top_k=2,window=6", {"batch_size": 2}
    )
    assert isinstance(lm.model, FocusModel) and lm.device.type == "cpu"
    cfg = lm.focus_config
    assert (cfg.top_k, cfg.window, cfg.num_groups, cfg.sink_tokens) == (2, 6, 4, 1)
    assert FocusLM(pretrained=str(model_dir), batch_size=1).focus_config is None  # dense


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(top_k=2), "without an adapter"),
        (dict(window=8), "without an adapter"),
        (dict(adapter="ADAPTER", top_k=9), "top_k"),
        (dict(adapter="ADAPTER", window=0), "window"),
    ],
)
def test_focus_model_bad_settings(tiny, kwargs, match):
    model_dir, adapter = tiny
    kwargs = {k: str(adapter) if v == "ADAPTER" else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=match):
        FocusLM(pretrained=str(model_dir), **kwargs)


def test_loglikelihoods_match_a_direct_forward_and_not_the_batch_size(tiny):
    model_dir, adapter = tiny
    requests = _requests()
    results = {}
    for bs in (1, 8, "auto"):
        lm = FocusLM(pretrained=str(model_dir), adapter=str(adapter), batch_size=bs,
                     max_batch_size=16)  # fmt: skip
        results[bs] = [ll for ll, _ in lm.loglikelihood(requests, disable_tqdm=True)]
    stats = lm.token_statistics()["tiny"]
    assert stats["routed_share"] > 0.8  # nearly every scored token has keys beyond 4 + 1
    direct = _direct(lm, requests)
    for bs, lls in results.items():
        assert lls == pytest.approx(direct, abs=1e-4), bs
    with lm.model.disable_focus():
        dense = _direct(lm, requests)
    # the window matters on these requests: Focus is not the dense model here
    assert max(abs(a - b) for a, b in zip(direct, dense, strict=True)) > 1e-3


@pytest.mark.parametrize("routing", ["causal", "sequence", "soft"])
def test_loglikelihoods_do_not_depend_on_batching_for_any_routing(tiny, routing):
    """lm-eval right-pads a batch with token 0 and passes no attention mask: a routing that
    balances over the whole row (Sinkhorn) must not see the pads."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, adapter = tiny
    fm = FocusModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter)
    if routing == "sequence":
        fm.focus_config = fm.focus_config.replace(inference_routing="sequence")
    tok = AutoTokenizer.from_pretrained(model_dir)
    requests = _requests()
    lm = FocusLM(pretrained=fm, tokenizer=tok, batch_size=1)
    if routing == "soft":
        fm.set_routing("soft")
    direct = _direct(lm, requests)
    for bs, order in [(1, 1), (4, 1), (4, -1), ("auto", 1)]:
        lm = FocusLM(pretrained=fm, tokenizer=tok, batch_size=bs, max_batch_size=16)
        got = [ll for ll, _ in lm.loglikelihood(requests[::order], disable_tqdm=True)]
        assert got[::order] == pytest.approx(direct, abs=1e-4), (bs, order)
    if routing != "causal":  # the routing is not the causal one on these requests
        fm.set_routing("auto").focus_config = fm.focus_config.replace(inference_routing="causal")
        causal = _direct(lm, requests)
        assert max(abs(a - b) for a, b in zip(direct, causal, strict=True)) > 1e-3


def test_pretrained_focus_model_object(tiny):
    model_dir, adapter = tiny
    from transformers import AutoModelForCausalLM, AutoTokenizer

    fm = FocusModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter)
    tok = AutoTokenizer.from_pretrained(model_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = FocusLM(pretrained=fm, tokenizer=tok, window=8, batch_size=4)
    assert lm.model is fm and fm.focus_config.window == 8
    with pytest.raises(ValueError, match="already a FocusModel"):
        FocusLM(pretrained=fm, tokenizer=tok, adapter=str(adapter))


def _tuned_oracle(model_dir, run, kind):
    """The tuned model of ``run`` built directly with peft / transformers (and the Focus
    adapter), independently of the loader under test."""
    import peft
    from transformers import AutoModelForCausalLM

    if kind == "model":
        return AutoModelForCausalLM.from_pretrained(run / "model").eval()
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), run / "lora")  # fmt: skip
    if kind == "focus+lora":
        return FocusModel.from_pretrained(model.base_model.model, run).eval()
    return model.eval()


@pytest.mark.parametrize("kind", ["lora", "model", "focus+lora"])
def test_focus_model_loads_every_kind_of_run(tiny, tmp_path, kind):
    pytest.importorskip("peft")
    model_dir, _ = tiny
    run = tuned_run(model_dir, tmp_path / kind, kind)
    requests = _requests()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = FocusLM(pretrained=str(model_dir), adapter=str(run), batch_size=4)
        base = FocusLM(pretrained=str(model_dir), batch_size=4)
    assert (lm.focus_config is not None) == (kind == "focus+lora")
    got = [ll for ll, _ in lm.loglikelihood(requests)]
    base._model = _tuned_oracle(model_dir, run, kind)
    expected = _direct(base, requests)
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 1e-4
    plain = _direct(FocusLM(pretrained=str(model_dir), batch_size=4), requests)
    assert max(abs(a - b) for a, b in zip(got, plain, strict=True)) > 1e-3  # the run changed it


def test_focus_model_refuses_focus_settings_for_a_dense_run_and_empty_directories(tiny, tmp_path):
    pytest.importorskip("peft")
    model_dir, _ = tiny
    run = tuned_run(model_dir, tmp_path / "lora", "lora")
    with pytest.raises(ValueError, match="without Focus routers"):
        FocusLM(pretrained=str(model_dir), adapter=str(run), top_k=1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no Focus adapter, LoRA adapter"):
        FocusLM(pretrained=str(model_dir), adapter=str(tmp_path / "empty"))


# --------------------------------------------------------------------------------------------
# the local tasks
# --------------------------------------------------------------------------------------------

LAMBADA = ["the house of her mother was very far", "he said that it was all a letter"]


@pytest.fixture
def bench_home(tmp_path, monkeypatch):
    """A FOCUS_HOME whose benchmark entry holds 6 PIQA and 2 LAMBADA examples."""
    monkeypatch.setenv("FOCUS_HOME", str(tmp_path / "home"))
    root = benchmark_dir()
    (root / "piqa").mkdir(parents=True)
    (root / "lambada_openai").mkdir()
    (root / BENCHMARKS["piqa"].file).write_bytes(arrow_stream(piqa_rows(6, WORDS)))
    lines = [json.dumps({"text": t}) for t in LAMBADA]
    (root / BENCHMARKS["lambada_openai"].file).write_text("\n".join(lines) + "\n")
    (root / MANIFEST_NAME).write_text(json.dumps({"format": CACHE_FORMAT, "files": {}}))
    return root


def _lm_eval_config(name: str) -> dict:
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(harness.lm_eval_tasks_root() / harness.LM_EVAL_TASK_FILES[name], resolve_func=False)  # fmt: skip


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_task_files_are_lm_evals_own_tasks(bench_home, name):
    from lm_eval.tasks._yaml_loader import load_yaml

    ours = load_yaml(task_directory([name]) / f"{name}.yaml", resolve_func=False)
    theirs = _lm_eval_config(name)
    replaced = {"dataset_path", "dataset_name", "dataset_kwargs", "tag",
                "training_split", "validation_split", "test_split"}  # fmt: skip
    assert {k: v for k, v in ours.items() if k not in replaced} == {
        k: v for k, v in theirs.items() if k not in replaced
    }
    split = BENCHMARKS[name].split
    assert ours["dataset_kwargs"]["data_files"] == {split: str(bench_home / BENCHMARKS[name].file)}
    assert [k for k in ("training_split", "validation_split", "test_split") if ours[k]] == [
        "test_split" if split == "test" else "validation_split"
    ]


def test_local_tasks_read_the_local_data(bench_home):
    manager = TaskManager(include_path=str(task_directory(["piqa", "lambada_openai"])),
                          include_defaults=False)  # fmt: skip
    tasks = manager.load(["piqa", "lambada_openai"])["tasks"]
    piqa, lambada = tasks["piqa"], tasks["lambada_openai"]
    docs = list(piqa.eval_docs)
    assert len(docs) == 6 and docs[0]["goal"] == piqa_rows(6, WORDS)["goal"][0]
    assert piqa.doc_to_text(docs[0]) == f"Question: {docs[0]['goal']}\nAnswer:"  # lm-eval's prompt
    assert [m["metric"] for m in piqa.config.metric_list] == ["acc", "acc_norm"]
    doc = next(iter(lambada.eval_docs))
    assert (lambada.doc_to_text(doc), lambada.doc_to_target(doc)) == (LAMBADA[0].rsplit(" ", 1)[0], " far")  # fmt: skip
    assert [m["metric"] for m in lambada.config.metric_list] == ["perplexity", "acc"]


def test_unknown_task_is_a_clear_error(bench_home):
    with pytest.raises(ValueError, match="unknown"):
        task_directory(["mmlu"])


# --------------------------------------------------------------------------------------------
# focus bench tasks / focus lm-eval
# --------------------------------------------------------------------------------------------


def test_focus_bench_tasks_end_to_end(bench_home, tiny, tmp_path, capsys):
    model_dir, adapter = tiny
    out = tmp_path / "tasks.json"
    rc = cli.main(["bench", "tasks", "--model", str(model_dir), "--adapter", str(adapter),
                   "--window", "6", "--tasks", "piqa", "lambada_openai", "--limit", "4",
                   "--batch-size", "3", "--bootstrap-iters", "10", "--json", str(out)])  # fmt: skip
    assert rc == 0
    table = capsys.readouterr().out
    assert "| piqa | 4 |" in table and "focus top-1 (window 6, 1 sink tokens)" in table
    result = json.loads(out.read_text())
    assert result["model"]["focus"]["window"] == 6 and result["model"]["mode"] == "focus top-1"
    assert result["versions"]["lm_eval"] == lm_eval.__version__
    assert {"cpu", "torch", "git_commit"} <= set(result["environment"])
    piqa, lambada = result["tasks"]["piqa"], result["tasks"]["lambada_openai"]
    assert (piqa["examples"], piqa["examples_in_split"], lambada["examples"]) == (4, 6, 2)
    assert set(piqa["metrics"]) == {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"}
    assert piqa["metrics"]["acc"] == pytest.approx(sum(piqa["per_example"]["acc"]) / 4)
    lls = lambada["per_example"]["loglikelihood"]
    assert lambada["metrics"]["perplexity"] == pytest.approx(math.exp(-sum(lls) / len(lls)))
    assert piqa["tokens"]["routed_share"] > 0.5 and piqa["tokens"]["max_context"] > 20


def test_focus_bench_tasks_refuses_focus_settings_without_adapter(tiny, capsys):
    model_dir, _ = tiny
    rc = cli.main(["bench", "tasks", "--model", str(model_dir), "--top-k", "1"])
    assert rc == 1 and "adapter" in capsys.readouterr().err


@pytest.mark.slow  # lm-eval's command line indexes all of its ~14,000 task files
def test_focus_lm_eval_runs_lm_evals_cli(bench_home, tiny, tmp_path, monkeypatch):
    model_dir, adapter = tiny
    monkeypatch.setattr("sys.argv", ["focus"])
    rc = cli.main(["lm-eval", "--model", "focus", "--model_args",
                   f"pretrained={model_dir},adapter={adapter},window=6,device=cpu", "--tasks", "piqa",
                   "--limit", "2", "--batch_size", "2", "--output_path", str(tmp_path / "o")])  # fmt: skip
    assert rc == 0
    written = list((tmp_path / "o").rglob("results_*.json"))
    assert len(written) == 1
    assert json.loads(written[0].read_text())["results"]["piqa"]["acc,none"] in (0.0, 0.5, 1.0)


def test_focus_model_refuses_unknown_model_args_before_loading(tiny, monkeypatch):
    model_dir, adapter = tiny
    monkeypatch.setattr(harness.HFLM, "_create_model", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(ValueError, match=r"unknown model_args \['bogus'\]; expected \['pretrained', 'adapter', 'top_k'.*'batch_size'"):  # fmt: skip
        FocusLM(pretrained=str(model_dir), adapter=str(adapter), bogus=1)
    # what HFLM or transformers' loading takes, and the fields of the model's config
    harness.check_model_args(str(model_dir), dict(dtype="float32", revision="main",
                             attn_implementation="sdpa", device_map=None, use_cache=True))  # fmt: skip


#: what lm-eval's command line passes with every model besides --model_args (its defaults)
LM_EVAL_RUN = {"batch_size": 1, "max_batch_size": None, "device": "cuda:0"}
#: a value of each documented --model_args key, and how the loaded model shows it
MODEL_ARG_CASES = {
    "pretrained": (None, lambda lm: lm.focus_config is not None),
    "adapter": (None, lambda lm: lm.focus_config.window == FOCUS["window"]),
    "top_k": ("2", lambda lm: lm.focus_config.top_k == 2),
    "window": ("6", lambda lm: lm.focus_config.window == 6),
    "device": ("cpu", lambda lm: str(lm.device) == "cpu"),
    "batch_size": ("3", lambda lm: lm.batch_size == 3),
    "max_length": ("48", lambda lm: lm.max_length == 48),
    "dtype": ("float64", lambda lm: lm.model.base_model.dtype == torch.float64),
    "revision": ("main", lambda lm: lm.revision == "main"),
}


def test_the_help_names_the_documented_model_args():
    from focus_attention.cli.harness import PREAMBLE

    assert set(MODEL_ARG_CASES) == set(harness.DOCUMENTED_MODEL_ARGS)
    for key in harness.DOCUMENTED_MODEL_ARGS:
        assert re.search(rf"\b{key}\b", PREAMBLE), key


@pytest.mark.parametrize("key", harness.DOCUMENTED_MODEL_ARGS)
def test_every_documented_model_arg_works_as_lm_evals_command_line_passes_it(tiny, key):
    """``--model_args ...,KEY=VALUE`` as lm-eval's command line builds the model: with its
    own ``--device`` and ``--batch_size`` defaults passed too, which a key of the same name
    in --model_args wins over (instead of "got multiple values")."""
    model_dir, adapter = tiny
    value, check = MODEL_ARG_CASES[key]
    args = {"pretrained": str(model_dir), "adapter": str(adapter)}
    if value is not None:
        args[key] = value
    text = ",".join(f"{k}={v}" for k, v in args.items())
    lm = get_model(harness.MODEL_NAME).create_from_arg_string(text, dict(LM_EVAL_RUN))
    assert check(lm), key
    as_dict = lm_eval.utils.simple_parse_args_string(text)  # the values typed, as from Python
    assert check(get_model(harness.MODEL_NAME).create_from_arg_obj(as_dict, dict(LM_EVAL_RUN)))


def test_a_run_argument_given_two_ways_with_two_values_is_refused(tiny):
    model_dir, adapter = tiny
    text = f"pretrained={model_dir},adapter={adapter},device=cpu"
    with pytest.raises(ValueError, match=r"device given twice, 'cpu' in --model_args and 'meta' by --device"):  # fmt: skip
        FocusLM.create_from_arg_string(text, {**LM_EVAL_RUN, "device": "meta"})
    lm = FocusLM.create_from_arg_string(text, {**LM_EVAL_RUN, "device": "cpu"})  # the same: taken
    assert str(lm.device) == "cpu"


def test_focus_lm_eval_without_arguments_shows_the_help_and_fails(capsys):
    assert cli.main(["lm-eval"]) == 2
    out, err = capsys.readouterr()
    assert "--model focus" in out and "adapter=DIR" in out and "usage: lm-eval" in out
    assert "focus: error: no arguments" in err


def test_focus_lm_eval_help_names_the_focus_model_above_lm_evals(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["lm-eval", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.index("--model focus") < out.index("usage: lm-eval")


def test_lm_evals_git_hash_is_quiet_outside_a_checkout(tmp_path, monkeypatch, capfd):
    import lm_eval.evaluator

    monkeypatch.chdir(tmp_path)
    assert lm_eval.evaluator.get_git_commit_hash is harness.git_hash
    assert harness.git_hash() is None
    assert capfd.readouterr().err == ""


# --------------------------------------------------------------------------------------------
# the real model (prepared by `focus setup --benchmarks`)
# --------------------------------------------------------------------------------------------


@pytest.mark.assets
def test_real_model_lambada(tmp_path):
    from focus_attention.assets.cache import read_manifest
    from focus_attention.assets.models import is_prepared, load_model
    from focus_attention.bench.tasks import TasksBenchConfig, run_tasks_benchmark

    if not is_prepared("smollm2-135m") or read_manifest(benchmark_dir()) is None:
        pytest.skip("needs `focus setup --benchmarks` (smollm2-135m and the benchmark data)")
    base, _ = load_model("smollm2-135m", quiet=True)
    get_focus_model(base, FocusConfig(window=16)).save_pretrained(tmp_path / "adapter")
    common = dict(tasks=("lambada_openai",), limit=6, threads=1, bootstrap_iters=10)
    dense = run_tasks_benchmark(TasksBenchConfig(**common))["tasks"]["lambada_openai"]
    focus = run_tasks_benchmark(TasksBenchConfig(adapter=str(tmp_path / "adapter"), **common))
    routed = focus["tasks"]["lambada_openai"]
    assert dense["examples"] == routed["examples"] == 6
    assert 3 < dense["metrics"]["perplexity"] < 1000  # a real model: far below the vocabulary
    assert dense["tokens"]["mean_context"] > 40  # LAMBADA passages: ~80 tokens
    assert routed["tokens"]["routed_share"] == 1.0  # every last word sees beyond 16 + 4 tokens
    a, b = dense["per_example"]["loglikelihood"], routed["per_example"]["loglikelihood"]
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) > 1e-3  # fresh routers do change them
    assert Path(focus["model"]["adapter"]).name == "adapter"
