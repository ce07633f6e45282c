"""The simulator's event loop: the C build (llmd/sim/_loop.c) and its Python source run events in the same order, with
the same clock, counts and answers, for any schedule, including events that schedule others while they run."""

from __future__ import annotations

import gc
import math
import os
import weakref
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmd.sim import loop as sim_loop
from llmd.sim.loop import PyEventLoop

NATIVE = sim_loop.EventLoop if sim_loop.EventLoop is not PyEventLoop else None
# `make test` sets LLMD_REQUIRE_NATIVE=1: a build that silently failed cannot pass as "skipped".
if NATIVE is None and os.environ.get("LLMD_REQUIRE_NATIVE") == "1":
    raise RuntimeError("llmd.sim._loop is not built (pip install -e . compiles llmd/sim/_loop.c): see its output")
LOOPS = [PyEventLoop] + ([NATIVE] if NATIVE is not None else [])
needs_native = pytest.mark.skipif(NATIVE is None, reason="llmd.sim._loop not built (no C compiler)")

# A schedule: (time, child delays) per event, each child scheduled with `after` when its parent runs; then runs up to
# each of `untils`. Times include ties, zero delays, the past (clamped to now) and NaN (runs now, as `t > now` fails).
_times = st.one_of(st.sampled_from([0.0, 1.0, 1.0, 2.5, -1.0, math.nan]), st.floats(-5, 50, allow_nan=False))
_events = st.lists(st.tuples(_times, st.lists(st.sampled_from([0.0, 0.0, 0.5, 3.0]), max_size=3)), max_size=40)
_untils = st.lists(st.sampled_from([0.0, 1.0, 2.5, 10.0, 100.0, math.inf]), min_size=1, max_size=4)


def _trace(cls: Any, events: list[tuple[float, list[float]]], untils: list[float]) -> list[Any]:
    loop = cls()
    seen: list[Any] = []

    def fire(name: str, kids: list[float]) -> None:
        seen.append((name, float(loop.now)))
        for j, dt in enumerate(kids):
            loop.after(dt, fire, f"{name}.{j}", [])

    for i, (t, kids) in enumerate(events):
        loop.at(t, fire, str(i), kids)
    for until in untils:
        left = loop.run(until)
        nxt = loop.next_time()
        seen.append(("run", until, left, float(loop.now), loop.events, None if nxt is None else float(nxt)))
    return seen


@needs_native
@settings(max_examples=300, deadline=None)
@given(_events, _untils)
def test_the_c_loop_runs_any_schedule_as_the_python_loop_does(events, untils) -> None:
    assert _trace(NATIVE, events, untils) == _trace(PyEventLoop, events, untils)


@pytest.mark.parametrize("cls", LOOPS)
def test_ties_run_in_scheduling_order_and_the_clock_stops_at_until(cls) -> None:
    loop = cls()
    seen: list[tuple[float, str]] = []
    loop.at(2.0, lambda: seen.append((loop.now, "b")))
    loop.at(1.0, lambda: seen.append((loop.now, "a")))
    loop.at(2.0, lambda: seen.append((loop.now, "c")))
    loop.after(5.0, lambda: seen.append((loop.now, "late")))
    loop.at(0.5, lambda: loop.at(0.0, lambda: seen.append((loop.now, "past runs now"))))
    assert loop.run(3.0) is True and loop.now == 3.0 and loop.next_time() == 5.0
    assert seen == [(0.5, "past runs now"), (1.0, "a"), (2.0, "b"), (2.0, "c")]
    assert loop.run(10.0) is False and seen[-1] == (5.0, "late") and loop.events == 6
    assert loop.now == 5.0  # nothing left: the clock stays at the last event
    assert loop.next_time() is None


@pytest.mark.parametrize("cls", LOOPS)
def test_stop_ends_the_run_before_the_next_event(cls) -> None:
    loop = cls()
    seen: list[int] = []
    loop.at(1.0, seen.append, 1)
    loop.at(1.0, loop.stop)
    loop.at(1.0, seen.append, 2)
    assert loop.run(5.0) is True and seen == [1] and loop.stopped and loop.now == 1.0


@pytest.mark.parametrize("cls", LOOPS)
def test_an_event_that_raises_is_gone_and_the_rest_stay(cls) -> None:
    loop = cls()
    seen: list[int] = []

    def boom() -> None:
        raise KeyboardInterrupt  # Ctrl-C inside an event: Simulation.run keeps what was simulated

    loop.at(1.0, seen.append, 1)
    loop.at(2.0, boom)
    loop.at(3.0, seen.append, 3)
    with pytest.raises(KeyboardInterrupt):
        loop.run(10.0)
    assert loop.now == 2.0 and loop.next_time() == 3.0
    assert loop.run(10.0) is False and seen == [1, 3]


@needs_native
def test_the_c_loop_refuses_bad_calls_with_a_message() -> None:
    loop = NATIVE()
    with pytest.raises(TypeError, match="needs a time and a callable"):
        loop.at(1.0)
    with pytest.raises(TypeError):
        loop.after("soon", print)
    with pytest.raises(TypeError):
        loop.run(None)
    with pytest.raises(TypeError, match="takes no arguments"):
        NATIVE(1)
    loop.at(1.0, "not callable")
    with pytest.raises(TypeError):
        loop.run(2.0)


@needs_native
def test_the_c_loop_lets_the_collector_free_cycles_through_pending_events() -> None:
    class Holder:
        def __init__(self) -> None:
            self.loop = NATIVE()
            self.loop.at(1.0, self.touch)  # loop -> event -> bound method -> holder -> loop

        def touch(self) -> None:
            pass

    h = Holder()
    ref = weakref.ref(h)
    del h
    gc.collect()
    assert ref() is None
