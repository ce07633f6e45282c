"""Fixtures for the tests against real vLLM CPU servers (helpers: vllmutil). Servers are started per module
(llmd.engines.vllm_deploy), so one module's servers are gone before the next module starts its own: the 2-core machine
runs a few servers at a time, not all of them.

No `__init__.py` here on purpose: a package named `vllm` would shadow the real one.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def dense_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from llmd.models.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("models") / "tiny", weights=True)
