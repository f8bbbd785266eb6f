"""What the benchmarks refuse or fix before they run: top_k above K, repeated grid values,
output paths that cannot be written, plots whatever their name, lengths a model cannot
take; the help of each benchmark's flags; the versions every result records."""

from __future__ import annotations

import dataclasses
import json

import pytest

from focus_attention import cli
from focus_attention.bench import settings as bench
from focus_attention.hf import FocusConfig


def _adapter_config(folder, num_groups: int):
    """A folder holding only the config file of a Focus adapter with ``num_groups`` groups."""
    folder.mkdir()
    (folder / "focus_config.json").write_text(FocusConfig(num_groups=num_groups).to_json_string())
    return str(folder)


@pytest.mark.parametrize(
    "cls, changes",
    [
        (bench.KernelBenchConfig, dict(top_k=(9, 20))),
        (bench.KernelBenchConfig, dict(top_k=(2,), num_groups=1)),
        (bench.DecodeBenchConfig, dict(top_k=(12,))),
        (bench.ModelBenchConfig, dict(top_k=(1,), num_groups=4, query_top_k=5)),
    ],
)
def test_top_k_above_the_groups_of_fresh_routers_is_refused(cls, changes):
    k = changes.get("num_groups", 8)
    with pytest.raises(ValueError, match=rf"top_k: received .*, expected ints in 1\.\.{k} \(K"):
        cls(**changes)


@pytest.mark.parametrize("cls", [bench.DecodeBenchConfig, bench.ModelBenchConfig,
                                 bench.NeedleBenchConfig, bench.TasksBenchConfig])  # fmt: skip
def test_top_k_above_the_adapters_groups_is_refused(cls, tmp_path):
    adapter = _adapter_config(tmp_path / "adapter", 4)
    top_k = 5 if cls is bench.TasksBenchConfig else (1, 5)
    with pytest.raises(ValueError, match=rf"top_k: .*1\.\.4 \(the K of the adapter {adapter}\)"):
        cls(adapter=adapter, top_k=top_k)
    config = cls(adapter=adapter, top_k=4 if cls is bench.TasksBenchConfig else (4,))
    if cls is bench.DecodeBenchConfig:
        assert config.op_groups == 4  # the op level draws the adapter's K groups


def test_the_decode_cli_refuses_top_k_above_k_before_loading(tmp_path, capsys):
    adapter = _adapter_config(tmp_path / "adapter", 8)
    rc = cli.main(["bench", "decode", "--adapter", adapter, "--contexts", "128", "--levels",
                   "op", "--top-k", "9", "--steps", "1", "--warmup", "0"])  # fmt: skip
    assert rc == 1
    assert "focus: error: --top-k: received (9,), expected ints in 1..8" in capsys.readouterr().err  # fmt: skip


def test_repeated_grid_values_run_once():
    config = bench.KernelBenchConfig(lengths=(256, 64, 256), top_k=(1, 1, 2))
    assert config.lengths == (256, 64) and config.top_k == (1, 2)
    assert bench.DecodeBenchConfig(contexts=(64, 64), levels=("op", "op")).contexts == (64,)
    assert bench.ModelBenchConfig(window=(8, 8)).window == (8,)


def _kernel(*extra: str) -> list[str]:
    return ["bench", "kernel", "--lengths", "64", "--top-k", "1", "--repeats", "1",
            "--no-memory", "--no-gates", "--window", "8", *extra]  # fmt: skip


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--json", "{tmp}"], "--json: received '{tmp}', a directory"),
        (["--json", "{tmp}/a.json", "--plot", "{tmp}"], "--plot: received '{tmp}', a directory"),
        (["--json", "{tmp}/r.png"], "--plot: received '{tmp}/r.png', the --json path"),
        (["--json", "{tmp}/f.json/r.json"], "'{tmp}/f.json' is a file"),
    ],
)
def test_output_paths_are_checked_before_the_run(tmp_path, monkeypatch, capsys, flags, match):
    from focus_attention.bench import registry

    (tmp_path / "f.json").write_text("")
    row = dataclasses.replace(registry.BENCHMARKS["kernel"], run=lambda config: pytest.fail("ran"))
    monkeypatch.setitem(registry.BENCHMARKS, "kernel", row)
    rc = cli.main(_kernel(*(f.format(tmp=tmp_path) for f in flags)))
    assert rc == 1
    assert match.format(tmp=tmp_path) in capsys.readouterr().err


PNG = b"\x89PNG\r\n\x1a\n"


