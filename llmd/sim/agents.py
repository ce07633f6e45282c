"""The agents in virtual time: llmd's workload generator (the same session plans the load generator sends) played as
closed-loop agents, each a chain of events instead of a coroutine.

An agent runs its sessions back to back; a session sends its turns in order, each `gap_before_s` of tool time after
the previous response; a turn that forks starts its sub-agents when its response completes and (as the load
generator's `wait_subagents`) the session goes on when they have all ended. A turn planned after the duration is not
sent; a failed turn ends its session (the conversation cannot go on), as in the load generator.

Prompts are what the load generator's prompt writer sends, in tokens: the shared, salted system prompt; then a
session's context grows by the previous output and the turn's new tokens; resets and compactions start a fresh
context after the system prompt; a sub-agent starts from its parent's prompt at the fork plus its task.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from llmd.sim.context import Context, ContextBuilder
from llmd.sim.loop import EventLoop
from llmd.sim.router import Call
from llmd.sim.tokens import TokenRuns
from llmd.workload.profiles import Workload
from llmd.workload.sessions import SessionPlan, Turn
from llmd.workload.trace import TraceSession


@dataclass(slots=True)
class AgentStats:
    sessions: int = 0
    subagent_sessions: int = 0
    sent: int = 0
    done: int = 0
    failed: int = 0
    overflows: int = 0  # turns compacted or reset because the prompt would not have fit the model's window


class Agents:
    def __init__(
        self,
        loop: EventLoop,
        workload: Workload,
        builder: ContextBuilder,
        send: Callable[[Call], None],
        duration_s: float,
    ) -> None:
        self.loop = loop
        self.workload = workload
        self.builder = builder
        self.send = send
        self.duration_s = duration_s
        self.stats = AgentStats()
        self.inflight = 0
        self.live = 0  # agents (or trace sessions) not finished: the run may end early when none is left
        salt = workload.salt
        self._seed_base = int.from_bytes(
            hashlib.sha256(f"llmd-sim:{workload.seed}:{salt}".encode()).digest()[:8], "big"
        )
        self._runs = 0
        sys_tokens = workload.profile.model.system
        self.system = builder.extend(builder.empty, self._fresh(sys_tokens))

    def _fresh(self, n: int) -> TokenRuns:
        """`n` new tokens no other run shares."""
        self._runs += 1
        return TokenRuns((), self.builder.vocab).extend(
            (self._seed_base + self._runs * 0x9E3779B97F4A7C15) & (2**64 - 1), n
        )

    def send_turn(self, turn: Turn, prompt: Context, on_done: Callable[[Call], None], new_tokens: int) -> None:
        """Send a session's turn with this prompt; its answer is the planned output, fresh tokens."""
        call = Call(
            f"{turn.session_id}#{turn.turn_index}",
            turn.session_id,
            turn.turn_index,
            turn.is_subagent,
            prompt,
            turn.output_tokens,
            self._fresh(turn.output_tokens),
            self.loop.now,
            on_done,
            new_tokens,
        )
        self.stats.sent += 1
        self.stats.overflows += turn.overflow
        self.inflight += 1
        self.send(call)

    def answered(self, call: Call) -> bool:
        """Count a finished call; False when it failed (its session cannot go on)."""
        self.inflight -= 1
        self.stats.done += 1
        if call.status != 200:
            self.stats.failed += 1
            return False
        return True

    def start(self) -> None:
        self.live = self.workload.profile.agents
        for a in range(self.workload.profile.agents):
            # Sub-agents are planned when their fork comes (_Session._done): most forks of a session planned near
            # the end of a run never come, and planning one costs a generator and a dozen numpy draws.
            it = self.workload.agent_sessions(a, subagents=False)
            self.loop.at(0.0, self._next_session, it)

    @property
    def done(self) -> bool:
        """Every agent has run all its sessions (profiles with a fixed number of them, a trace)."""
        return self.live == 0

    def replay(self, sessions: list[TraceSession]) -> None:
        """Replay a trace instead of the profile's agents (llmd.workload.trace): each session starts at its first
        turn's time, each turn at its time but never before the previous response; a sub-agent waits until its
        parent has had a response and forks from the parent's latest prompt. A trace's token counts are whole
        prompts, so there is no shared system prompt (as in the load generator)."""
        self.system = self.builder.empty
        self.latest: dict[str, Context] = {}
        self.waiting_for: dict[str, list[_TraceSession]] = {}
        self.ready: set[str] = set()
        for ts in sessions:
            if ts.start >= self.duration_s:
                break  # sorted by start: the rest start later still
            self.live += 1
            self.loop.at(ts.start, _TraceSession(self, ts).begin)

    def session_ready(self, sid: str) -> None:
        """A trace session has a context its sub-agents can fork from (or has ended without one)."""
        if sid in self.ready:
            return
        self.ready.add(sid)
        for child in self.waiting_for.pop(sid, []):
            child.begin()

    def _open(self) -> bool:
        return self.loop.now < self.duration_s

    def _next_session(self, sessions: Iterator[SessionPlan]) -> None:
        plan = next(sessions, None) if self._open() else None
        if plan is None:
            self.live -= 1
            return
        self.stats.sessions += 1
        _Session(self, plan, None, lambda: self._next_session(sessions)).next_turn()


