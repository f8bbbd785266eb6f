"""The documentation holds together: every relative link of the README, the guides in docs/,
the studies' READMEs and configs/README.md resolves to a file or folder of the repository (and
to a heading, for an anchor into a Markdown file), nothing points outside the repository, the
commands the pages show use flags that the parser has, and the README's Python code runs."""

from __future__ import annotations

import argparse
import re
import shlex
import unicodedata
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the pages whose links must resolve
PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "configs" / "README.md",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "experiments").glob("**/README.md"),
    ]
)
#: the pages that teach the commands (the others record how results were measured)
GUIDE_PAGES = [ROOT / "README.md", ROOT / "configs" / "README.md", *(ROOT / "docs").glob("*.md")]
GUIDES = ("index", "training", "evaluation", "long-inputs", "integration", "method", "cli")
FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
UP_PATH = re.compile(r"(?<![\w./])((?:\.\./)+[\w.\-/]*)")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _prose_and_code(text: str) -> tuple[list[tuple[int, str]], list[tuple[str, str]]]:
    """The lines outside fenced code blocks (numbered) and the fenced blocks as
    ``(info string, body)``."""
    prose, blocks, block, info = [], [], None, ""
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.strip()):
            if block is None:
                block, info = [], line.strip().lstrip("`~").strip()
            else:
                blocks.append((info, "\n".join(block)))
                block = None
        elif block is not None:
            block.append(line)
        else:
            prose.append((number, line))
    return prose, blocks


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but ``-`` and ``_`` dropped,
    each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def markdown_slug(heading: str) -> str:
    """The anchor Python-Markdown's ``toc`` extension (mkdocs) gives a heading."""
    value = unicodedata.normalize("NFKD", heading)
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def anchors(path: Path, slug=github_slug) -> set[str]:
    """Every heading anchor of the Markdown file ``path`` (duplicates numbered as GitHub
    numbers them: ``name``, ``name-1``, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_and_code(path.read_text(encoding="utf-8"))[0]:
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """``(line, target)`` of every inline link and image of ``path``, code excluded."""
    found = []
    for number, line in _prose_and_code(path.read_text(encoding="utf-8"))[0]:
        found += [(number, m.group(1)) for m in LINK.finditer(CODE_SPAN.sub("", line))]
    return found


def link_problem(page: Path, target: str) -> str | None:
    """Why ``target`` (a link on ``page``) is broken, or None when it resolves."""
    parts = urlsplit(target)
    if parts.scheme or parts.netloc:
        return None if parts.scheme in ("http", "https") else "not a web or repository link"
    if target.startswith(("/", "\\")):
        return "an absolute path: links must be relative to the page"
    file = (page.parent / unquote(parts.path)).resolve() if parts.path else page
    if not file.is_relative_to(ROOT):
        return "points outside the repository"
    if not file.exists():
        return "no such file or folder"
    if parts.fragment and file.suffix == ".md":
        wanted = unquote(parts.fragment)
        if wanted not in anchors(file):
            return f"no heading with anchor #{wanted} in {_rel(file)}"
        if file.parent == ROOT / "docs" and wanted not in anchors(file, markdown_slug):
            return f"#{wanted} is not the anchor the docs site gives that heading"
    return None


def test_the_pages_exist():
    assert {p.stem for p in (ROOT / "docs").glob("*.md")} >= set(GUIDES)
    assert (ROOT / "README.md").read_text(encoding="utf-8").count("\n") <= 300


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_links_resolve_inside_the_repository(page):
    broken = [
        f"{_rel(page)}:{line}: ({target}) {problem}"
        for line, target in links(page)
        if (problem := link_problem(page, target))
    ]
    assert not broken, "broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_no_path_mentioned_outside_the_repository(page):
    """Paths in prose or code (``../shared/...``) that climb out of the repository."""
    outside = []
    prose, blocks = _prose_and_code(page.read_text(encoding="utf-8"))
    for number, line in prose:
        for match in UP_PATH.finditer(line):
            if not (page.parent / match.group(1)).resolve().is_relative_to(ROOT):
                outside.append(f"{_rel(page)}:{number}: {match.group(1)}")
    assert not outside, "paths outside the repository:\n" + "\n".join(outside)


def test_link_checker_finds_broken_links(tmp_path):
    page = ROOT / "docs" / "index.md"
    assert link_problem(page, "training.md#distributed-training") is None
    assert link_problem(page, "../experiments/") is None
    assert link_problem(page, "https://arxiv.org/abs/2604.03260") is None
    assert link_problem(page, "training.md#no-such-heading").startswith("no heading")
    assert link_problem(page, "nowhere.md") == "no such file or folder"
    assert link_problem(page, "../../shared/docs/focus-method.md") == (
        "points outside the repository"
    )
    assert link_problem(page, "/etc/passwd").startswith("an absolute path")
    assert link_problem(page, "file:///etc/passwd") == "not a web or repository link"
    assert github_slug("5. Exact sparse attention (by a `decomposition`)") == (
        "5-exact-sparse-attention-by-a-decomposition"
    )
    assert github_slug("a / b") == "a--b" and markdown_slug("a / b") == "a-b"
    doc = tmp_path / "page.md"
    doc.write_text("# Title\n```\n# not a heading\n[x](gone.md)\n```\n[y](`z`) [w](#title)\n")
    assert anchors(doc) == {"title"}
    assert links(doc) == [(6, "#title")]


def _command_lines(text: str) -> list[str]:
    """The ``focus ...`` command lines of the bash blocks of a page (continuations joined),
    and the inline code of its prose that starts with ``focus``."""
    prose, _ = _prose_and_code(text)
    lines = [
        m.group(2).replace("\\|", "|")
        for _, line in prose
        for m in CODE_SPAN.finditer(line)
        if m.group(2).startswith("focus ")
    ]
    for info, body in _prose_and_code(text)[1]:
        if info not in ("", "bash", "sh", "console"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            # each command of a chain (`a && b; c`) on its own: another tool's flags stay its own
            for command in re.split(r"&&|;|\|\|", line.split(" #", 1)[0]):
                command = command.strip()
                command = re.sub(r"^.*?-m focus_attention\.cli\b", "focus", command)
                command = re.sub(r"^\.venv/bin/focus\b", "focus", command)
                if command.startswith("focus "):
                    lines.append(command)
    return lines


def test_command_lines_split_chains_and_keep_other_tools_out():
    page = "```bash\nfocus export --out e && transformers serve e --port 8 # note\nls; focus eval \\\n  --model m\n```\n"
    assert _command_lines(page) == ["focus export --out e", "focus eval    --model m"]


def _subparser(parser: argparse.ArgumentParser, words: list[str]):
    """The parser of the longest command prefix of ``words``, and the words after it."""
    while words:
        choices = {}
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                choices = action.choices
        if words[0] not in choices:
            break
        parser, words = choices[words[0]], words[1:]
    return parser, words


@pytest.fixture(scope="module")
def focus_parser() -> argparse.ArgumentParser:
    from focus_attention.cli import build_parser

    return build_parser()


def test_commands_in_the_pages_use_existing_flags(focus_parser):
    root = focus_parser
    unknown = []
    for page in PAGES:
        for command in _command_lines(page.read_text(encoding="utf-8")):
            words = shlex.split(command.replace("...", ""))[1:]
            parser, rest = _subparser(root, words)
            if parser is root or parser.prog.endswith("lm-eval"):
                continue  # lm-eval's flags are lm-eval's own
            # the guides teach the documented names; a study may record the (still accepted,
            # hidden) deprecated name a result was measured with
            taught = [a for a in parser._actions if a.help != argparse.SUPPRESS]
            flags = {
                s
                for a in (taught if page in GUIDE_PAGES else parser._actions)
                for s in a.option_strings
            }
            unknown += [
                f"{_rel(page)}: {command}: {w}"
                for w in rest
                if w.startswith("--") and w.split("=")[0] not in flags
            ]
    assert not unknown, "flags the parser does not document:\n" + "\n".join(unknown)


def _python_blocks(path: Path) -> list[str]:
    return [body for info, body in _prose_and_code(path.read_text())[1] if info == "python"]


@pytest.mark.parametrize("page", [p for p in PAGES if _python_blocks(p)], ids=_rel)
def test_python_blocks_compile(page):
    for number, body in enumerate(_python_blocks(page)):
        compile(body, f"{_rel(page)}[python block {number}]", "exec")


#: the Python blocks that run as written (page, block number); the others need the prepared
#: model and a book (the Trainer example), lm-eval's data, or a model built by an earlier block
RUNNABLE = [("README.md", 0), ("docs/integration.md", 0)]


@pytest.mark.parametrize(("page", "block"), RUNNABLE, ids=[f"{p}[{b}]" for p, b in RUNNABLE])
def test_python_blocks_run(page, block, tmp_path, monkeypatch, kernel_built):
    """A page's Python code, run as written, with ``load_model`` giving a tiny random LLaMA
    instead of the prepared SmolLM2-135M (the only asset these blocks need)."""
    from tiny import tiny_llama

    import focus_attention.assets

    monkeypatch.setattr(
        focus_attention.assets, "load_model", lambda *a, **k: (tiny_llama(64), None)
    )
    monkeypatch.chdir(tmp_path)
    body = _python_blocks(ROOT / page)[block]
    namespace: dict = {"__name__": "docs_block"}
    exec(compile(body, f"{page}[python block {block}]", "exec"), namespace)
    assert (tmp_path / "my-adapter" / "focus_config.json").is_file()
    if page == "README.md":
        assert namespace["out"].shape == namespace["q"].shape
        assert namespace["focus"].focus_config.window == 64


def test_site_has_a_page_at_every_study_link(tmp_path):
    """The docs site's hook puts each study at the URL that a guide's repository link names:
    ``../experiments/<study>/`` from a page of docs/ is ``experiments/<study>/`` on the site."""
    import importlib.util

    pytest.importorskip("mkdocs")
    from mkdocs.structure.files import Files

    spec = importlib.util.spec_from_file_location("studies", ROOT / "docs" / "hooks" / "studies.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    files = hook.on_files(Files([]), {"site_dir": str(tmp_path), "use_directory_urls": True})
    urls = {f.url for f in files}
    linked = {
        target.split("#")[0].removeprefix("../")
        for page in (ROOT / "docs").glob("*.md")
        for _, target in links(page)
        if target.startswith("../experiments/")
    }
    assert linked, "the guides link to no study"
    assert linked <= urls
    assert "configs/pretrain/linux-docs-small.toml" in urls


def test_flags_named_in_the_guides_exist(focus_parser):
    """A flag named on its own in a guide's prose (`--save-every`) is a documented flag of some
    ``focus`` command (flags of other tools appear after their command's name)."""
    from focus_attention.cli.reference import iter_commands

    flags = {
        flag
        for _, parser, _ in iter_commands(focus_parser)
        for action in parser._actions
        if action.help != argparse.SUPPRESS
        for flag in action.option_strings
    }
    unknown = [
        f"{_rel(page)}:{number}: {span.group(2)}"
        for page in GUIDE_PAGES
        for number, line in _prose_and_code(page.read_text(encoding="utf-8"))[0]
        for span in CODE_SPAN.finditer(line)
        if span.group(2).startswith("--") and span.group(2).split()[0] not in flags
    ]
    assert not unknown, "flags no focus command documents:\n" + "\n".join(unknown)


def test_the_training_guide_lists_every_method():
    from focus_attention.training.config import METHODS

    text = (ROOT / "docs" / "training.md").read_text()
    table = text[text.index("| method | what trains |") :].split("\n\n", 1)[0]
    listed = re.findall(r"^\| `([\w+-]+)`", table, re.MULTILINE)
    assert listed == list(METHODS)


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_the_pages_list_every_extra(page):
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    text = " ".join((ROOT / page).read_text().split())
    listed = text[text.index("xtras") :].split(". ", 1)[0]  # the sentence that lists them
    assert set(extras) <= set(re.findall(r"`(\w+)`", listed)), listed
