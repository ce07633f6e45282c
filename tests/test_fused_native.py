"""The scheduling pipeline's passes in C (llmd/router/scheduling/_fused.c) against their Python (fused.py's py_pick
and column, py_room, py_hits, py_summary): the same totals and raw scores bit for bit, the same ties, the same
filtered positions, hit columns and hop summaries, over columns as the router keeps them (zeros, negatives, NaN
usage, strided views, holders never stamped or unknown to an index) and every kind of term; NotImplemented for
columns it does not read, and the scheduler's decisions the same either way."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from llmd.router.scheduling import fused
from llmd.router.scheduling.fused import (
    K_CONST,
    K_KVUTIL,
    K_LOAD,
    K_LRU,
    K_PREFIX,
    K_QUEUE,
    K_TOKENLOAD,
    Term,
    py_hits,
    py_pick,
    py_room,
    py_summary,
)

try:
    from llmd.router.scheduling import _fused
except ImportError:
    _fused = None
# `make test` sets LLMD_REQUIRE_NATIVE=1: a build that silently failed cannot pass as "skipped".
if _fused is None and os.environ.get("LLMD_REQUIRE_NATIVE") == "1":
    raise RuntimeError(
        "llmd.router.scheduling._fused is not built (pip install -e . compiles llmd/router/scheduling/_fused.c)"
    )
pytestmark = pytest.mark.skipif(_fused is None, reason="llmd.router.scheduling._fused is not built (no C compiler)")


def _ints(rng: np.random.Generator, m: int, hi: int) -> np.ndarray:
    """int64 columns as the fleet's: mostly small, some zero, a few negative (a gauge not yet scraped)."""
    a = rng.integers(0, hi, m, dtype=np.int64)
    a[rng.random(m) < 0.2] = 0
    a[rng.random(m) < 0.05] *= -1
    return a


def _terms(rng: np.random.Generator, m: int) -> list[Term]:
    """One or more of every kind, over m endpoints."""
    gpu = _ints(rng, m, 400)
    cpu = np.maximum(0, _ints(rng, m, 100))
    usage = rng.random(m) * 1.4 - 0.2  # outside [0, 1] too: a clip on either side
    usage[rng.random(m) < 0.05] = np.nan
    waiting = _ints(rng, m, 200)
    same = np.full(m, 7, np.int64)  # every queue equal: 1.0 for all
    stamps = np.zeros(2 * m + 1, np.int64)
    used = rng.permutation(np.arange(1, 5 * m + 1))[: m + 1]  # distinct ticks, as the scorer's clock gives
    ids = np.full(m, -1, np.intp)
    for i in range(m):
        if rng.random() < 0.6:
            ids[i] = i
            stamps[i] = used[i] if rng.random() < 0.8 else 0
    units = int(rng.integers(1, 500))
    return [
        (K_CONST, float(rng.choice([0.0, 0.5, 1.0]))),
        (K_PREFIX, gpu, cpu, 1.0, 0.8, 1.0 / (units * 1.0)),
        (K_PREFIX, gpu, cpu, 2.0, 0.5, 1.0 / (units * 2.0)),
        (K_KVUTIL, usage),
        (K_QUEUE, waiting),
        (K_QUEUE, same),
        (K_LOAD, waiting, int(rng.integers(1, 300))),
        (K_TOKENLOAD, _ints(rng, m, 3_000_000), gpu * 64, int(rng.integers(0, 200_000)), 4 * 2**20),
        (K_TOKENLOAD, _ints(rng, m, 3_000_000), None, int(rng.integers(0, 200_000)), 1000),
        (K_LRU, stamps, ids),
        (K_LRU, np.zeros(1, np.int64), np.full(m, -1, np.intp)),  # nobody stamped: 1.0 for all
    ]


def _both(idx: np.ndarray, terms: list[Term], weights: tuple[float, ...]) -> tuple[tuple, tuple]:
    n = len(idx)
    c_tot, c_sc = np.empty(n), np.empty((len(terms), n))
    c_ties = _fused.pick(idx, tuple(terms), weights, c_tot, c_sc)
    p_tot, p_sc = np.empty(n), np.empty((len(terms), n))
    p_ties = py_pick(idx, terms, weights, p_tot, p_sc)
    return (c_tot.tobytes(), c_sc.tobytes(), c_ties), (p_tot.tobytes(), p_sc.tobytes(), p_ties)


