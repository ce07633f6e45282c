"""Decode fast-forward: k decode-only steps of an engine core planned at once, carried out when their time comes.

While every running request decodes and nothing can change the batch (no request to admit or a full batch, no finish,
no lease to expire, KV blocks enough for every step), the next steps are fixed by the MTP acceptance draws alone; a
request near its end has its drafts capped by the tokens it has left, as the scheduler caps them, up to the step where
one would finish (a single step: it changes the batch). `plan` works out k steps' tokens, durations and KV work in one
pass over the steps; `DecodeRun.apply` then carries out the first j of them on the core, exactly as j calls of
`EngineCore.step` would (the same tokens, blocks, cached blocks, KV events in the same order, MTP draws consumed). A
driver applies the steps that have started when something from outside touches the core (an arrival, a finished pull,
a released lease) and drops the rest: nothing of them was done, and the next plan computes them again for the new
batch.

Why: in a large simulated fleet most engine steps are small decode batches, and each step through `EngineCore.step`
(scheduling, sampling, one output per sequence) costs far more than the few numbers that differ from the last one.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import TYPE_CHECKING, Any

from llmd.perf.latency import line_times

from .uniforms import DECODE_PLAN_C, UniformStream, accepted

if TYPE_CHECKING:
    from .core import EngineCore, StepCostModel
    from .request import SimRequest

# Step times along a run are interpolated where the latency model is a straight line in the batch's total context
# (between exact probes); this is how close the probe must lie to the line.
_LINE_TOL = 1e-12


class DecodeRun:
    """A plan of decode-only steps for one core, from model time `start`: `durations` per step, `gained[s * n + i]`
    the tokens request i (of n) has gained by the end of step s. `applied` steps have been carried out, `cut` will be.

    Plain lists, read a number at a time: the run is compiled with the engine core (llmd/compiled.py), where a list's
    element costs a pointer read and a numpy scalar an object."""

    __slots__ = (
        "_behind",
        "_done",
        "_draws",
        "_event_list",
        "_event_steps",
        "_events",
        "_n",
        "_next_event",
        "applied",
        "cut",
        "durations",
        "gained",
        "out0",
        "requests",
        "scripted",
        "start",
    )

    def __init__(
        self,
        requests: list[SimRequest],
        start: float,
        durations: list[float],
        gained: list[int],
        events: list[tuple[int, int, int]],
        kv_steps: list[int],
        draws: list[int] | None,
    ) -> None:
        self.requests = requests
        self.start = start
        self.durations = durations
        self.gained = gained
        # (step, request index, tokens scheduled: 1 + drafts) where allocate_slots has blocks to add or cache, in step
        # order.
        self._events = events
        # The steps among those whose KV work is seen outside: blocks cached (BlockStored, CPU-tier writes) or a cached
        # block evicted (BlockRemoved). Taking a block that holds no hash changes nothing anyone reads before the next
        # such step or a sync, which carry it out first (apply keeps the order).
        self._event_list = kv_steps
        self._event_steps = set(kv_steps)
        self._next_event = 0
        self._n = len(requests)
        self._draws = draws  # MTP draws consumed by the end of each step
        self.out0 = [len(r.output_token_ids) for r in requests]
        # Every request's tokens of the whole run are in its output script: outputs need no step carried out.
        last = len(durations) - 1
        self.scripted = all(
            r.script_tokens is not None and len(r.script_tokens) >= o + self._gained_by(last, i)
            for i, (r, o) in enumerate(zip(requests, self.out0, strict=True))
        )
        self._done = [0] * len(requests)  # steps carried out per request
        self._behind = False  # some request's tokens lag the steps carried out (apply with complete=False)
        self.applied = 0
        self.cut = len(durations)

    def __len__(self) -> int:
        return len(self.durations)

    def apply(self, core: EngineCore, steps: int, complete: bool = True) -> None:
        """Carries out steps up to `steps` (of at most `cut`): what `EngineCore.step` does in them, in its order.

        `complete=False` carries out only the KV work (blocks allocated and cached, their events, CPU-tier writes) and
        the MTP draws: a request's tokens then catch up at its own next KV work, or at a later complete apply. What
        only reads the prefix cache, leases or block counts (a scrape, a P2P lookup) needs no more."""
        j = min(steps, self.cut)
        a = self.applied
        if j <= a:
            if complete and self._behind:
                self._complete(core)
            return
        kv = core.kv
        events = self._events
        p = self._next_event
        if p < len(events) and events[p][0] < j:
            cur = -1
            while p < len(events) and events[p][0] < j:
                s, i, n_sched = events[p]
                p += 1
                if s != cur:
                    if kv._cpu_jobs:
                        kv.flush_cpu_stores()  # the CPU-tier writes of the last step that cached blocks, at its end
                    cur = s
                self._catch_up(core, i, s)
                kv.allocate_slots(self.requests[i], n_sched)
            if kv._cpu_jobs:
                kv.flush_cpu_stores()
            self._next_event = p
        draws = self._draws
        if draws is not None:
            rng = core._mtp_rng
            assert isinstance(rng, UniformStream)
            rng.skip(draws[j - 1] - (draws[a - 1] if a else 0))
        self.applied = j
        if complete:
            self._complete(core)
        else:
            self._behind = True

    def _complete(self, core: EngineCore) -> None:
        """Every request's tokens up to the steps carried out."""
        j = self.applied
        for i in range(len(self.requests)):
            self._catch_up(core, i, j)
        self._behind = False

    def _catch_up(self, core: EngineCore, i: int, s: int) -> None:
        """Request i's tokens up to the start of step s (sampled, appended, their full blocks hashed)."""
        done = self._done
        d = done[i]
        if d >= s:
            return
        n = self.gained_between(i, d, s)
        r = self.requests[i]
        r.num_computed_tokens += n
        r.append_output(r.draw_tokens(n, core.sampler))
        core.generation_tokens_total += n
        done[i] = s

    def tokens(self, i: int, a: int, b: int) -> list[int] | None:
        """Request i's tokens from steps a..b-1: read from its output script, or from its output once those steps are
        carried out; None when neither can say yet (random tokens past the script, steps not carried out)."""
        o = self.out0[i]
        lo = o + self._gained_by(a - 1, i)
        hi = o + self._gained_by(b - 1, i)
        r = self.requests[i]
        script = r.script_tokens
        if script is not None and hi <= len(script):
            return script[lo:hi]  # what draw_tokens will take from it
        if self._done[i] >= b:
            return r.output_token_ids[lo:hi]
        return None

    def has_events(self, s: int) -> bool:
        """Whether step s has KV events or CPU-tier writes to send at its end (it caches blocks, or takes one that
        evicts a cached block)."""
        return s in self._event_steps

    def next_event_step(self, s: int) -> int:
        """The first step from s on that has KV events (`len(self)` if none does)."""
        steps = self._event_list
        k = bisect_left(steps, s)
        return steps[k] if k < len(steps) else len(self.durations)

    def gained_between(self, i: int, a: int, b: int) -> int:
        """Tokens request i gains in steps a..b-1."""
        return self._gained_by(b - 1, i) - self._gained_by(a - 1, i)

    def _gained_by(self, s: int, i: int) -> int:
        """Tokens request i has gained by the end of step s (0 before the run: s = -1)."""
        return self.gained[s * self._n + i] if s >= 0 else 0


