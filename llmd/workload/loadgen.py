"""The load generator: closed-loop agents replaying a `Workload` over the OpenAI chat API, one HDF5 row per request.

Each agent runs its sessions one after another and a session's turns in order, sleeping each turn's `gap_before_s`
(tool time) after the previous response. A turn with `forks` starts its sub-agent sessions concurrently right after
its response; the main agent waits for them (like a blocking Task tool call) before its next gap, unless
`LoadConfig.wait_subagents` is False. Requests stream (`stream_options.include_usage`) with `max_tokens` =
the planned output and `ignore_eos`, so output lengths follow the plan.

Every request becomes one row of llmd.metrics' REQUEST_COLUMNS (errors and aborted requests too, never an exception;
a turn whose prompt cannot be built is an error row with status 0 that ends its session, not the run),
and every second one client time-series row. `run_load` stops starting turns when the duration, the request budget or
the plans end, or when `stop` is set (or Ctrl-C arrives): in-flight requests are cancelled and recorded as aborted,
and the file is closed with every row so far.

Three ways to start sessions: closed loop (default; `profile.agents` agents, each running its sessions one after
another), open loop (`LoadConfig.arrival_rate` = R: new main sessions arrive as a Poisson process of R sessions per
second, seeded by the workload's seed, however many are still running; each session's turns still follow each other,
since a turn's prompt holds the previous response), and trace replay (`LoadConfig.trace`: every session starts at its
first record's time offset and sends each turn at its offset or when the previous response is back, whichever is
later; a sub-agent forks from its parent's context as of its start, after the parent's first response).

A server that cannot be reached (connection refused or dropped before an answer) makes every sender back off
together: exponential delays with full jitter (llmd.net.backoff; 0.1 s doubling up to 10 s), reset by the next
answer, with one warning when it starts and one when the server answers again. Without it a run whose router died
fired failing requests as fast as sessions could start.

Client-side delay: how late each turn is sent relative to its planned time (previous response + gap); the summary
reports its mean and its share of the planned gaps, the figure benchmarks/client.py holds under 5%.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from llmd.metrics.writer import MetricsWriter
from llmd.net import http_client
from llmd.net.backoff import Backoff
from llmd.workload.chat_request import error_text, read_headers, read_stream, read_usage
from llmd.workload.profiles import Workload
from llmd.workload.prompts import PromptTurn, PromptWriter
from llmd.workload.run_stats import ABORTED, LoadSummary, RunStats
from llmd.workload.sessions import SessionPlan, Turn, plan_session
from llmd.workload.trace import TraceSession

log = logging.getLogger(__name__)
# Failures of the connection itself, before any answer: the server is gone or unreachable, not failing a request.
_CONNECTION_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


@dataclass
class LoadConfig:
    url: str  # router or engine base URL
    model: str  # served model name
    tokenizer_dir: str
    workload: Workload  # from llmd.workload.profile_from_spec
    output: Path  # metrics.h5 to create (MetricsWriter, producer "client"); never overwritten
    duration_s: float | None = None  # stop starting new turns after this; None: the profile's, else until plans end
    max_requests: int | None = None
    api_key: str | None = dataclasses.field(default=None, repr=False)  # sent, never written or shown
    progress: bool = True
    meta: dict | None = None  # run metadata for the HDF5 file (spec YAML under "spec", seed, ...)
    request_timeout_s: float = 600.0
    stream: bool = True
    wait_subagents: bool = True  # the main agent waits for the sub-agents it forked before its next turn
    max_connections: int | None = None  # default: sized to the concurrency (agents, plus sub-agent bursts)
    flush_interval_s: float = 1.0
    tokenizer: Any = None  # an already loaded tokenizer (skips loading tokenizer_dir)
    # Open loop: new main sessions per second, Poisson, seeded by the workload's seed (None: closed-loop agents).
    arrival_rate: float | None = None
    trace: list[TraceSession] | None = None  # replay these sessions (llmd.workload.trace) instead of the profile


class _Run:
    def __init__(self, cfg: LoadConfig, writer: MetricsWriter, prompts: PromptWriter, stop: asyncio.Event) -> None:
        self.cfg = cfg
        self.writer = writer
        self.prompts = prompts
        self.stop = stop
        self.stats = RunStats()
        # Times are seconds since the file's start_time (the schema's "run start"), which a caller may have set to
        # the run's own start, before this client existed: rows then line up with the other producers' by wall clock.
        self.t0 = time.perf_counter() - max(0.0, time.time() - writer.start_time)
        prof = cfg.workload.profile
        # A trace runs to its end unless told otherwise; a profile for its duration.
        self.duration = cfg.duration_s if cfg.duration_s is not None or cfg.trace is not None else prof.duration_s
        # A trace's token counts are whole prompts: its system prompt is the salt line only, not the profile's.
        self.system_tokens = prof.model.system if cfg.trace is None else 0
        self.endpoint = cfg.url.rstrip("/") + "/v1/chat/completions"
        self.headers = {"Content-Type": "application/json"}
        if cfg.api_key:
            self.headers["Authorization"] = f"Bearer {cfg.api_key}"
        self.http: aiohttp.ClientSession | None = None
        self.children: set[asyncio.Task[None]] = set()
        self.on_row: Callable[[], None] | None = None
        self.pending: list[dict[str, Any]] = []  # request rows not yet handed to the writer (flush_timeseries)
        self.backoff = Backoff()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def may_start(self) -> bool:
        if self.stop.is_set():
            return False
        if self.duration is not None and self.now() >= self.duration:
            return False
        return self.cfg.max_requests is None or self.stats.started < self.cfg.max_requests

    # -- agents and sessions -------------------------------------------------------------------------------------

    async def start_at(self, planned: float, gap: float) -> bool:
        """Sleep until the turn's planned start; False if the run ended meanwhile. How late it starts against the
        gap it waited is the client-side delay benchmarks/client.py holds under 5%."""
        wait = planned - self.now()
        if wait > 0:
            await asyncio.sleep(wait)
        if not self.may_start():
            return False
        self.stats.delay_sum += max(0.0, self.now() - planned)
        self.stats.gap_sum += gap
        self.stats.delay_n += 1
        return True

    async def agent(self, agent: int) -> None:
        for plan in self.cfg.workload.agent_sessions(agent):
            if not self.may_start():
                return
            self.stats.sessions += 1
            await self.session(plan, None)

    async def session(self, plan: SessionPlan, parent: PromptTurn | None) -> None:
        # The first turn's gap is the session's start offset (relative to now); a sub-agent starts at once.
        ready = self.now()
        by_turn: dict[int, list[SessionPlan]] = {}
        for child in plan.children:
            by_turn.setdefault(child.parent_turn_index or 0, []).append(child)
        children: list[asyncio.Task[None]] = []
        prompts = self.prompts.session(plan, self.system_tokens, parent)
        try:
            for turn in plan.turns:
                # A prompt that cannot be built ends its session with an error row (at the turn's planned time),
                # never the run.
                failure = None
                try:
                    pt = next(prompts, None)
                except Exception as e:
                    pt, failure = None, f"prompt: {type(e).__name__}: {e}"
                if pt is None and failure is None:
                    return
                planned = ready + turn.gap_before_s
                if self.duration is not None and planned >= self.duration:
                    return  # it would start after the end: do not sleep until then
                if not await self.start_at(planned, turn.gap_before_s):
                    return
                if failure is not None or pt is None:
                    self.prompt_error(turn, failure or "prompt: missing")
                    await asyncio.sleep(0)  # let the other agents run, should every session fail at once
                    return
                ok = await self.request(pt)
                if not ok:
                    return  # a failed turn ends its session: the conversation cannot continue
                if turn.forks:
                    kids = [self.spawn(self.subagent(c, pt)) for c in by_turn.get(turn.turn_index, [])]
                    children.extend(kids)
                    if self.cfg.wait_subagents and kids:
                        await asyncio.gather(*kids)
                ready = self.now()
            if children:
                await asyncio.gather(*children)
        finally:
            for c in children:
                c.cancel()

    def spawn(self, coro: Any) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self.children.add(task)
        task.add_done_callback(self.children.discard)
        return task

    async def subagent(self, plan: SessionPlan, parent: PromptTurn) -> None:
        if not self.may_start():
            return
        self.stats.subagent_sessions += 1
        await self.session(plan, parent)

    # -- open loop ----------------------------------------------------------------------------------------------

    async def open_loop(self, rate: float) -> None:
        """Start main session k (ids "a<k>-s0") at the k-th arrival of a Poisson process of `rate` per second,
        until the duration or request budget ends; then wait for the sessions still running."""
        wl = self.cfg.workload
        rng = np.random.default_rng([wl.seed, 0x0A11])  # the arrival times depend on the seed only
        t = 0.0
        k = 0
        while True:
            t += float(rng.exponential(1.0 / rate))
            if self.duration is not None and t >= self.duration:
                break
            wait = t - self.now()
            if wait > 0:
                await asyncio.sleep(wait)
            if not self.may_start():
                break
            plan = plan_session(wl.profile.model, wl.seed, k, 0)
            k += 1
            self.stats.sessions += 1
            self.spawn(self.session(plan, None))
        await self.join_children()

    async def join_children(self) -> None:
        while self.children:
            results = await asyncio.gather(*list(self.children), return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                    raise r

    # -- trace replay ---------------------------------------------------------------------------------------------

    async def replay(self, sessions: list[TraceSession]) -> None:
        """Every trace session as its own task (each sleeps until its start); returns when all have ended."""
        self.trace_latest: dict[str, PromptTurn] = {}
        self.trace_ready = {s.session_id: asyncio.Event() for s in sessions}
        for s in sessions:
            if self.duration is not None and s.start >= self.duration:
                break  # sorted by start: the rest start later still
            self.spawn(self.trace_session(s))
        await self.join_children()

    async def trace_session(self, ts: TraceSession) -> None:
        sid = ts.session_id
        ready_ev = self.trace_ready[sid]
        try:
            wait = ts.start - self.now()
            if wait > 0:
                await asyncio.sleep(wait)
            parent: PromptTurn | None = None
            if ts.parent is not None:
                await self.trace_ready[ts.parent].wait()  # it forks from a context the parent has built
                parent = self.trace_latest.get(ts.parent)
            if not self.may_start():
                return
            if ts.parent is None:
                self.stats.sessions += 1
            else:
                self.stats.subagent_sessions += 1
            prompts = self.prompts.session(_trace_plan(ts, parent), self.system_tokens, parent)
            ready = self.now()
            for tt in ts.turns:
                if self.duration is not None and tt.t >= self.duration:
                    return
                try:
                    pt = next(prompts)
                except Exception as e:
                    self.prompt_error(tt.turn, f"prompt: {type(e).__name__}: {e}")
                    return
                if tt.input_text is not None:  # the trace's own text, as recorded
                    pt = PromptTurn(pt.turn, [{"role": "user", "content": tt.input_text}], pt.output_text)
                planned = max(tt.t, ready)  # never before the previous response: its prompt holds it
                if not await self.start_at(planned, max(0.0, planned - ready)):
                    return
                if not await self.request(pt):
                    return
                self.trace_latest[sid] = pt
                ready_ev.set()
                ready = self.now()
        finally:
            ready_ev.set()  # children of a failed or finished session start from what there is

    # -- one request ---------------------------------------------------------------------------------------------

    def prompt_error(self, turn: Turn, error: str) -> None:
        """The row of a turn whose prompt could not be built: never sent (status 0), counted as a request."""
        self.stats.started += 1
        t = self.now()
        row: dict[str, Any] = {
            "request_id": f"{turn.session_id}#{turn.turn_index}",
            "session": turn.session_id,
            "turn": turn.turn_index,
            "is_subagent": turn.is_subagent,
            "send_time": t,
            "status": 0,
            "error": error,
        }
        self._record(row, t)

    async def request(self, pt: PromptTurn) -> bool:
        """Send one turn and write its row; True when it succeeded."""
        assert self.http is not None
        cfg = self.cfg
        turn = pt.turn
        self.stats.started += 1
        body: dict[str, Any] = {
            "model": cfg.model,
            "messages": pt.messages,
            "max_tokens": turn.output_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": cfg.stream,
        }
        if cfg.stream:
            body["stream_options"] = {"include_usage": True}
        row: dict[str, Any] = {
            "request_id": f"{turn.session_id}#{turn.turn_index}",
            "session": turn.session_id,
            "turn": turn.turn_index,
            "is_subagent": turn.is_subagent,
        }
        # The router's own rows carry the same request id and session, so client and router rows join.
        headers = {**self.headers, "X-Request-Id": row["request_id"], "X-Session-Id": turn.session_id}
        wait = self.backoff.wait_s(self.now())
        if wait > 0:
            await asyncio.sleep(wait)
        t_send = self.now()
        row["send_time"] = t_send
        ok = False
        try:
            async with await http_client.post(self.http, self.endpoint, data=json.dumps(body), headers=headers) as resp:
                self.answered()
                read_headers(row, resp)
                row["status"] = resp.status
                if resp.status >= 400:
                    text = await resp.text(errors="replace")
                    row["error"] = f"HTTP {resp.status}: {error_text(text)}"
                elif cfg.stream:
                    await read_stream(resp, row, self.t0, t_send)
                else:
                    data = await resp.json(content_type=None)
                    t = self.now() - t_send
                    row["ttft_s"] = row["e2e_s"] = t
                    read_usage(row, data.get("usage"))
                    if "error" in data:
                        row["error"] = error_text(data["error"])
            ok = not row.get("error")
        except asyncio.CancelledError:
            row["error"] = ABORTED
            self._record(row, t_send)
            raise
        except TimeoutError:
            row["error"] = f"timeout after {cfg.request_timeout_s:g} s"
        except _CONNECTION_ERRORS as e:
            row["error"] = f"{type(e).__name__}: {e}"
            self.unreachable(e)
        except aiohttp.ClientError as e:
            row["error"] = f"{type(e).__name__}: {e}"
        except (ValueError, KeyError, TypeError) as e:
            row["error"] = f"bad response: {type(e).__name__}: {e}"
        self._record(row, t_send)
        return ok

    def unreachable(self, exc: BaseException) -> None:
        b = self.backoff
        b.failed(self.now())
        if b.failures == 1:
            log.warning(
                "cannot reach %s (%s: %s); backing off (up to %g s between attempts) until it answers",
                self.endpoint,
                type(exc).__name__,
                exc,
                b.cap_s,
            )

    def answered(self) -> None:
        b = self.backoff
        if b.failures:
            log.warning("%s answers again after %d failed connection(s)", self.endpoint, b.failures)
            b.succeeded()

    def _record(self, row: dict[str, Any], t_send: float) -> None:
        t = self.now()
        row.setdefault("e2e_s", t - t_send)
        self.pending.append(row)
        self.stats.add(row, t)
        if self.on_row is not None:
            self.on_row()

    # -- time series and progress --------------------------------------------------------------------------------

    async def ticker(self, progress: Any, task_id: Any) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.flush_timeseries(final=False)
            if progress is not None:
                self.update_progress(progress, task_id)

    def flush_timeseries(self, final: bool) -> None:
        """The finished seconds' time-series rows and every request row so far, in one batch each: one dict-to-row
        conversion and one writer lock a second, not per request (the writer's flush thread holds that lock while
        it writes, and waiting for it would stall the event loop)."""
        if self.pending:
            rows, self.pending = self.pending, []
            self.writer.append_requests(rows)
        rows = self.stats.take_bins(None if final else int(self.now()))
        if rows:
            self.writer.append_timeseries(rows)

    def update_progress(self, progress: Any, task_id: Any) -> None:
        s = self.stats
        el = max(self.now(), 1e-9)
        progress.update(
            task_id,
            completed=s.requests,
            description=(
                f"requests {s.requests:,}  errors {s.errors:,}  "
                f"in {s.input / el:,.0f} tok/s  out {s.output / el:,.0f} tok/s"
            ),
        )


def _trace_plan(ts: TraceSession, parent: PromptTurn | None) -> SessionPlan:
    """A trace session as a plan for the prompt writer; a sub-agent's first turn extends its parent's prompt when it
    is larger than it (the difference is the task text), else starts a fresh context."""
    turns = [tt.turn for tt in ts.turns]
    first = turns[0]
    if first.is_subagent:
        base = parent.turn.input_tokens if parent is not None else None
        if base is not None and first.input_tokens > base:
            turns[0] = dataclasses.replace(first, new_tokens=first.input_tokens - base)
        else:
            turns[0] = dataclasses.replace(first, reset=True, new_tokens=first.input_tokens)
    return SessionPlan(ts.session_id, 0, 0, turns, parent_session_id=ts.parent)


def _without_credentials(url: str) -> str:
    """The URL as recorded: any user:password@ part dropped (the API key never reaches a file either)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    netloc = host + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _check_config(cfg: LoadConfig) -> None:
    """ValueError for a run that could not start or would never end (before any file is created)."""
    prof = cfg.workload.profile
    if cfg.arrival_rate is not None and not (math.isfinite(cfg.arrival_rate) and cfg.arrival_rate > 0):
        raise ValueError(f"arrival_rate must be a positive number of sessions per second, got {cfg.arrival_rate}")
    duration = cfg.duration_s if cfg.duration_s is not None or cfg.trace is not None else prof.duration_s
    unbounded = cfg.arrival_rate is not None or prof.sessions_per_agent is None
    if cfg.trace is None and unbounded and duration is None and cfg.max_requests is None:
        what = "open-loop arrivals run" if cfg.arrival_rate is not None else f"profile {prof.name!r} runs"
        raise ValueError(f"{what} until a duration ends: give duration_s or max_requests")