class _Session:
    __slots__ = ("agents", "ctx", "i", "on_end", "parent", "plan", "ready", "waiting")

    def __init__(self, agents: Agents, plan: SessionPlan, parent: Context | None, on_end: Callable[[], None]) -> None:
        self.agents = agents
        self.plan = plan
        self.parent = parent  # a sub-agent: its parent's prompt at the fork
        self.on_end = on_end
        self.i = 0
        self.ctx: Context | None = None  # the context after the last response (prompt + output)
        self.ready = agents.loop.now
        self.waiting = 0  # sub-agents still running

    def next_turn(self) -> None:
        a = self.agents
        if self.i >= len(self.plan.turns):
            self.on_end()
            return
        turn = self.plan.turns[self.i]
        planned = self.ready + turn.gap_before_s
        if planned >= a.duration_s:
            self.on_end()
            return
        a.loop.at(planned, self._send, turn)

    def _prompt(self, turn: Turn) -> Context:
        a = self.agents
        b = a.builder
        fresh = turn.reset or turn.compaction or (self.ctx is None and self.parent is None)
        if fresh:
            base = a.system
        elif self.ctx is None:
            assert self.parent is not None
            base = self.parent
        else:
            base = self.ctx
        if len(base) > turn.input_tokens:
            return b.prefix(base, turn.input_tokens)
        return b.extend(base, a._fresh(turn.input_tokens - len(base)))

    def _send(self, turn: Turn) -> None:
        a = self.agents
        if not a._open():
            self.on_end()
            return
        prompt = self._prompt(turn)
        a.send_turn(turn, prompt, lambda c: self._done(turn, c), turn.new_tokens)

    def _done(self, turn: Turn, call: Call) -> None:
        a = self.agents
        if not a.answered(call):
            self.on_end()
            return
        self.ctx = a.builder.extend(call.ctx, call.output)
        self.ready = a.loop.now
        self.i += 1
        # A main session's plan comes without its sub-agents (Agents.start): the fork's are planned now. A sub-agent
        # never forks.
        kids = a.workload.subagents(self.plan, turn) if turn.forks and a._open() else []
        if not kids:
            self.next_turn()
            return
        self.waiting = len(kids)
        for kid in kids:
            a.stats.subagent_sessions += 1
            _Session(a, kid, call.ctx, self._child_ended).next_turn()

    def _child_ended(self) -> None:
        self.waiting -= 1
        if self.waiting == 0:
            self.ready = self.agents.loop.now
            self.next_turn()


class _TraceSession:
    """One session of a replayed trace: its turns at their recorded times, in order."""

    __slots__ = ("agents", "ctx", "i", "ready", "ts")

    def __init__(self, agents: Agents, ts: TraceSession) -> None:
        self.agents = agents
        self.ts = ts
        self.i = 0
        self.ctx: Context | None = None
        self.ready = 0.0

    def begin(self) -> None:
        a = self.agents
        parent = self.ts.parent
        if parent is not None and parent not in a.ready:
            a.waiting_for.setdefault(parent, []).append(self)
            return
        if not a._open():
            self._end()
            return
        if parent is None:
            a.stats.sessions += 1
        else:
            a.stats.subagent_sessions += 1
            self.ctx = a.latest.get(parent)
        self.ready = a.loop.now
        self._next()

    def _next(self) -> None:
        a = self.agents
        if self.i >= len(self.ts.turns):
            self._end()
            return
        tt = self.ts.turns[self.i]
        planned = max(tt.t, self.ready)
        if planned >= a.duration_s:
            self._end()
            return
        a.loop.at(planned, self._send, tt.turn)

    def _send(self, turn: Turn) -> None:
        a = self.agents
        if not a._open():
            self._end()
            return
        b = a.builder
        base = self.ctx
        if base is None or turn.reset or turn.compaction or len(base) > turn.input_tokens:
            base = b.empty  # a new context (or one the previous is not a prefix of)
        new = turn.input_tokens - len(base)
        prompt = b.extend(base, a._fresh(new))
        a.send_turn(turn, prompt, self._done, new)

    def _done(self, call: Call) -> None:
        a = self.agents
        if not a.answered(call):
            self._end()
            return
        a.latest[self.ts.session_id] = call.ctx
        a.session_ready(self.ts.session_id)
        self.ctx = a.builder.extend(call.ctx, call.output)
        self.ready = a.loop.now
        self.i += 1
        self._next()

    def _end(self) -> None:
        self.agents.live -= 1
        self.agents.session_ready(self.ts.session_id)  # children start from whatever there is
