"""The simulator's heap in transparent huge pages (llmd/sim/hugepages.py, llmd/sim/_hugepages.c): in use where the
system allows it, arenas handed back are reused, and a run's results do not depend on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmd.sim import hugepages

ROOT = Path(__file__).resolve().parents[1]
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_THP_ON = _THP.exists() and "[never]" not in _THP.read_text()

if hugepages._C is None and os.environ.get("LLMD_REQUIRE_NATIVE") == "1":
    # `make test` sets LLMD_REQUIRE_NATIVE=1: a build that silently left the C part out fails here, not skips.
    pytest.fail("llmd.sim._hugepages was not built", pytrace=False)
needs_it = pytest.mark.skipif(hugepages._C is None or not _THP_ON, reason="no C part, or THP off on this system")


def _child(code: str, huge: str) -> dict:
    env = {**os.environ, "LLMD_HUGE_PAGES": huge, "PYTHONHASHSEED": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, check=False, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


_ARENAS = """
import json
from llmd.sim import hugepages
on = hugepages.enable()
junk = [[i] * 4 for i in range(400_000)]  # ~60 MB of small objects: arenas
first = hugepages.stats()
del junk  # emptied arenas go back
junk = [(i, i) for i in range(400_000)]
print(json.dumps({"on": on, "why": hugepages.why_not(), "first": first, "then": hugepages.stats()}))
"""


@needs_it
def test_python_arenas_come_from_the_huge_page_region_and_are_reused() -> None:
    got = _child(_ARENAS, "1")
    assert got["on"] and got["why"] == ""
    first, then = got["first"], got["then"]
    assert first["arenas_new"] >= 40 and first["arena_bytes"] == first["arenas_new"] << 20
    assert then["arenas_freed"] > 0 and then["arenas_reused"] > 0
    # Reused before new ones are cut from the region.
    assert then["arenas_new"] - first["arenas_new"] < then["arenas_reused"]


@needs_it
def test_an_address_space_limit_keeps_the_reservation_to_a_quarter_of_it() -> None:
    """Under `ulimit -v` (some clusters set one for jobs) the region takes at most a quarter of the limit, and the
    process still allocates the rest."""
    code = "import resource\nresource.setrlimit(resource.RLIMIT_AS, (8 << 30, resource.RLIM_INFINITY))\n" + _ARENAS
    code = code.replace(
        "print(json.dumps({",
        "big = bytearray(3 << 30)\nprint(json.dumps({'region': hugepages.stats()['region_bytes'], ",
    )
    got = _child(code, "1")
    assert got["on"] and 0 < got["region"] <= 2 << 30
    assert got["then"]["arenas_new"] > 0


def test_switched_off_by_the_environment() -> None:
    got = _child(_ARENAS, "0")
    assert not got["on"] and got["why"] == "LLMD_HUGE_PAGES=0"
    assert got["first"] == {} and got["then"] == {}


_RUN = """
import hashlib, json
from llmd.demo import embedded_spec
from llmd.sim import hugepages
from llmd.sim.run import Simulation
sim = Simulation(embedded_spec(10.0), run_id="hp")
st = sim.run()
rows = [(c.request_id, c.pod, c.prefill_pod, c.first_token, c.done_time, c.cached_tokens, tuple(c.token_times))
        for c in sim.calls]
print(json.dumps({"on": hugepages.why_not() == "", "stats": hugepages.stats(), "requests": st.requests,
                  "rows": hashlib.sha256(repr(rows).encode()).hexdigest()}))
"""


@needs_it
def test_a_run_is_the_same_with_and_without_huge_pages() -> None:
    on, off = _child(_RUN, "1"), _child(_RUN, "0")
    assert on["on"] and on["stats"]["arenas_new"] > 0
    assert not off["on"]
    assert on["requests"] == off["requests"] > 0
    assert on["rows"] == off["rows"]