@pytest.mark.parametrize("seed", range(40))
def test_pick_matches_python_bit_for_bit(seed: int) -> None:
    rng = np.random.default_rng(seed)
    r = random.Random(seed)
    m = int(rng.integers(1, 600))
    every = _terms(rng, m)
    for _ in range(20):
        terms = r.sample(every, r.randint(1, 5))
        weights = tuple(r.choice([1.0, 2.0, 0.5, 0.1, 3.7]) for _ in terms)
        k = r.randint(0, m)
        idx = np.sort(rng.choice(m, size=k, replace=False)).astype(np.intp)
        got, want = _both(idx, terms, weights)
        assert got == want


def test_ties_are_the_totals_within_eps_of_the_best() -> None:
    waiting = np.array([3, 1, 1, 5, 1], np.int64)
    idx = np.arange(5, dtype=np.intp)
    totals, scores, ties = fused.pick(idx, [(K_QUEUE, waiting)], (1.0,))
    assert ties == [1, 2, 4]
    assert totals.tolist() == [0.5, 1.0, 1.0, 0.0, 1.0]
    assert scores is not None and scores[0].tolist() == totals.tolist()
    got, want = _both(idx, [(K_QUEUE, waiting), (K_CONST, 0.25)], (1.0, 2.0))
    assert got == want


def test_strided_columns_read_as_their_copies() -> None:
    """A column may be a view of a table's column (HitColumns.of): read through its stride."""
    rng = np.random.default_rng(7)
    table = rng.integers(0, 300, (50, 4), dtype=np.int64)
    idx = np.arange(0, 50, 3, dtype=np.intp)
    strided = [(K_PREFIX, table[:, 0], table[:, 1], 1.0, 0.8, 1 / 300), (K_QUEUE, table[:, 2])]
    copied = [(K_PREFIX, table[:, 0].copy(), table[:, 1].copy(), 1.0, 0.8, 1 / 300), (K_QUEUE, table[:, 2].copy())]
    got, _ = _both(idx, strided, (2.0, 1.0))
    want, _ = _both(idx, copied, (2.0, 1.0))
    assert got == want


@pytest.mark.parametrize(
    "term",
    [
        (K_QUEUE, np.array([1, 2, 3], np.int32)),  # another width
        (K_KVUTIL, np.array([1, 2, 3], np.int64)),  # ints where floats are read
        (K_QUEUE, np.array([1.0, 2.0, 3.0])),  # floats where ints are read
    ],
)
def test_columns_it_does_not_read_are_scored_in_numpy(term: Term) -> None:
    idx = np.arange(3, dtype=np.intp)
    assert _fused.pick(idx, (term,), (1.0,), np.empty(3), None) is NotImplemented
    totals, _, ties = fused.pick(idx, [term], (1.0,))  # the Python pass answers instead
    want = np.empty(3)
    assert ties == py_pick(idx, [term], (1.0,), want, None)
    assert totals.tobytes() == want.tobytes()


def test_refusals() -> None:
    idx = np.arange(3, dtype=np.intp)
    waiting = np.zeros(3, np.int64)
    with pytest.raises(ValueError, match="unknown term kind"):
        _fused.pick(idx, ((99, waiting),), (1.0,), np.empty(3), None)
    with pytest.raises(ValueError, match="wrong arity"):
        _fused.pick(idx, ((K_QUEUE, waiting, 3),), (1.0,), np.empty(3), None)
    with pytest.raises(IndexError):
        _fused.pick(np.array([0, 5], np.intp), ((K_QUEUE, waiting),), (1.0,), np.empty(2), None)
    with pytest.raises(IndexError):
        _fused.pick(np.array([-1], np.intp), ((K_QUEUE, waiting),), (1.0,), np.empty(1), None)
    with pytest.raises(IndexError):  # a holder id past the stamps
        _fused.pick(idx, ((K_LRU, np.zeros(2, np.int64), np.array([0, 1, 7], np.intp)),), (1.0,), np.empty(3), None)
    with pytest.raises(TypeError, match="totals"):
        _fused.pick(idx, ((K_QUEUE, waiting),), (1.0,), np.empty(3, np.float32), None)
    with pytest.raises(TypeError, match="scores"):
        _fused.pick(idx, ((K_QUEUE, waiting),), (1.0,), np.empty(3), np.empty(2))
    with pytest.raises(TypeError, match="one length"):
        _fused.pick(idx, ((K_QUEUE, waiting),), (1.0, 2.0), np.empty(3), None)
    table = (K_PREFIX, np.zeros((3, 1), np.int64), np.zeros(3, np.int64), 1.0, 1.0, 1.0)  # 2-D: not a column
    assert _fused.pick(idx, (table,), (1.0,), np.empty(3), None) is NotImplemented
    assert _fused.KINDS == fused.KINDS


