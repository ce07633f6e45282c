"""Fixtures the test modules share."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's tokenizer and config (no weights), made once per test module in a folder named `tiny`."""
    from llmd.models.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny") / "tiny", weights=False)
