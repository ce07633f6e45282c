"""The decode planner's pass over the steps: the C build (llmd/engines/sim/_decodeplan.c) and `plan_steps`, its Python
twin, give the same steps, gains, KV events, MTP draws and totals for any batch, and the planner uses the C one where it
was built."""

from __future__ import annotations

import itertools
import os
import random
from array import array
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmd.engines.sim import decode_run, uniforms
from llmd.engines.sim.decode_run import plan_steps
from llmd.engines.sim.uniforms import _doubles
from llmd.perf.latency import DecodeLine, line_times

try:
    from llmd.engines.sim._decodeplan import doubles as native_doubles
    from llmd.engines.sim._decodeplan import line_times as native_line_times
    from llmd.engines.sim._decodeplan import steps as native_steps
except ImportError:
    native_steps = native_doubles = native_line_times = None
# `make test` sets LLMD_REQUIRE_NATIVE=1: a build that silently failed cannot pass as "skipped".
if native_steps is None and os.environ.get("LLMD_REQUIRE_NATIVE") == "1":
    raise RuntimeError(
        "llmd.engines.sim._decodeplan is not built (pip install -e . compiles llmd/engines/sim/_decodeplan.c)"
    )
needs_native = pytest.mark.skipif(native_steps is None, reason="llmd.engines.sim._decodeplan not built")


@st.composite
def _batches(draw: Any) -> tuple[Any, ...]:
    """A batch as the planner hands it over: per request its tokens, tokens left, the tokens its blocks hold and where
    its next full block ends; drafts, block size, the draws and the pool's free and silent blocks."""
    n = draw(st.integers(1, 8))
    bs = draw(st.sampled_from([1, 2, 16, 64]))
    ctx, rem, held, next_full = [], [], [], []
    for _ in range(n):
        c = draw(st.integers(1, 5000))
        ctx.append(c)
        rem.append(draw(st.integers(1, 300)))
        blocks = -(-c // bs) + draw(st.integers(0, 2))
        held.append(blocks * bs)
        cached = draw(st.integers(0, c // bs))
        next_full.append((cached + 1) * bs)
    k_spec = draw(st.integers(0, 4))
    max_steps = draw(st.integers(0, 40))
    k_lat = draw(st.integers(0, 4))
    mtp = draw(st.booleans())
    pos = draw(st.integers(0, 5))
    beta = draw(st.sampled_from([0.0, 0.3, 0.68, 1.0]))
    # Enough draws for every sample (each reads at most k_lat): the planner's `ahead` guarantees as much. Some equal
    # beta exactly (a rejection: x >= beta).
    rng = random.Random(draw(st.integers(0, 2**32)))
    u = [beta if rng.random() < 0.1 else rng.random() for _ in range(pos + max_steps * n * k_lat + rng.randrange(5))]
    free = draw(st.integers(0, 60))
    silent = draw(st.integers(0, free))
    return ctx, rem, held, next_full, k_spec, bs, max_steps, u, pos, beta, k_lat, mtp, free, silent


def _run(fn: Any, args: tuple[Any, ...]) -> Any:
    a = list(args)
    a[2], a[3] = list(a[2]), list(a[3])  # the twin works on held and next_full
    return fn(*a)


@needs_native
@settings(max_examples=400, deadline=None)
@given(_batches())
def test_the_c_pass_plans_what_the_python_pass_plans(args: tuple[Any, ...]) -> None:
    want = _run(plan_steps, args)
    assert _run(native_steps, args) == want
    # The draws as UniformStream keeps them (C doubles, read in place): the same plan.
    as_doubles = (*args[:7], array("d", args[7]), *args[8:])
    assert _run(native_steps, as_doubles) == want


def test_the_pass_stops_before_a_finishing_step_and_before_a_step_that_would_preempt() -> None:
    # Two requests, no MTP, block size 4: request 1 has 3 tokens left, so step 2 (0-based) would finish it.
    for fn in filter(None, (plan_steps, native_steps)):
        k, gained, events, kv_steps, draws, totals = fn(
            [10, 20], [50, 3], [12, 20], [12, 20], 0, 4, 10, [], 0, 0.0, 0, False, 100, 100
        )
        assert k == 2
        assert gained == [1, 1, 2, 2]
        assert totals == [30.0, 32.0]
        assert draws is None
        # Step 0: request 1's block [16, 20) is full: it is cached (seen outside). Step 1: request 1 needs a new block,
        # one the free queue's unhashed front gives without evicting (silent): an event, but no KV work seen outside.
        assert events == [(0, 1, 1), (1, 1, 1)] and kv_steps == [0]
        # With no free block, step 1's new block would preempt: one step planned.
        k, _, events, *_ = fn([10, 20], [50, 50], [12, 20], [12, 20], 0, 4, 10, [], 0, 0.0, 0, False, 0, 0)
        assert k == 1 and events == [(0, 1, 1)]
        # Past the unhashed front (silent 0), taking a block evicts a cached one: that step is seen outside.
        _, _, _, kv_steps, *_ = fn([10, 20], [50, 50], [12, 20], [12, 20], 0, 4, 2, [], 0, 0.0, 0, False, 5, 0)
        assert kv_steps == [0, 1]


def test_mtp_draws_are_read_as_sample_accepted_reads_them() -> None:
    # beta 0.5, k_lat 3: draws 0.1 0.2 0.9 -> two accepted (the rejection is read); 0.9 -> none; 0.1 0.1 0.1 -> three.
    draws_list = [0.1, 0.2, 0.9, 0.9, 0.1, 0.1, 0.1, 0.9]
    for fn, u in itertools.product(filter(None, (plan_steps, native_steps)), (draws_list, array("d", draws_list))):
        k, gained, _, _, draws, _ = fn([100], [50], [200], [200], 3, 64, 3, u, 0, 0.5, 3, True, 10, 10)
        assert k == 3
        assert gained == [3, 4, 8]  # 1 + 2, 1 + 0, 1 + 3
        assert draws == [3, 4, 7]


@needs_native
def test_the_c_pass_refuses_bad_arguments_with_a_message() -> None:
    ok: list[Any] = [[10], [50], [64], [64], 0, 64, 4, [], 0, 0.0, 0, False, 10, 10]
    with pytest.raises(TypeError, match="takes 14 arguments"):
        native_steps(*ok[:5])
    with pytest.raises(TypeError, match="rem must be a list of 1 ints"):
        native_steps(ok[0], [1, 2], *ok[2:])
    with pytest.raises(TypeError, match="u must be a list of floats or a buffer of doubles"):
        native_steps(*ok[:7], (0.5,), *ok[8:])
    with pytest.raises(TypeError, match="buffer of doubles"):
        native_steps(*ok[:7], array("f", [0.5]), *ok[8:])
    with pytest.raises(ValueError, match="block size"):
        native_steps(*ok[:5], 0, *ok[6:])
    # Too few draws for the samples: an IndexError, as the twin's list read gives, never a read past the buffer.
    short = [[10], [50], [64], [64], 3, 64, 4, [0.1, 0.1], 0, 0.5, 3, True, 10, 10]
    with pytest.raises(IndexError):
        native_steps(*short)
    with pytest.raises(IndexError):
        native_steps(*short[:7], array("d", short[7]), *short[8:])
    with pytest.raises(IndexError):
        plan_steps(*short)


@needs_native
@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32), st.integers(0, 40))
def test_the_c_draws_are_the_numpy_draws(seed: int, pairs: int) -> None:
    raw = np.random.MT19937(seed).random_raw(2 * pairs)
    # Words at the extremes too: every bit that survives the shifts, and none.
    if pairs:
        raw[:2] = [0xFFFFFFFF, 0xFFFFFFFF]
        raw[-2:] = [0, 0]
    got = native_doubles(raw)
    assert got == _doubles(raw)
    assert len(got) == 8 * pairs and all(0.0 <= x < 1.0 for x in array("d", got))


@needs_native
def test_the_c_draws_refuse_what_is_not_a_uint64_buffer() -> None:
    with pytest.raises(TypeError, match="uint64"):
        native_doubles(np.zeros(4, dtype=np.float64))
    with pytest.raises(TypeError):
        native_doubles([1, 2])


def test_the_planner_uses_the_c_pass_where_it_was_built() -> None:
    if os.environ.get("LLMD_DECODE_PLAN_PURE_PYTHON") == "1" or native_steps is None:
        assert decode_run._steps is plan_steps
        assert decode_run._line_times is line_times
    else:
        assert decode_run._steps is native_steps
        assert uniforms._make_doubles is native_doubles
        assert decode_run._line_times is native_line_times


_finite = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False)


