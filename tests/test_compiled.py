"""The engine core compiled by mypyc (llmd/compiled.py): used only when built from the source beside it, the source
otherwise, and the same simulation either way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmd import compiled

ROOT = Path(__file__).resolve().parent.parent
SUFFIX = compiled._SUFFIXES[0]


def _tree(root: Path) -> None:
    """A tree with the compiled group as setup.py leaves it: sources, extensions (empty files do), the manifest."""
    for name in compiled.MODULES:
        src = compiled._source(name, root)
        src.parent.mkdir(parents=True, exist_ok=True)
        src.write_text(f"# {name}\n")
        src.with_name(src.stem + SUFFIX).write_bytes(b"")
    lib = root / (compiled.GROUP.replace(".", "/") + "__mypyc" + SUFFIX)
    lib.write_bytes(b"")
    (root / compiled.MANIFEST).write_text(json.dumps(compiled.digests(root)))


def test_state_follows_the_sources(tmp_path, monkeypatch):
    monkeypatch.delenv("LLMD_PURE_PYTHON", raising=False)
    assert compiled.state(tmp_path) == (False, "not built")
    _tree(tmp_path)
    assert compiled.state(tmp_path) == (True, "")
    monkeypatch.setenv("LLMD_PURE_PYTHON", "1")
    assert compiled.state(tmp_path) == (False, "LLMD_PURE_PYTHON=1")
    monkeypatch.delenv("LLMD_PURE_PYTHON")
    # An edit after the build: the extension would run the old code.
    src = compiled._source(compiled.MODULES[2], tmp_path)
    src.write_text(src.read_text() + "x = 1\n")
    active, why = compiled.state(tmp_path)
    assert not active and why == f"{src.relative_to(tmp_path)} changed since it was compiled"
    # A touch is no edit: digests, not times.
    src.write_text(f"# {compiled.MODULES[2]}\n")
    os.utime(src, (2e9, 2e9))
    assert compiled.state(tmp_path) == (True, "")
    # One module not built (its C compile failed): none is used.
    src.with_name(src.stem + SUFFIX).unlink()
    assert compiled.state(tmp_path) == (False, f"{compiled.MODULES[2]} not built")
    src.with_name(src.stem + SUFFIX).write_bytes(b"")
    (tmp_path / compiled.MANIFEST).write_text("{")
    assert compiled.state(tmp_path) == (False, f"{compiled.MANIFEST} unreadable")


def _engine_files(env: dict[str, str]) -> dict[str, str]:
    code = (
        "import importlib, json, llmd.compiled as c; "
        "print(json.dumps({m: importlib.import_module(m).__file__ for m in c.MODULES}))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout)


def test_pure_python_switch_runs_the_source():
    env = {**os.environ, "LLMD_PURE_PYTHON": "1"}
    files = _engine_files(env)
    assert set(files) == set(compiled.MODULES)
    assert all(f.endswith(".py") for f in files.values()), files


_NATIVE_REQUIRED = os.environ.get("LLMD_REQUIRE_NATIVE") == "1"


@pytest.mark.skipif(not compiled.ACTIVE and not _NATIVE_REQUIRED, reason=f"not compiled: {compiled.WHY_NOT}")
def test_compiled_core_is_used_and_simulates_the_same(tmp_path):
    # `make test` sets LLMD_REQUIRE_NATIVE=1: a build that silently fell back to the source fails here, not skips.
    assert compiled.ACTIVE, compiled.WHY_NOT
    files = _engine_files({k: v for k, v in os.environ.items() if k != "LLMD_PURE_PYTHON"})
    assert not any(f.endswith(".py") for f in files.values()), files
    # The 544-GPU deployment for a few simulated seconds (prefill, P/D pulls, decode fast-forward, MTP draws): every
    # figure of the run is the same whichever build runs it.
    code = """
import json, sys
from pathlib import Path
import yaml
from llmd.sim.run import Simulation
from llmd.spec.load import load_spec
spec = yaml.safe_load(Path("examples/glm52-544gpu.yaml").read_text())
spec["workload"] = {"profile": "automationbench", "seed": 3, "concurrency": 300, "duration_s": 8.0}
Path(sys.argv[1]).write_text(yaml.safe_dump(spec))
st = Simulation(load_spec(Path(sys.argv[1])), run_id="t").run()
print(json.dumps([st.events, st.requests, st.hit_share, st.ttft_p90_s, st.preemptions, st.errors]))
"""
    runs = {}
    for pure in ("0", "1"):
        env = {**os.environ, "LLMD_PURE_PYTHON": pure}
        spec = tmp_path / f"spec-{pure}.yaml"
        out = subprocess.run(
            [sys.executable, "-c", code, str(spec)], env=env, capture_output=True, text=True, check=True, cwd=ROOT
        )
        runs[pure] = json.loads(out.stdout.strip().splitlines()[-1])
    assert runs["0"][1] > 0 and runs["0"] == runs["1"]
