"""Fixtures of the asset tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty ``FOCUS_HOME`` (the asset cache) for one test."""
    h = tmp_path / "focus-home"
    monkeypatch.setenv("FOCUS_HOME", str(h))
    return h