def _connections(cfg: LoadConfig) -> int:
    if cfg.max_connections is not None:
        return max(1, cfg.max_connections)
    prof = cfg.workload.profile
    model = prof.model
    burst = 0
    if model.fork_p > 0 or model.fixed_fork is not None:
        burst = int(model.group_size.hi) if math.isfinite(model.group_size.hi) else 256
        if model.fixed_fork is not None:
            burst = max(burst, model.fixed_fork[1])
    # Each agent has one request in flight, plus a sub-agent burst for a share of the agents at a time.
    return max(16, prof.agents + min(prof.agents, 8) * burst)


@contextlib.contextmanager
def _sigint_sets(stop: asyncio.Event, loop: asyncio.AbstractEventLoop):
    """Ctrl-C sets `stop` (a clean stop) while the run lasts; only possible on the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    try:
        loop.add_signal_handler(signal.SIGINT, stop.set)
    except (NotImplementedError, RuntimeError, ValueError):
        yield
        return
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        with contextlib.suppress(TypeError, ValueError):
            signal.signal(signal.SIGINT, previous)


async def run_load(cfg: LoadConfig, stop: asyncio.Event | None = None) -> LoadSummary:
    """Drive `cfg.workload` against `cfg.url` and write every request to `cfg.output`; returns the summary.

    Raises FileExistsError when the output exists and ValueError for a workload that would never end; request
    failures never raise, they are rows."""
    stop = stop or asyncio.Event()
    _check_config(cfg)
    output = Path(cfg.output)
    if output.exists():
        raise FileExistsError(f"{output} exists; metrics are never overwritten, choose another output")
    output.parent.mkdir(parents=True, exist_ok=True)
    tok = cfg.tokenizer
    if tok is None:
        from llmd.tokens import Tokenizer

        tok = await asyncio.to_thread(Tokenizer, cfg.tokenizer_dir)
    prompts = PromptWriter(tok, cfg.workload.salt)
    meta = dict(cfg.meta or {})
    meta.setdefault("seed", cfg.workload.seed)
    meta.setdefault("profile", cfg.workload.profile.name)
    meta.setdefault("salt", cfg.workload.salt)
    meta.setdefault("url", _without_credentials(cfg.url))
    meta.setdefault("model", cfg.model)
    writer = MetricsWriter(output, "client", meta, cfg.flush_interval_s)
    run: _Run | None = None
    try:
        run = _Run(cfg, writer, prompts, stop)
        # Open loop and replay have no agent count to size the pool by: as many connections as requests in flight.
        limit = 0 if cfg.trace is not None or cfg.arrival_rate is not None else _connections(cfg)
        # Idle connections closed before a vLLM server closes them (its 5 s keep-alive): `llmd bench` may point
        # straight at one, and think time between turns is often longer than that.
        connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit, keepalive_timeout=http_client.KEEPALIVE_S)
        timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
        progress = task_id = None
        if cfg.progress:
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), transient=False)
            task_id = progress.add_task("starting", total=None)
            progress.start()
        loop = asyncio.get_running_loop()
        stopped = False
        try:
            with _sigint_sets(stop, loop):
                async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
                    run.http = http
                    if cfg.trace is not None:
                        agents = [asyncio.create_task(run.replay(cfg.trace))]
                    elif cfg.arrival_rate is not None:
                        agents = [asyncio.create_task(run.open_loop(cfg.arrival_rate))]
                    else:
                        agents = [asyncio.create_task(run.agent(a)) for a in range(cfg.workload.profile.agents)]
                    ticker = asyncio.create_task(run.ticker(progress, task_id))
                    all_done = asyncio.gather(*agents, return_exceptions=True)
                    stop_wait = asyncio.create_task(stop.wait())
                    await asyncio.wait({all_done, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
                    stopped = stop.is_set() and not all_done.done()
                    for t in agents:
                        t.cancel()
                    results = list(await all_done)
                    while run.children:  # sub-agents of cancelled sessions record their aborted rows
                        kids = list(run.children)
                        for t in kids:
                            t.cancel()
                        results += await asyncio.gather(*kids, return_exceptions=True)
                    stop_wait.cancel()
                    ticker.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await ticker
                    for r in results:
                        if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                            raise r
        finally:
            if progress is not None:
                run.update_progress(progress, task_id)
                progress.stop()
        run.flush_timeseries(final=True)
        return run.stats.summary(run.now(), stopped, str(cfg.output))
    finally:
        if run is not None:
            with contextlib.suppress(Exception):
                run.flush_timeseries(final=True)
        writer.close()


__all__ = ["LoadConfig", "LoadSummary", "run_load"]
