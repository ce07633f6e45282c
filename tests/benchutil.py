"""Loading a benchmark script (benchmarks/NAME.py) as a module, for tests of its parts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/NAME.py imported as module NAME, with benchmarks/ on sys.path as when it runs as a script."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # its dataclasses resolve their annotations there
    spec.loader.exec_module(mod)
    return mod