def plan(core: EngineCore, now: float, max_steps: int) -> DecodeRun | None:
    """The decode-only steps from `now` that nothing inside the core can change, or None when the next step is not
    one (a prefill, an admission, a finish, too few free blocks): step() it then. The run ends before the first step
    in which a request would finish."""
    s = core.scheduler
    running = s.running
    if not running or core._pending_outputs:
        return None
    if (s.waiting or s.kv_ready) and len(running) < s.max_num_seqs:
        # Admission is tried every step (and a blocked head request's prefix lookup refreshes the CPU tier's LRU);
        # only a full batch skips it until a request finishes.
        return None
    n = len(running)
    k_spec = s.num_spec
    n_sched = 1 + k_spec
    if n * n_sched > s.max_num_batched_tokens:
        return None
    inflight = s.inflight_prefills
    max_len = s.max_model_len
    ctx: list[int] = []
    rem: list[int] = []
    blocks: list[int] = []
    cached: list[int] = []
    for r in running:
        nt = r.num_tokens
        n_out = len(r.output_token_ids)
        if r.num_computed_tokens != nt - 1 or not n_out or r.request_id in inflight:
            return None  # a prefill (or the last chunk of one) in the batch
        ctx.append(nt)
        rem.append(min(r.max_tokens - n_out, max_len - nt))
        blocks.append(len(r.block_ids))
        cached.append(r.num_cached_blocks)
    # Each step gains each request at least one token, so the first finish comes by step min(rem) - 1 (0-based): a run
    # of at least two steps needs three tokens left everywhere.
    reach = min(rem)
    if reach < 3:
        return None
    lat = core.latency
    mtp = core._mtp_draws
    u: Any = []  # the draws: a list, or the stream's array of doubles (ahead)
    pos = 0
    beta, k_lat = 0.0, 0
    mtp_on = False
    if k_spec and mtp is not None:
        # Draw for about the steps the tokens left allow at the mean rate (more would be computed for nothing).
        steps = min(max_steps, reach, int(reach / lat.tokens_per_decode_step() * 1.25) + 2)
        beta, k_lat = mtp
        rng = core._mtp_rng
        assert isinstance(rng, UniformStream)
        u, pos = rng.ahead(steps * n * k_lat)  # each sample reads at most k_lat draws
        mtp_on = True
    elif k_spec:
        return None  # a latency model whose draws we cannot replay in bulk: single steps
    else:
        steps = min(max_steps, reach)
    bs = core.kv.block_size
    free = core.kv.num_free_blocks
    # Blocks the run can take without evicting a cached one (the free queue's unhashed front): a step whose only KV
    # work is taking such blocks sends no KV event, so it needs no event of its own.
    silent = core.kv.unhashed_free_front(n * ((steps + 1) * n_sched // bs + 2))
    # Per request, the tokens its blocks hold and where its next full block ends: a step needs a new block or caches
    # one where its tokens cross these (compared, not divided, at every step).
    held = [b * bs for b in blocks]
    next_full = [(c + 1) * bs for c in cached]
    # One pass over the steps (plan_steps: in C where it was built), until one would not be a plain decode step.
    k, gained, events, kv_steps, draws, totals = _steps(
        ctx, rem, held, next_full, k_spec, bs, steps, u, pos, beta, k_lat, mtp_on, free, silent
    )
    if k < 2:
        return None
    durations = _durations(lat, ctx, gained, totals)
    expiry = core.next_lease_expiry()
    if expiry is not None:
        # step() frees a lease whose expiry is before the step's start: stop before that step.
        k = bisect_right(list(accumulate(durations[:-1], initial=now)), expiry)
        if k < 2:
            return None
    events = events[: bisect_left(events, (k, 0, 0))]
    kv_steps = kv_steps[: bisect_left(kv_steps, k)]
    return DecodeRun(
        list(running),
        now,
        durations[:k],
        gained[: k * n],
        events,
        kv_steps,
        draws[:k] if draws is not None else None,
    )


def plan_steps(
    ctx: list[int],
    rem: list[int],
    held: list[int],
    next_full: list[int],
    k_spec: int,
    bs: int,
    max_steps: int,
    u: Sequence[float],
    pos: int,
    beta: float,
    k_lat: int,
    mtp: bool,
    free: int,
    silent: int,
) -> tuple[int, list[int], list[tuple[int, int, int]], list[int], list[int] | None, list[float]]:
    """The planner's pass over the steps, each as step() would take it, until one would not be a plain decode step: a
    request finishes in it, or it needs more new blocks than `free` (it would preempt). A request with fewer than
    k_spec + 1 tokens left is scheduled only the drafts it can use (EngineScheduler.schedule): it holds and allocates
    for fewer, keeps at most that many of the drafts the model accepts, and with none to verify draws nothing.

    Per request i: `ctx` its tokens, `rem` the tokens it has left, `held` the tokens its blocks hold, `next_full`
    where its next full block ends (`held` and `next_full` are worked on). MTP draws (`mtp`) are read from u[pos:].
    `silent`: blocks the run can take without evicting a cached one. Returns k, the steps planned, and for them:
    gained[s * n + i] (tokens request i has by the end of step s), the events (step, request, 1 + drafts) where
    allocate_slots adds or caches blocks, the steps with KV work seen outside (DecodeRun._event_list), the MTP draws
    read by the end of each step (None without MTP) and each step's total context.

    `_decodeplan.steps` is this in C (the planner's largest cost, compiled by mypyc, was this loop's per-request
    work); tests/test_decode_plan.py holds the two to the same answers."""
    n = len(ctx)
    gained: list[int] = []
    before = [0] * n  # tokens gained by the start of the step under way
    totals: list[float] = []
    events: list[tuple[int, int, int]] = []
    kv_steps: list[int] = []
    draws: list[int] = []
    allocated = 0
    p0 = pos
    k = 0
    while k < max_steps:
        mark = len(events)
        alloc = 0  # new blocks the step takes
        finish = False
        caches = False
        total = 0
        for i in range(n):
            c = ctx[i] + before[i]
            total += c
            d = rem[i] - before[i] - 1
            if d > k_spec:
                d = k_spec
            need = c + d  # slots for the step: its tokens and drafts
            if need > held[i] or c >= next_full[i]:
                events.append((k, i, 1 + d))
                if need > held[i]:
                    grow = (need - held[i] + bs - 1) // bs
                    alloc += grow
                    held[i] += grow * bs
                if c >= next_full[i]:
                    next_full[i] = (c // bs + 1) * bs
                    caches = True
            if d > 0 and mtp:
                acc, pos = accepted(u, pos, beta, k_lat)
                before[i] += (acc if acc < d else d) + 1
            else:
                before[i] += 1
            if before[i] >= rem[i]:
                finish = True  # a step that finishes a request is not planned: single-step it
                break
            gained.append(before[i])
        if finish or allocated + alloc > free:  # or it would preempt: single-step it
            del events[mark:]  # the step is not planned: its draws and gains are dropped
            del gained[k * n :]
            break
        if caches or (alloc and allocated + alloc > silent):
            kv_steps.append(k)
        allocated += alloc
        if mtp:
            draws.append(pos - p0)
        totals.append(float(total))
        k += 1
    return k, gained, events, kv_steps, draws if mtp else None, totals


def _row(ctx: list[int], gained: list[int], s: int) -> list[int]:
    """The contexts at the start of step s."""
    if s == 0:
        return list(ctx)
    base = (s - 1) * len(ctx)
    return [c + gained[base + i] for i, c in enumerate(ctx)]


def _durations(lat: StepCostModel, ctx: list[int], gained: list[int], total: list[float]) -> list[float]:
    """step_time((), row) for each step's contexts (_row; `total`: their sums). Where the latency model has a decode
    line for the batch (the project's LatencyModel past DSA's top-k, or without DSA: a function of the total context
    alone), every step exactly, by step_time's own float operations and without a probe. Otherwise exact at probes and
    interpolated between them where the latency model is a straight line in the batch's total context.

    For the project's latency model a decode step's time is a maximum of lines in the batch's total context (compute
    or memory bound) wherever the contexts do not straddle DSA's top-k, where it also depends on how the total is
    spread. So: first the run must cost the same with all its extra tokens on its longest context (else every step is
    computed exactly); then a convex function that meets its chord at the midpoint is that chord, so a stretch whose
    exact midpoint lies on the line through its ends is interpolated, and one that does not (a bend) is halved."""
    line_of = getattr(lat, "decode_line", None)
    if line_of is not None:
        line = line_of(len(ctx), min(ctx))  # contexts only grow along the run: step 0's shortest is the run's
        if line is not None:
            return _line_times(line, total)
    k = len(total)
    out = [0.0] * k

    def exact(s: int) -> float:
        return lat.step_time((), _row(ctx, gained, s))

    def near(x: float, y: float) -> bool:
        return abs(x - y) <= _LINE_TOL * abs(y)

    first, last = exact(0), exact(k - 1)
    moved = list(ctx)
    moved[moved.index(max(moved))] += int(total[-1] - total[0])
    if k < 4 or not near(lat.step_time((), moved), last):
        return [first, *(exact(s) for s in range(1, k - 1)), last]
    stack = [(0, k - 1, first, last)]
    while stack:
        a, b, ta, tb = stack.pop()
        out[a], out[b] = ta, tb
        if b - a < 2:
            continue
        m = (a + b) // 2
        tm = exact(m)
        slope = (tb - ta) / (total[b] - total[a])
        if near(ta + (total[m] - total[a]) * slope, tm):
            ta0 = total[a]
            for x in range(a + 1, b):
                out[x] = ta + (total[x] - ta0) * slope
            out[m] = tm
        else:
            stack.append((a, m, ta, tm))
            stack.append((m, b, tm, tb))
    return out


_Steps = Callable[
    [list[int], list[int], list[int], list[int], int, int, int, Sequence[float], int, float, int, bool, int, int],
    tuple[int, list[int], list[tuple[int, int, int]], list[int], "list[int] | None", list[float]],
]
_steps: _Steps = DECODE_PLAN_C.steps if DECODE_PLAN_C is not None else plan_steps
_line_times: Callable[[Any, list[float]], list[float]] = (
    DECODE_PLAN_C.line_times if DECODE_PLAN_C is not None else line_times
)
