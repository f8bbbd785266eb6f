"""``focus train`` under ``torchrun`` / ``accelerate launch`` on 2 CPU processes (gloo), the
Trainer's data parallelism: a 2-process run equals a 1-process run with twice the gradient
accumulation, a killed (SIGKILL) or interrupted (SIGINT) run resumes to the same result,
another world size is refused on resume, a 2-"node" launch on localhost, rank-0-only writing
(the Trainer's per-rank RNG state apart), accelerate with the committed configurations.

Every test starts real launcher processes from the running interpreter's environment, with
this tree's ``src`` first on ``PYTHONPATH``.

Tolerance: each rank back-propagates its micro-batches' loss divided by ``grad_accum`` and DDP
averages the ranks' gradients, where one process sums ``loss / (2 * grad_accum)`` over all
micro-batches: the same terms, grouped and scaled in another order, so the gradients differ
by a few float32 ulps and AdamW's normalised update by about as much relatively. The routing
bias is folded from the same batch statistics in the same order (the router gathers them).
The tests allow ``rtol = atol = 1e-5`` on the adapter's tensors and the logged losses and
validation perplexities, far below what a wrong data split or a lost rank's statistics would
change (``bias_updates``, an integer count, is compared exactly).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_assets import tiny_config

from focus_attention.training import latest_checkpoint, train
from focus_attention.training.outputs import newest_checkpoint

SRC = Path(__file__).resolve().parents[2] / "src"
REPO = SRC.parent
LAUNCH_TIMEOUT = 240  # seconds; a loaded 2-core machine starts torch in 10-30 s

#: the settings of tests/tiny_assets.py tiny_config, as ``focus train`` flags
TINY_FLAGS = [
    "--steps", "6", "--seq-len", "32", "--batch-size", "2", "--lr", "1e-2",
    "--warmup-steps", "2", "--eval-every", "3", "--eval-tokens", "64", "--save-every", "2",
    "--threads", "1", "--no-progress", "--num-groups", "4", "--top-k", "2", "--window", "8",
    "--group-dim", "8", "--sink-tokens", "1",
]  # fmt: skip

#: a ``torchrun`` script: the audit hook records every file this rank opens for writing,
#: renames, removes or creates under ``OUT``; then ``train`` runs with a callback that
#: SIGKILLs rank ``KILL_RANK`` after step ``KILL_STEP`` (when set).
WORKER = textwrap.dedent(
    """
    import json, os, signal, sys
    out = os.path.realpath(os.environ["OUT"])
    trace = []

    def under_out(path):
        try:
            return os.path.realpath(os.fsdecode(path)).startswith(out)
        except (TypeError, ValueError):
            return False

    def audit(event, args):
        if event == "open":
            path, mode, flags = args
            writing = any(c in (mode or "") for c in "wax+") or (
                mode is None and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
            if writing and under_out(path):
                trace.append([event, os.fsdecode(path)])
        elif event in ("os.rename", "os.remove", "os.mkdir", "os.rmdir", "shutil.rmtree"):
            paths = [a for a in args if isinstance(a, (str, bytes, os.PathLike))]
            if any(under_out(a) for a in paths):
                trace.append([event, *map(os.fsdecode, paths)])

    sys.addaudithook(audit)
    from focus_attention.training import TrainConfig, train

    rank = int(os.environ["RANK"])
    kill_step = int(os.environ.get("KILL_STEP", "0"))

    def callback(step, record):
        if kill_step and step == kill_step and rank == int(os.environ["KILL_RANK"]):
            os.kill(os.getpid(), signal.SIGKILL)

    try:
        train(TrainConfig.from_dict(json.loads(sys.argv[1])), callback=callback)
    finally:
        with open(os.path.join(os.environ["TRACE"], f"rank{rank}.json"), "w") as f:
            json.dump(trace, f)
    """
)


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)  # FOCUS_HOME is set by the ``assets`` fixture
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def _run(cmd: list[str], env: dict[str, str], *, ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT)  # fmt: skip
    if ok and proc.returncode != 0:
        pytest.fail(f"{cmd[:6]}... exited {proc.returncode}:\n{proc.stderr[:8000]}")
    return proc


def _tiny_cli(assets: dict, out: Path, *more: str) -> list[str]:
    return ["-m", "focus_attention.cli", "train", "--model", str(assets["model"]),
            "--corpus", str(assets["corpus"]), "--out", str(out), *TINY_FLAGS, *more]  # fmt: skip


#: the log values compared with the one-process run (the objective's other metrics and the
#: dominance are rank 0's micro-batches only; seconds are wall-clock)
COMPARED = ("loss", "val_ppl_topk", "val_ppl_soft", "val_ppl", "tokens", "learning_rate")
RTOL = 1e-5


def _log(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return [r for r in rows if "train_runtime" not in r]


def _assert_same_run(out: Path, ref: Path, *, rtol: float = RTOL) -> None:
    """The same adapter tensors (routing_bias and bias_updates included) and the same log
    entries, within ``rtol`` (module docstring)."""
    got, want = (
        load_file(str(out / "focus_model.safetensors")),
        load_file(str(ref / "focus_model.safetensors")),
    )
    assert got.keys() == want.keys() and any(k.endswith("routing_bias") for k in got)
    for k in want:
        if rtol == 0 or not want[k].is_floating_point():
            assert torch.equal(got[k], want[k]), k
        else:
            torch.testing.assert_close(got[k], want[k], rtol=rtol, atol=rtol, msg=k)
    a, b = _log(out), _log(ref)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert ra.keys() == rb.keys()
        for key in COMPARED:
            if key in rb:
                assert ra[key] == pytest.approx(rb[key], rel=rtol), (ra["step"], key)


@pytest.fixture(scope="module")
def one_process(module_assets, tmp_path_factory):
    """In-process reference runs with ``grad_accum`` 2 and 4 (the tiny settings)."""
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FOCUS_HOME", str(module_assets["home"]))
        for accum in (2, 4):
            path = tmp_path_factory.mktemp(f"one-process-{accum}") / "run"
            train(tiny_config(module_assets, path, grad_accum=accum))
            out[accum] = path
    return out


@pytest.mark.slow
def test_two_processes_equal_one_with_twice_the_accumulation(assets, one_process, tmp_path):
    out = tmp_path / "run"
    cmd = _torchrun("--standalone", "--nproc-per-node", "2", *_tiny_cli(assets, out))
    _run(cmd, _env())
    _assert_same_run(out, one_process[2])
    result = json.loads((out / "train_result.json").read_text())
    assert result["extra"]["distributed"]["sharded"] is False
    assert newest_checkpoint(out).world_size == 2
    bias = load_file(str(out / "focus_model.safetensors"))
    updates = [v for k, v in bias.items() if k.endswith("bias_updates")]
    assert updates and all(int(u) == 6 * 2 for u in updates)  # every micro-batch of both ranks


@pytest.mark.slow
def test_two_processes_with_accumulation_match_within_rounding(assets, one_process, tmp_path):
    out = tmp_path / "run"
    cmd = _torchrun("--standalone", "--nproc-per-node", "2", *_tiny_cli(assets, out, "--grad-accum", "2"))  # fmt: skip
    _run(cmd, _env())
    _assert_same_run(out, one_process[4])


def _worker(tmp_path: Path, cfg) -> tuple[list[str], Path]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    trace = tmp_path / "trace"
    trace.mkdir(exist_ok=True)
    return [str(script), json.dumps(cfg.to_dict())], trace


@pytest.mark.slow
def test_only_rank_zero_writes(assets, one_process, tmp_path):
    out = tmp_path / "run"
    args, trace = _worker(tmp_path, tiny_config(assets, out))
    _run(_torchrun("--standalone", "--nproc-per-node", "2", *args),
         _env(OUT=str(out), TRACE=str(trace)))  # fmt: skip
    rank0 = json.loads((trace / "rank0.json").read_text())
    rank1 = json.loads((trace / "rank1.json").read_text())
    # rank 1 writes only its own RNG state into each checkpoint folder (the Trainer's resume
    # needs it), creating the folder where rank 0 has not yet
    for event, *paths in rank1:
        path = Path(paths[-1])
        if event == "os.mkdir":
            assert path.name.startswith("checkpoint-") and path.parent == out / "checkpoints", path
        else:
            assert path.name == "rng_state_1.pth" and path.parent.name.startswith("checkpoint-"), (
                path
            )
    written = {Path(p).name for _, *paths in rank0 for p in paths}
    assert {"log.jsonl", "train_config.json", "train_result.json", "checkpoint-6"} <= written
    _assert_same_run(out, one_process[2])
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(p.name for p in one_process[2].iterdir())


@pytest.mark.slow
def test_killed_run_resumes_to_the_uninterrupted_result(assets, one_process, tmp_path):
    out = tmp_path / "run"
    cfg = tiny_config(assets, out)
    args, trace = _worker(tmp_path, cfg)
    env = _env(OUT=str(out), TRACE=str(trace), KILL_STEP="5", KILL_RANK="0")
    cmd = _torchrun("--standalone", "--nproc-per-node", "2", *args)
    killed = _run(cmd, env, ok=False)
    assert killed.returncode != 0
    assert "SIGKILL" in killed.stderr or f"exitcode  : -{int(signal.SIGKILL)}" in killed.stderr
    assert latest_checkpoint(out).name == "checkpoint-4"
    assert not (out / "train_result.json").exists()
    args, _ = _worker(tmp_path, tiny_config(assets, out, resume=True))
    _run(_torchrun("--standalone", "--nproc-per-node", "2", *args), _env(OUT=str(out), TRACE=str(trace)))  # fmt: skip
    _assert_same_run(out, one_process[2])
    result = json.loads((out / "train_result.json").read_text())
    assert result["start_step"] == 4 and result["steps"] == 6


@pytest.mark.slow
def test_ctrl_c_of_the_launcher_resumes_to_the_uninterrupted_result(assets, tmp_path):
    """SIGINT to the launcher's process group (Ctrl-C in its terminal) during training: rank 0
    saves the last completed step if it can, else the newest periodic checkpoint stands;
    ``--resume`` ends equal to an uninterrupted run wherever the signal fell."""
    settings = {"steps": 30, "eval_every": -1, "save_every": 5, "grad_accum": 2}
    ref = tmp_path / "reference"
    train(tiny_config(assets, ref, **settings))
    out = tmp_path / "run"
    flags = ["--steps", "30", "--eval-every", "-1", "--save-every", "5"]
    cmd = _torchrun("--standalone", "--nproc-per-node", "2", *_tiny_cli(assets, out, *flags))
    proc = subprocess.Popen(cmd, env=_env(), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        while not (out / "checkpoints" / "checkpoint-5").exists() and proc.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint of step 5"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=LAUNCH_TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode == 0:
        pytest.skip("the run finished before the signal arrived (machine too fast)")
    stopped = int(latest_checkpoint(out).name.split("-")[1])
    assert 5 <= stopped < 30, err[-3000:]
    resumed = _tiny_cli(assets, out, *flags, "--resume")
    _run(_torchrun("--standalone", "--nproc-per-node", "2", *resumed), _env())
    _assert_same_run(out, ref)


@pytest.mark.slow
def test_resume_with_another_world_size_is_refused(assets, one_process, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(one_process[2], out)
    shutil.rmtree(out / "checkpoints" / "checkpoint-6")  # resume from step 4 of 6
    cmd = _torchrun("--standalone", "--nproc-per-node", "2",
                    *_tiny_cli(assets, out, "--grad-accum", "2", "--resume"))  # fmt: skip
    proc = _run(cmd, _env(), ok=False)
    assert proc.returncode != 0
    assert "checkpoint was written by 1 processes, this run has 2" in proc.stderr


@pytest.mark.slow
def test_two_node_launch_on_localhost(assets, one_process, tmp_path):
    """The multi-node recipe: one ``torchrun`` per node, a c10d rendezvous on node 0."""
    out = tmp_path / "run"
    port = _free_port()
    nodes = []
    for node in (0, 1):
        cmd = _torchrun("--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
                        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                        "--rdzv-id", "focus-test", *_tiny_cli(assets, out))  # fmt: skip
        nodes.append(subprocess.Popen(cmd, env=_env(), cwd=REPO, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))  # fmt: skip
    try:
        outputs = [p.communicate(timeout=LAUNCH_TIMEOUT) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(nodes, outputs, strict=True):
        assert p.returncode == 0, err[-4000:]
    _assert_same_run(out, one_process[2])


ACCELERATE = Path(sys.executable).with_name("accelerate")


@pytest.mark.slow
@pytest.mark.skipif(not ACCELERATE.is_file(), reason="accelerate is not installed")
@pytest.mark.parametrize("config", ["ddp.yaml", "fsdp.yaml"])
def test_accelerate_launch_with_the_committed_configs(assets, one_process, tmp_path, config):
    """``accelerate launch --config_file configs/accelerate/{ddp,fsdp}.yaml``: accelerate
    enables FSDP on accelerators only, so on CPUs both train data-parallel (the FSDP run
    warns and records that it asked for sharding) and equal the one-process run."""
    out = tmp_path / "run"
    cmd = [str(ACCELERATE), "launch", "--config_file", str(REPO / "configs/accelerate" / config),
           "--num_processes", "2", *_tiny_cli(assets, out)]  # fmt: skip
    proc = _run(cmd, _env())
    _assert_same_run(out, one_process[2])
    layout = json.loads((out / "train_result.json").read_text())["extra"]["distributed"]
    fsdp = config == "fsdp.yaml"
    assert layout == {"world_size": 2, "requested": fsdp, "sharded": False}
    assert ("accelerate enables FSDP only on accelerators" in proc.stderr) == fsdp


@pytest.mark.slow
def test_two_processes_train_focus_and_lora_as_one_with_twice_the_accumulation(
    module_assets, assets, tmp_path
):
    """Every trained tensor is reduced, not only the routers: LoRA and routers together."""
    method = ["--method", "focus+lora", "--lora-rank", "2", "--base-lr", "1e-3"]
    ref = tmp_path / "one"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FOCUS_HOME", str(module_assets["home"]))
        train(tiny_config(module_assets, ref, grad_accum=2, method="focus+lora", lora_rank=2,
                          base_lr=1e-3))  # fmt: skip
    out = tmp_path / "run"
    _run(_torchrun("--standalone", "--nproc-per-node", "2", *_tiny_cli(assets, out, *method)),
         _env())  # fmt: skip
    _assert_same_run(out, ref)
    got = load_file(str(out / "lora" / "adapter_model.safetensors"))
    want = load_file(str(ref / "lora" / "adapter_model.safetensors"))
    assert got.keys() == want.keys() and got
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=RTOL, atol=RTOL, msg=key)
    lora_b = [v for k, v in want.items() if "lora_B" in k]
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b)  # B starts at zero: LoRA trained