def test_scheduler_decides_the_same_either_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole decisions over random fleets: the C pass and the numpy one choose the same endpoints with the same
    totals, under every scoring weight set the spec allows."""
    from llmd.router.scheduling.pipeline import Scheduler
    from llmd.router.scheduling.state import Endpoint, EndpointState, RouteRequest, Snapshot
    from llmd.spec.model import RouterSpec

    def decisions(native: bool) -> list[tuple]:
        monkeypatch.setattr(fused, "_fused", _fused if native else None)
        rng = random.Random(3)
        out = []
        for weights in ({"prefix": 2.0, "kv-util": 1.0, "queue": 1.0, "no-hit-lru": 1.0},
                        {"prefix": 1.0, "load-aware": 1.0, "token-load": 2.0}):  # fmt: skip
            sched = Scheduler(RouterSpec(weights=weights, pd_threshold=16), seed=5)
            for r in range(60):
                eps = [Endpoint(f"d{k}", role="decode") for k in range(12)] + [
                    Endpoint(f"p{k}", role="prefill") for k in range(5)
                ]
                states = {
                    ep: EndpointState(
                        waiting=rng.randrange(0, 6),
                        kv_usage=rng.random(),
                        inflight=rng.randrange(0, 4),
                        inflight_tokens=rng.randrange(0, 9000),
                        kv_capacity_blocks=1000,
                    )
                    for ep in eps
                }
                req = RouteRequest(f"r{r}", list(range(rng.randrange(0, 40))), num_tokens=rng.randrange(0, 3000),
                                   session_id=f"s{rng.randrange(8)}")  # fmt: skip
                d = sched.schedule(req, Snapshot(states), now=float(r))
                sched.observe_routed(req, d, float(r))
                totals = sorted((ep.pod, s.total, tuple(sorted(s.parts.items()))) for ep, s in d.scores.items())
                out.append((d.target, d.reason, d.pd, totals))
        return out

    assert decisions(True) == decisions(False)


@pytest.mark.parametrize("seed", range(30))
def test_room_matches_python(seed: int) -> None:
    rng = np.random.default_rng(seed)
    r = random.Random(seed)
    m = int(rng.integers(1, 600))
    inflight = _ints(rng, m, 70)
    cap = _ints(rng, m, 2000)
    kv = _ints(rng, m, 2000 * 16)
    cached = _ints(rng, m, 300)
    for _ in range(20):
        idx = np.sort(rng.choice(m, size=r.randint(0, m), replace=False)).astype(np.intp)
        args = (
            idx, inflight, r.choice([None, 0, 1, 16, 64]), cap, kv, r.choice([None, cached]), r.randrange(0, 400),
            r.choice([0, 16, 64]), r.randrange(-100, 40_000), r.choice([16, 64, 1, 0]),
        )  # fmt: skip
        got = fused.room(*args)
        want = py_room(*args)
        assert [a.tolist() for a in got] == [a.tolist() for a in want]


@pytest.mark.parametrize("seed", range(30))
def test_hits_match_python(seed: int) -> None:
    rng = np.random.default_rng(seed)
    r = random.Random(seed)
    m = int(rng.integers(1, 600))
    k = int(rng.integers(0, m + 1))  # holders the index knows: ids 0..k-1, and a trailing 0 at -1
    blocks_any = np.append(np.maximum(0, _ints(rng, k, 500)), 0)
    blocks_gpu = np.append(np.minimum(blocks_any[:k], np.maximum(0, _ints(rng, k, 500))), 0)
    ids = np.where(rng.random(m) < 0.7, rng.integers(0, max(k, 1), m), -1).astype(np.intp) if k else np.full(m, -1)
    sk = int(rng.integers(0, m + 1))
    spec = np.append(np.maximum(0, _ints(rng, sk, 600)), 0)
    spec_ids = np.where(rng.random(m) < 0.5, rng.integers(0, max(sk, 1), m), -1).astype(np.intp) if sk else None
    if spec_ids is None:
        spec_ids = np.full(m, -1, np.intp)
    for speculative in (False, True):
        s, sid = (spec.copy(), spec_ids) if speculative else (None, None)
        cap, bs = r.choice([0, 1, 500, 10**9]), r.choice([16, 64])
        got = fused.hits(blocks_any, blocks_gpu, ids, s, sid, cap, bs)
        want = py_hits(blocks_any, blocks_gpu, ids, None if s is None else spec.copy(), sid, cap, bs)
        assert [a.tolist() for a in got] == [a.tolist() for a in want]
        assert [a.dtype for a in got] == [a.dtype for a in want]


def test_room_and_hits_refuse_or_pass_on() -> None:
    idx = np.arange(3, dtype=np.intp)
    z = np.zeros(3, np.int64)
    out = np.empty(9, np.intp)
    assert _fused.room(idx, z.astype(np.int32), 1, z, z, None, 0, 0, 5, 16, out) is NotImplemented
    with pytest.raises(IndexError, match="inflight"):
        _fused.room(np.array([0, 4], np.intp), z, 1, z, z, None, 0, 0, 5, 16, out)
    with pytest.raises(TypeError, match="out"):
        _fused.room(idx, z, 1, z, z, None, 0, 0, 5, 16, np.empty(2, np.intp))
    got = np.empty((5, 3), np.int64)
    has = np.empty(3, bool)
    assert _fused.hits(z.astype(np.float64), z, idx, None, None, 0, 16, got, has) is NotImplemented
    with pytest.raises(IndexError, match="holder id"):
        _fused.hits(z, z, np.array([0, 1, 9], np.intp), None, None, 0, 16, got, has)
    with pytest.raises(TypeError, match="has"):
        _fused.hits(z, z, idx, None, None, 0, 16, got, np.empty(3, np.int64))
    # Columns it does not read are filtered and gathered in numpy instead, the same answers.
    slots, fit, doubt = fused.room(idx, z.astype(np.int32), 1, z, z, None, 0, 0, 5, 16)
    assert slots.tolist() == [0, 1, 2] and fit.tolist() == [0, 1, 2] and not len(doubt)


@pytest.mark.parametrize("seed", range(30))
def test_summary_matches_python(seed: int) -> None:
    rng = np.random.default_rng(seed)
    r = random.Random(seed)
    m = int(rng.integers(1, 600))
    for _ in range(20):
        gpu = np.maximum(0, _ints(rng, m, r.choice([1, 3, 500])))
        cpu = np.maximum(0, _ints(rng, m, r.choice([1, 50])))
        has = (gpu + cpu > 0) | (rng.random(m) < 0.05)
        tokens = np.where(has, np.minimum(r.choice([10**9, 300]), (gpu + cpu) * 16), 0)
        if r.random() < 0.3:  # every endpoint the same hit (the shared system prompt everywhere)
            gpu[:], cpu[:], has[:], tokens[:] = 3, 0, True, 48
        idx = np.sort(rng.choice(m, size=r.randint(1, m), replace=False)).astype(np.intp)
        gw, cw = r.choice([(1.0, 0.8), (2.0, 0.5), (1.0, 1.0)])
        assert fused.summary(has, gpu, cpu, tokens, idx, gw, cw) == py_summary(has, gpu, cpu, tokens, idx, gw, cw)


def test_summary_of_no_positions_is_refused_as_numpy_does() -> None:
    z = np.zeros(3, np.int64)
    none = np.zeros(0, np.intp)
    assert _fused.summary(z > 0, z, z, z, none, 1.0, 0.8) is NotImplemented
    with pytest.raises(IndexError):
        fused.summary(z > 0, z, z, z, none, 1.0, 0.8)
    with pytest.raises(IndexError, match="gpu"):
        _fused.summary(np.zeros(9, bool), z, z, z, np.array([5], np.intp), 1.0, 0.8)
