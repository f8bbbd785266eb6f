"""The fused CPU kernel's build and threading (its exactness is in test_sparse_attention)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from focus_attention.ops import fused_kernel_available
from focus_attention.ops.sparse import extension

from .helpers import assert_matches_oracle, make_case

pytestmark = pytest.mark.skipif(
    os.environ.get("FOCUS_NO_EXTENSION", "") not in ("", "0"), reason="FOCUS_NO_EXTENSION set"
)


def test_the_kernel_builds_here(kernel_built):
    """CI machines have a compiler: a silent fall back to cpu_flash would hide a broken build."""
    assert kernel_built and fused_kernel_available(), extension.unavailable_reason()


def test_the_kernel_source_ships_with_the_package():
    """pyproject's package-data must name the source's place in the package."""
    assert extension.SOURCE.is_file()
    assert extension.SOURCE.parent.parent.name == "sparse"


@pytest.mark.parametrize("top_k", [1, 2])
def test_threads_give_identical_results(top_k, fused_kernel):
    """Work items are pulled by every thread in any order; each writes its own rows, so
    the result is bitwise the same with 1 or 2 threads (and equals the oracle)."""
    case = make_case(
        batch=2,
        nk=700,
        nq=650,
        heads=6,
        kv_heads=2,
        groups=5,
        top_k=top_k,
        window=9,
        padding="random",
        seed=11,
    )
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = case.sparse("cpu_fused", return_lse=True)
        torch.set_num_threads(2)
        two = case.sparse("cpu_fused", return_lse=True)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    assert_matches_oracle(case, *two)


@pytest.mark.slow
def test_a_failed_build_says_why_and_where_from_the_callers_line(tmp_path):
    """A build that fails (here: no compiler) warns once, from the user's line, with the
    first error and the path of the full log; the op still answers through cpu_flash."""
    script = """
import warnings, torch
from focus_attention.ops import sparse_attention
q = k = v = torch.randn(1, 1, 8, 4)
g = torch.ones(1, 8, 2, dtype=torch.bool)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    sparse_attention(q, k, v, g, g, 2)
assert len(caught) == 1 and caught[0].category is RuntimeWarning, caught
print(caught[0].filename)
print(caught[0].message)
"""
    env = dict(os.environ, FOCUS_HOME=str(tmp_path), CXX="/nonexistent/c++")
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-2000:]
    filename, message = done.stdout.strip().split("\n", 1)
    assert filename == "<string>"  # the caller's code, not torch's or ours
    assert "build-error.log" in message
    logs = list(tmp_path.glob("extensions/*/build-error.log"))
    assert logs and "nonexistent" in logs[0].read_text()


# --- the build's key: every environment of one install loads one library -----------------

#: a CPython extension without torch's headers, which compiles in a second: what the build
#: machinery does with it, it does with the kernel
TOY_SOURCE = textwrap.dedent("""
    #include <Python.h>
    #define TOY_STR2(x) #x
    #define TOY_STR(x) TOY_STR2(x)
    #define TOY_CAT2(a, b) a##b
    #define TOY_CAT(a, b) TOY_CAT2(a, b)
    static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
    static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {nullptr, nullptr, 0, nullptr}};
    static PyModuleDef toy = {PyModuleDef_HEAD_INIT, TOY_STR(TORCH_EXTENSION_NAME), nullptr, -1, methods};
    PyMODINIT_FUNC TOY_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&toy); }
