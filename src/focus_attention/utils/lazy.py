"""Lazy package attributes (PEP 562): a package names what it exports and from which of its
modules, and each module is imported on the first access to one of its names, so that
importing the package (or a torch-free module inside it) does not import torch or
transformers."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` of package ``package`` whose attribute ``name``
    is ``exports[name]`` (a module relative to the package, such as ``".config"``)
    imported on first access. The value is then stored in the package's namespace, so the
    import runs once.

    Raises (from the returned ``__getattr__``):
        AttributeError: a name that is not exported (``from package import submodule``
            then imports the submodule, as for any package).
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__, sorted(exports)


def exports_of(modules: Mapping[str, tuple[str, ...]]) -> dict[str, str]:
    """``{name: module}`` from ``{module: names}`` (the layout a package's ``__init__``
    writes its exports in)."""
    return {name: module for module, names in modules.items() for name in names}
