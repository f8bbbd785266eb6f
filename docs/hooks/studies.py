"""mkdocs hook: the studies under ``experiments/`` (their READMEs, settings, results and plots)
and the settings files under ``configs/`` join the site at the paths they have in the
repository, so a guide's link to ``../experiments/<study>/`` opens the study's page on the
site as it opens the study's folder in the repository, and the studies' own links (to their
``config.toml``, ``results/``, each other) are checked by ``mkdocs build --strict``."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

ROOT = Path(__file__).resolve().parents[2]
#: source files a guide links to (docs/method.md: the method in one file), at their
#: repository paths on the site as in the repository
SOURCES = ("src/focus_attention/ops/reference.py",)


def _repository_files(top: str, *, pages: bool) -> list[Path]:
    found = []
    for path in sorted((ROOT / top).rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        if path.suffix == ".md" and not pages:
            continue  # configs/README.md links into docs/ by repository paths
        found.append(path)
    return found


def on_files(files: Files, config) -> Files:
    """Add the studies (pages, not in the navigation), the settings files and the source
    files the guides link to (:data:`SOURCES`) to the site."""
    paths = [*_repository_files("experiments", pages=True),
             *_repository_files("configs", pages=False)]  # fmt: skip
    for path in paths:
        files.append(_site_file(path.relative_to(ROOT).as_posix(), config))
    for source in SOURCES:  # a guide's link ../src/... names the file by its path from docs/
        file = _site_file(source, config)
        dest_uri, abs_src_path = file.dest_uri, file.abs_src_path
        file.src_uri = f"../{source}"
        file.dest_uri, file.abs_src_path = dest_uri, abs_src_path
        files.append(file)
    return files


def _site_file(path: str, config) -> File:
    """The repository file at ``path`` on the site at the same path, not in the navigation."""
    return File(
        path,
        src_dir=str(ROOT),
        dest_dir=config["site_dir"],
        use_directory_urls=config["use_directory_urls"],
        inclusion=InclusionLevel.NOT_IN_NAV,
    )