def test_a_plot_is_a_png_at_the_path_given_whatever_its_name(tmp_path, capsys):
    plot = tmp_path / "plots" / "myplot"
    assert cli.main(_kernel("--json", str(tmp_path / "k.json"), "--plot", str(plot))) == 0
    assert plot.read_bytes().startswith(PNG)
    assert f"wrote {plot}\n" in capsys.readouterr().out
    assert sorted(p.name for p in plot.parent.iterdir()) == ["myplot"]  # no temporary left


def test_needle_and_serve_plots_are_pngs_at_the_path_given(tmp_path):
    from focus_attention.bench.needle import plot_needle
    from focus_attention.bench.serve import plot_serve

    grid = {"1024": {"0.5": 1.0, "1.0": 0.5}}
    plot_needle({"accuracy": {"passkey": {"dense": grid, "top_k=1": grid}}}, tmp_path / "np2")
    row = {"method": "focus", "top_k": 1, "concurrency": 4, "prompt_tokens": 64,
           "tokens_per_second": 9.0, "ttft_p50_s": 0.1, "latency_p99_s": 0.5}  # fmt: skip
    plot_serve({"rows": [row], "config": {"model": "m"}}, tmp_path / "serve.plot")
    for name in ("np2", "serve.plot"):
        assert (tmp_path / name).read_bytes().startswith(PNG)


def test_a_model_takes_no_more_tokens_than_it_can(capsys):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from focus_attention.bench.model import check_model_lengths

    torch.manual_seed(0)
    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, vocab_size=32)
    rotary = LlamaForCausalLM(LlamaConfig(num_attention_heads=2, max_position_embeddings=64, **small))  # fmt: skip
    assert check_model_lengths(rotary, 64, "ModelBenchConfig", "lengths") == 64
    assert capsys.readouterr().err == ""
    assert check_model_lengths(rotary, 65, "ModelBenchConfig", "lengths") == 64
    assert "lengths 65 is beyond the model's 64 positions" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"ModelBenchConfig.lengths: received 10+, .* GiB of activations"):  # fmt: skip
        check_model_lengths(rotary, 10**13, "ModelBenchConfig", "lengths")
    learned = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=64, vocab_size=32))  # fmt: skip
    with pytest.raises(ValueError, match=r"contexts: received 65, expected at most 64 tokens"):
        check_model_lengths(learned, 65, "DecodeBenchConfig", "contexts")


def test_the_model_benchmark_refuses_lengths_before_reading_the_corpus(assets, monkeypatch):
    from focus_attention.bench import model

    monkeypatch.setattr(model, "bench_token_ids", lambda *a: pytest.fail("read the corpus"))
    config = bench.ModelBenchConfig(model=str(assets["model"]), corpus=str(assets["corpus"]),
                                    lengths=(10**13,), warmup_tokens=8, progress=False)  # fmt: skip
    with pytest.raises(ValueError, match="ModelBenchConfig.lengths: received 10000000000000"):
        model.run_model_benchmark(config)


def _help(*words: str) -> str:
    parser = cli.build_parser("bench")
    sub = next(a for a in parser._actions if a.dest == "command").choices["bench"]
    return next(a for a in sub._actions if a.dest == "bench_command").choices[words[0]].format_help()  # fmt: skip


def test_each_benchmarks_help_fits_it():
    kernel = " ".join(_help("kernel").split())
    for text in ("adapter", "cuda if available", "default: an", "training:"):
        assert text not in kernel, text
    assert "--device DEVICE torch device: cpu or cuda (default cpu)" in kernel
    assert "(masked: every key under the mask, no host synchronisation) (default auto)" in kernel
    assert "K, the groups of the random memberships (default 8)" in kernel
    decode = " ".join(_help("decode").split())
    for name in ("query heads H", "key/value heads H_kv", "head_dim D"):
        assert f"{name} of the op level" in decode
    assert decode.count("(default: the model's)") == 3
    instructions = " ".join(_help("instructions").split())
    assert "prompts generated together (one batch) (default 8)" in instructions
    assert "training:" not in instructions


def test_command_help_needs_a_command_default():
    with pytest.raises(TypeError, match="command help needs a command default"):
        bench.command_help(seed="x")(bench.KernelBenchConfig)
    group = {f.name: f for f in dataclasses.fields(bench.DecodeBenchConfig)}["top_k"]
    assert "over the adapter's" in group.metadata["help"]  # other commands keep the group's


def test_kernel_json_records_the_library_versions(tmp_path):
    out = tmp_path / "k.json"
    assert cli.main(_kernel("--json", str(out))) == 0
    versions = json.loads(out.read_text())["versions"]
    assert {"python", "torch", "transformers", "numpy"} <= set(versions)