""")

#: a process that loads the toy extension (the source's path is its argument) and prints
#: the library's path and its answer
LOAD_TOY = """
import sys
from pathlib import Path
from focus_attention.ops.sparse import extension
module = extension.load_library(Path(sys.argv[1]), "toy", cflags=["-O0"], ldflags=[])
print(module.__name__, module.answer())
"""

#: prints the key of the real kernel's build folder
KEY = "from focus_attention.ops.sparse import extension; print(extension.build_directory().name)"

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _environments(tmp_path: Path) -> list[tuple[dict[str, str], Path]]:
    """Two environments of one install, as a user alternates them: the virtual environment
    activated (its bin first on PATH, ``VIRTUAL_ENV`` set) in one folder, and not activated
    in another folder with another ``ninja`` first on PATH (one that only builds: it is a
    copy of the real one)."""
    venv_bin = str(Path(sys.executable).parent)
    plain_path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                                 if p != venv_bin)  # fmt: skip
    other_ninja = tmp_path / "other-ninja"
    other_ninja.mkdir()
    real = shutil.which("ninja") or str(Path(sys.executable).parent / "ninja")
    if Path(real).exists():
        (other_ninja / "ninja").symlink_to(real)
    base = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    base.update(FOCUS_HOME=str(tmp_path / "home"), PYTHONPATH=SRC)
    cwd_a, cwd_b = tmp_path / "a", tmp_path / "b"
    cwd_a.mkdir(), cwd_b.mkdir()
    activated = {**base, "PATH": f"{venv_bin}{os.pathsep}{plain_path}",
                 "VIRTUAL_ENV": str(Path(sys.executable).parent.parent)}  # fmt: skip
    plain = {**base, "PATH": f"{other_ninja}{os.pathsep}{plain_path}"}
    return [(activated, cwd_a), (plain, cwd_b)]


def _run(code: str, env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def test_the_kernels_build_key_is_the_same_in_every_environment(tmp_path):
    keys = {_run(KEY, env, cwd).stdout.strip() for env, cwd in _environments(tmp_path)}
    assert len(keys) == 1 and "" not in keys, keys


def test_the_build_key_changes_with_each_ingredient(tmp_path, monkeypatch):
    source = tmp_path / "toy.cpp"
    source.write_text(TOY_SOURCE)
    key = extension.build_directory(source, ["-O0"], []).name
    source.write_text(TOY_SOURCE + "// another text\n")
    assert extension.build_directory(source, ["-O0"], []).name != key
    source.write_text(TOY_SOURCE)
    assert extension.build_directory(source, ["-O1"], []).name != key
    assert extension.build_directory(source, ["-O0"], ["-lm"]).name != key
    monkeypatch.setattr(extension.torch, "__version__", "0.0.0")
    assert extension.build_directory(source, ["-O0"], []).name != key
    monkeypatch.undo()
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert extension.build_directory(source, ["-O0"], []).name != key
    monkeypatch.undo()
    copy = tmp_path / "clone" / "toy.cpp"  # another clone of the same source
    copy.parent.mkdir()
    copy.write_text(TOY_SOURCE)
    assert extension.build_directory(copy, ["-O0"], []).name == key


def _build_lines(done: subprocess.CompletedProcess) -> list[str]:
    assert done.returncode == 0, done.stderr[-3000:]
    return [line for line in done.stderr.splitlines() if "building the C++ extension" in line]


def test_two_environments_alternating_build_once(tmp_path):
    """The first process builds (saying so, with its reason); the other environment and the
    first again load that library, which is never rewritten."""
    source = tmp_path / "toy.cpp"
    source.write_text(TOY_SOURCE)
    (env_a, cwd_a), (env_b, cwd_b) = _environments(tmp_path)
    first = _run(LOAD_TOY, env_a, cwd_a, str(source))
    built = _build_lines(first)
    assert len(built) == 1 and "no library of it was built here yet" in built[0], first.stderr
    assert first.stdout.split()[1] == "42"
    [library] = (tmp_path / "home" / "extensions").glob("*/toy_*.so")
    stamp = library.stat()
    for env, cwd in ((env_b, cwd_b), (env_a, cwd_a), (env_b, cwd_b)):
        done = _run(LOAD_TOY, env, cwd, str(source))
        assert _build_lines(done) == [] and done.stdout == first.stdout, done.stderr
    after = library.stat()
    assert (after.st_ino, after.st_mtime_ns) == (stamp.st_ino, stamp.st_mtime_ns)
    manifest = json.loads((library.parent / extension.MANIFEST_NAME).read_text())
    assert manifest == extension.build_ingredients(source, ["-O0"], [])
    assert [p.name for p in library.parent.iterdir() if p.name.startswith(".build-")] == []


@pytest.mark.slow
def test_processes_starting_together_build_once(tmp_path):
    source = tmp_path / "toy.cpp"
    source.write_text(TOY_SOURCE)
    envs = _environments(tmp_path)
    running = [subprocess.Popen([sys.executable, "-c", LOAD_TOY, str(source)], env=env, cwd=cwd,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for env, cwd in envs * 2]  # fmt: skip
    outputs = [p.communicate(timeout=600) for p in running]
    assert all(p.returncode == 0 for p in running), outputs
    builds = [err for _, err in outputs if "building the C++ extension" in err]
    assert len(builds) == 1, outputs
    assert len({out for out, _ in outputs}) == 1


@pytest.mark.slow
def test_a_changed_ingredient_builds_again_and_names_it(tmp_path):
    source = tmp_path / "toy.cpp"
    source.write_text(TOY_SOURCE)
    (env, cwd), _ = _environments(tmp_path)
    assert len(_build_lines(_run(LOAD_TOY, env, cwd, str(source)))) == 1
    source.write_text(TOY_SOURCE + "// a new version\n")
    built = _build_lines(_run(LOAD_TOY, env, cwd, str(source)))
    assert len(built) == 1 and "built with another source_sha256" in built[0]


@pytest.mark.slow
def test_a_failed_build_leaves_no_library_and_the_next_run_says_why_it_builds(tmp_path):
    source = tmp_path / "toy.cpp"
    source.write_text(TOY_SOURCE + "this is not C++;\n")
    (env, cwd), _ = _environments(tmp_path)
    done = _run(LOAD_TOY, env, cwd, str(source))
    assert done.returncode != 0 and "ExtensionBuildError" in done.stderr
    assert "build-error.log" in done.stderr
    folder = next((tmp_path / "home" / "extensions").iterdir())
    assert not list(folder.glob("*.so")) and not list(folder.glob(".build-*"))
    again = _run(LOAD_TOY, env, cwd, str(source))
    assert "the last build failed" in again.stderr


@pytest.mark.slow
def test_the_kernel_loads_in_two_environments_with_at_most_one_build(tmp_path, kernel_built):
    """The real kernel, in this install's cache (built once per install, as users get it):
    the two environments load one library; neither rebuilds it."""
    if not kernel_built:
        pytest.skip(f"the cpu_fused kernel is unavailable: {extension.unavailable_reason()}")
    code = "from focus_attention.ops.sparse import extension; assert extension.load() is not None"
    for env, cwd in _environments(tmp_path):
        env = {**env, "FOCUS_HOME": str(extension.focus_home())}
        done = _run(code, env, cwd)
        assert _build_lines(done) == [], done.stderr