@needs_native
@settings(max_examples=300, deadline=None)
@given(
    st.lists(_finite, min_size=14, max_size=14),
    st.booleans(),
    st.booleans(),
    st.lists(st.one_of(st.floats(0, 1e7), st.integers(0, 10**7).map(float)), max_size=70),
)
def test_the_c_line_is_the_python_line(terms: list[float], has_draft: bool, has_overlap: bool, totals: list) -> None:
    """Any terms, either flag, any totals: the same doubles (a fused multiply-add or another order would differ)."""
    terms[9], terms[12] = has_draft, has_overlap
    line = DecodeLine(*terms)
    assert native_line_times(line, totals) == line_times(line, totals)
    zero = DecodeLine(0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, False, 5.0, 1.0, True, 2.0)
    assert native_line_times(zero, [0.0]) == line_times(zero, [0.0]) == [0.0]  # step_time's empty step


@needs_native
def test_the_c_line_refuses_bad_arguments_with_a_message() -> None:
    line = DecodeLine(0.0, 4.0, 1.0, 1e-9, 1e-3, 1e-2, 1e-9, 1e-6, 0.0, False, 1e-4, 0.0, False, 1e-4)
    with pytest.raises(TypeError, match="takes 2 arguments"):
        native_line_times(line)
    with pytest.raises(TypeError, match="tuple of 14"):
        native_line_times(tuple(line)[:13], [1.0])
    with pytest.raises(TypeError, match="totals must be a list"):
        native_line_times(line, (1.0,))
    with pytest.raises(TypeError):
        native_line_times(line, ["x"])
