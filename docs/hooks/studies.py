"""mkdocs hook: the studies under ``experiments/`` (their READMEs, settings, results and plots)
and the settings files under ``configs/`` join the site at the paths they have in the
repository, so a guide's link to ``../experiments/<study>/`` opens the study's page on the
site as it opens the study's folder in the repository, and the studies' own links (to their
``config.toml``, ``results/``, each other) are checked by ``mkdocs build --strict``."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files, InclusionLevel

ROOT = Path(__file__).resolve().parents[2]


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
    """Add the studies (pages, not in the navigation) and the settings files to the site."""
    for top, pages in (("experiments", True), ("configs", False)):
        for path in _repository_files(top, pages=pages):
            files.append(
                File(
                    path.relative_to(ROOT).as_posix(),
                    src_dir=str(ROOT),
                    dest_dir=config["site_dir"],
                    use_directory_urls=config["use_directory_urls"],
                    inclusion=InclusionLevel.NOT_IN_NAV,
                )
            )
    return files
