"""The simulated engine's core, compiled: the same Python source built into C extensions by mypyc.

`pip install -e .` (setup.py) compiles MODULES with mypyc where mypy is in the build environment; the extension of a
module is then imported instead of its `.py`, so the live simulated engine and the cluster simulator run the one source
either way (~15% less CPU per simulated request at 544 GPUs). Nothing else changes: results are the same.

The Python source runs instead, for every module of the group at once (compiled code calls its group's functions
directly, so a mix would run two versions of the core):
- with LLMD_PURE_PYTHON=1 (profilers that read Python frames, debuggers, monkeypatching a compiled class);
- where a module was not built, or its source is not the one it was built from (edited since: the extension would
  run old code); a warning says how to rebuild. setup.py records each source's digest in MANIFEST as it compiles.

Standard library only: setup.py reads MODULES and GROUP from this file before llmd can be imported.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import warnings
from pathlib import Path

# The engine core and what it calls per step, and the cluster simulator's per-rank driver that steps it (plain logic on
# lists and the core's own objects, called by the loop ~60 times a request: 3% fewer instructions compiled). The
# router and the rest of the simulator are left interpreted: compiled, their numpy-heavy code gained nothing
# measurable (the boundary checks cost what the C saved).
MODULES = (
    "llmd.engines.sim.core",
    "llmd.engines.sim.decode_run",
    "llmd.engines.sim.kv_cache",
    "llmd.engines.sim.request",
    "llmd.engines.sim.scheduler",
    "llmd.engines.sim.uniforms",
    "llmd.sim.engines",
)
GROUP = "llmd.engines.sim._core"  # mypyc's shared library: llmd/engines/sim/_core__mypyc.<ext>
MANIFEST = "llmd/engines/sim/_core_sources.json"  # {module: sha256 of the source it was compiled from}

_ROOT = Path(__file__).resolve().parent.parent
_SUFFIXES = tuple(importlib.machinery.EXTENSION_SUFFIXES)


def _source(name: str, root: Path = _ROOT) -> Path:
    return root / (name.replace(".", "/") + ".py")


def _extension(name: str, root: Path = _ROOT) -> Path | None:
    base = root / name.replace(".", "/")
    for suffix in _SUFFIXES:
        p = base.with_name(base.name + suffix)
        if p.exists():
            return p
    return None


def digests(root: Path = _ROOT) -> dict[str, str]:
    """Each compiled module's source digest now (what setup.py records in MANIFEST when it compiles them)."""
    return {name: hashlib.sha256(_source(name, root).read_bytes()).hexdigest() for name in MODULES}


def state(root: Path = _ROOT) -> tuple[bool, str]:
    """(whether the compiled modules under `root` are used, why not where they are not)."""
    if os.environ.get("LLMD_PURE_PYTHON") == "1":
        return False, "LLMD_PURE_PYTHON=1"
    if _extension(GROUP + "__mypyc", root) is None:
        return False, "not built"
    missing = [name for name in MODULES if _extension(name, root) is None]
    if missing:
        return False, f"{missing[0]} not built"
    try:
        built = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        return False, f"{MANIFEST} unreadable"
    # Digests, not timestamps: a checkout or a wheel's unpacking sets times, only an edit changes the text.
    for name, digest in digests(root).items():
        if built.get(name) != digest:
            return False, f"{_source(name, root).relative_to(root)} changed since it was compiled"
    return True, ""


class _SourceFirst:
    """A meta path finder that loads MODULES from their `.py` files, ahead of the extensions beside them."""

    @staticmethod
    def find_spec(fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MODULES:
            return None
        src = _source(fullname)
        return importlib.util.spec_from_file_location(fullname, src) if src.exists() else None


ACTIVE, WHY_NOT = state()
if not ACTIVE:
    if not any(isinstance(f, _SourceFirst) for f in sys.meta_path):
        sys.meta_path.insert(0, _SourceFirst())
    if WHY_NOT not in ("LLMD_PURE_PYTHON=1", "not built"):
        warnings.warn(
            f"llmd: the compiled engine core is out of date ({WHY_NOT}); running its Python source. "
            "Rebuild it with `pip install -e .` (or `make install`), or set LLMD_PURE_PYTHON=1 to silence this.",
            stacklevel=2,
        )
