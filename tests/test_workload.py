"""The workload model: statistics match the reference traffic table, determinism, scales, profiles, trace replay and
prompts with exact token counts that grow by appending."""

from __future__ import annotations

import dataclasses
import json
from itertools import pairwise
from types import SimpleNamespace

import numpy as np
import pytest

from llmd.workload import ALLOWED_PARAMS, Quantiles, Workload, build_profile, profile_from_spec, run_salt
from llmd.workload.prompts import PromptWriter
from llmd.workload.trace import TraceError, read_trace


def _spec(**kw):
    base = dict(profile="smoke", seed=0, duration_s=60.0, concurrency=8, context_scale=1.0, time_scale=1.0, params={})
    return SimpleNamespace(**{**base, **kw})


def _plans(profile, n, seed=0, salt="s"):
    w = Workload(profile, seed, salt)
    return [p for _, p in zip(range(n), w.sessions(), strict=False)]


@pytest.fixture(scope="module")
def trace_stats():
    plans = _plans(build_profile("trace-stats", concurrency=800), 800, seed=7)
    main = [t for p in plans for t in p.turns]
    return plans, main


def plan_cap(profile):
    m = profile.model
    return round(m.max_context * m.context_scale)


def _close(value, target, tol=0.15):
    assert abs(value - target) <= tol * target, (value, target)


def test_quantiles_reproduce_percentiles():
    q = Quantiles(632, 3735, 148_000)
    z = np.array([0.0, 1.2815515655446004, 2.3263478740408408])
    assert np.allclose(q.ppf_z(z), [632, 3735, 148_000])
    x = q.sample(np.random.default_rng(0), 200_000)
    assert np.allclose(np.percentile(x, [50, 90, 99]), [632, 3735, 148_000], rtol=0.05)
    ln = Quantiles.lognormal(1500, 1200)
    assert abs(ln.mean() - 1500) < 15


def test_trace_stats_match_table(trace_stats):
    plans, main = trace_stats
    pct = lambda xs, q: float(np.percentile(xs, q))  # noqa: E731
    inputs = [t.input_tokens for t in main]
    outputs = [t.output_tokens for t in main]
    appended = [t for t in main if t.turn_index and not t.reset and not t.compaction]
    growth = [t.new_tokens for t in appended]
    gaps = [t.gap_before_s for t in main if t.turn_index]
    turns = [len(p.turns) for p in plans]
    for xs, p50, p90 in [
        (inputs, 195_000, 521_000),
        (outputs, 317, 1705),
        (growth, 632, 3735),
        (gaps, 2.0, 24.0),
        (turns, 107, 354),
    ]:
        _close(pct(xs, 50), p50)
        _close(pct(xs, 90), p90)
    _close(float(np.mean([t.reset for t in main])), 0.028, 0.2)
    assert 0 < sum(t.compaction for t in main) < 0.002 * len(main)
    groups = [t.forks for t in main if t.forks]
    assert abs(np.median(groups) - 7) <= 1
    _close(pct(groups, 90), 51, 0.25)
    sub = sum(len(c.turns) for p in plans for c in p.children)
    _close(sub / (sub + len(main)), 40_367 / 78_099, 0.25)


def test_subagents_planned_at_their_fork_are_the_eagerly_planned_children() -> None:
    """The simulator plans a session without its sub-agents and each fork's when it comes: the same plans."""
    w = Workload(build_profile("trace-stats"), seed=3, salt="x")
    eager, lazy = w.agent_sessions(1), w.agent_sessions(1, subagents=False)
    forks = 0
    for _ in range(6):
        plan, bare = next(eager), next(lazy)
        assert not bare.children and bare.turns == plan.turns
        later = [kid for turn in bare.turns if turn.forks for kid in w.subagents(bare, turn)]
        assert later == plan.children
        forks += len(later)
    assert forks > 0


def test_subagents_fork_from_parent_context(trace_stats):
    plans, _ = trace_stats
    plan = next(p for p in plans if p.children)
    for child in plan.children:
        parent_turn = plan.turns[child.parent_turn_index]
        first = child.turns[0]
        assert first.is_subagent and first.parent_session_id == plan.session_id and first.gap_before_s == 0
        if first.reset:  # the parent's context plus the task would exceed max_context
            assert parent_turn.input_tokens + first.new_tokens > plan_cap(build_profile("trace-stats"))
        else:
            assert first.input_tokens == parent_turn.input_tokens + first.new_tokens
    # Appending: each non-reset turn's input is the previous input + output + growth.
    for a, b in pairwise(plan.turns):
        if not (b.reset or b.compaction):
            assert b.input_tokens == a.input_tokens + a.output_tokens + b.new_tokens


def test_determinism_and_independence():
    prof = build_profile("trace-stats", concurrency=4)
    a = _plans(prof, 4, seed=3)
    b = _plans(prof, 4, seed=3)
    assert [p.turns for p in a] == [p.turns for p in b]
    assert [p.turns for p in a] != [p.turns for p in _plans(prof, 4, seed=4)]
    # An agent's sessions do not depend on how many agents run beside it.
    wide = Workload(build_profile("trace-stats", concurrency=16), 3, "s")
    assert next(wide.agent_sessions(1)).turns == a[1].turns
    assert run_salt(0, "r1") != run_salt(0, "r2") and run_salt(0, "r1") == run_salt(0, "r1")


def test_scales():
    base = _plans(build_profile("cybergym"), 3)
    small = _plans(build_profile("cybergym", context_scale=0.01, time_scale=0.5), 3)
    for p, q in zip(base, small, strict=True):
        assert p.turns[0].input_tokens == 94_000 and q.turns[0].input_tokens == 940
        assert len(p.turns) == len(q.turns) == 10
        for t, u in zip(p.turns[1:], q.turns[1:], strict=True):
            assert u.gap_before_s == pytest.approx(t.gap_before_s * 0.5)
    assert build_profile("cybergym").agents == 400


def test_profiles_from_spec():
    w = profile_from_spec(_spec(profile="automationbench", concurrency=12, params={"turns_p50": 5}), run_id="x")
    assert w.profile.agents == 12 and w.profile.sessions_per_agent is None
    assert w.profile.model.turns.p50 == 5
    agentx = profile_from_spec(_spec(profile="agentx", duration_s=900))
    assert agentx.profile.agents == 128 and agentx.profile.duration_s == 900
    first = next(agentx.sessions())
    assert 150_000 <= first.turns[0].input_tokens <= 250_000
    with pytest.raises(ValueError, match=r"allowed: .*agents"):
        profile_from_spec(_spec(params={"bogus": 1}))
    assert "turns_p50" in ALLOWED_PARAMS
    with pytest.raises(ValueError, match="trace"):
        profile_from_spec(_spec(profile="trace", trace_path="x.jsonl"))


def test_smoke_is_small():
    w = profile_from_spec(_spec())
    plans = list(w.sessions())
    assert len(plans) == 4 and all(len(p.turns) == 3 for p in plans)
    turns = [t for p in plans for t in p.all_turns()]
    assert max(t.input_tokens for t in turns) < 1000
    assert sum(len(p.children) for p in plans) == 3
    assert sum(t.gap_before_s for t in plans[0].turns) < 5


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from llmd.models.tiny import make_tiny
    from llmd.tokens import Tokenizer

    return Tokenizer(make_tiny(tmp_path_factory.mktemp("m") / "tiny", weights=False))


def _prompt_turns(w, tok, extra_reset=False):
    pw = PromptWriter(tok, w.salt)
    out = {}
    for plan in w.sessions():
        pts = list(pw.session(plan, w.profile.model.system))
        out[plan.session_id] = pts
        for child in plan.children:
            out[child.session_id] = list(pw.session(child, w.profile.model.system, parent=pts[child.parent_turn_index]))
    return pw, out


def test_prompts_exact_and_append(tok):
    params = {"reset_p": 0.3, "turns": 6}
    w = Workload(build_profile("smoke", params=params), 1, run_salt(1, "a"))
    pw, sessions = _prompt_turns(w, tok)
    resets = 0
    for sid, pts in sessions.items():
        texts = [tok.render_chat(pt.messages) for pt in pts]
        for pt in pts:
            assert pw.count(pt.messages) == pt.turn.input_tokens
            assert len(tok.encode(pt.output_text, add_special_tokens=False)) == pt.turn.output_tokens
        for a, b, pt in zip(texts, texts[1:], pts[1:], strict=False):
            if pt.turn.reset or pt.turn.compaction:
                resets += 1
                assert not b.startswith(a)
            else:
                assert b.startswith(a)
        if "/" in sid:  # a sub-agent starts from its parent's conversation
            parent = sessions[pts[0].turn.parent_session_id][int(sid.split("/t")[1].split(".")[0])]
            assert pts[0].messages[: len(parent.messages)] == parent.messages
    assert resets > 0


def test_prompts_salt_changes_text_not_counts(tok):
    a = Workload(build_profile("smoke"), 0, run_salt(0, "run1"))
    b = Workload(build_profile("smoke"), 0, run_salt(0, "run2"))
    _, sa = _prompt_turns(a, tok)
    _, sb = _prompt_turns(b, tok)
    for sid in sa:
        for x, y in zip(sa[sid], sb[sid], strict=True):
            assert x.turn == y.turn
            assert x.messages[0]["content"] != y.messages[0]["content"]
            assert x.messages[0]["content"].startswith(a.salt)


def test_trace_replay(tmp_path, tok):
    lines = [
        {"session": "m", "t": 0, "input_tokens": 100, "output_tokens": 10},
        {"session": "m", "t": 2.5, "input_tokens": 150, "output_tokens": 5},
        {"session": "c", "parent": "m", "t": 3, "input_text": "hello world", "output_tokens": 3},
        {"session": "c", "parent": "m", "t": 4, "input_text": "hello world again", "output_tokens": 3},
        {"session": "m", "t": 9, "input_tokens": 40, "output_tokens": 5},
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    got = list(read_trace(path, tokenizer=tok, time_scale=2.0))
    assert [g.turn.turn_index for g in got] == [0, 1, 0, 1, 2]
    assert got[1].turn.new_tokens == 40 and got[1].turn.gap_before_s == 5.0
    assert got[2].turn.is_subagent and got[2].input_text == "hello world"
    assert got[2].turn.input_tokens == len(tok.encode("hello world", add_special_tokens=False))
    assert not got[3].turn.reset and got[4].turn.reset
    bad = [
        ('{"session": "m", "t": 0, "output_tokens": 1}', "line 2.*input_text"),
        ('{"session": "m", "t": -1, "input_tokens": 5, "output_tokens": 1}', "line 2.*'t'"),
        ('{"session": "m", "t": 0, "input_tokens": 5, "output_tokens": 0}', "line 2.*output_tokens"),
        ('{"t": 0, "input_tokens": 5, "output_tokens": 1}', "line 2.*session"),
        ("not json", "line 2.*not JSON"),
    ]
    for text, match in bad:
        path.write_text(json.dumps(lines[0]) + "\n" + text + "\n")
        with pytest.raises(TraceError, match=match):
            list(read_trace(path))


def _fresh(turn):
    return (turn.turn_index == 0 and not turn.is_subagent) or turn.reset or turn.compaction


def test_tiny_context_scale_never_below_minimum(tok):
    # context_scale 0.001 puts initial contexts, compaction summaries and sub-agent tasks at or under the planner's
    # floors: every planned size must still hold the chat framing, and the writer must never raise.
    params = {"compaction_p": 0.05, "reset_p": 0.1, "fork_p": 0.05}
    checked = 0
    for seed in range(12):
        w = Workload(build_profile("trace-stats", concurrency=3, context_scale=0.001, params=params), seed, "s")
        pw = PromptWriter(tok, run_salt(seed, "tiny"))
        system = w.profile.model.system
        assert system >= pw.min_system
        for plan in _plans(w.profile, 3, seed=seed):
            pts = list(pw.session(plan, system))
            groups = [(plan, pts)]
            for child in plan.children:
                groups.append((child, list(pw.session(child, system, parent=pts[child.parent_turn_index]))))
            for sub, spts in groups:
                assert len(spts) == len(sub.turns)
                for pt in spts:
                    t = pt.turn
                    if _fresh(t):
                        assert t.input_tokens >= pw.min_context(system), t
                    elif t.turn_index == 0:  # a sub-agent's task appended to its parent's context
                        assert t.new_tokens >= pw.min_fork_task, t
                    else:
                        assert t.new_tokens >= pw.min_step, t
                for pt in spts[:3]:  # the full tokenization is slow: the first turns (fresh, fork, steps)
                    assert pw.count(pt.messages) == pt.turn.input_tokens
                    checked += 1
    assert checked > 100


def test_prompt_writer_clamps_instead_of_raising(tok):
    from llmd.workload.sessions import SessionPlan, Turn

    pw = PromptWriter(tok, run_salt(0, "clamp"))
    turns = [
        Turn("x", 0, None, False, 3, 3, 2, 0.0),  # far below the framing of system + user
        Turn("x", 1, None, False, 9, 1, 2, 1.0),  # a step smaller than its framing
        Turn("x", 2, None, False, 4, 4, 2, 1.0, compaction=True),
    ]
    pts = list(pw.session(SessionPlan("x", 0, 0, turns), system_tokens=1))
    assert pw.count(pts[0].messages) == pw.min_context(1)
    assert pw.count(pts[1].messages) == pw.count(pts[0].messages) + 2 + pw.min_step
    assert pw.count(pts[2].messages) == pw.min_context(1)
    child = [Turn("x/t0.0", 0, "x", True, 5, 0, 1, 0.0)]
    (cpt,) = pw.session(SessionPlan("x/t0.0", 0, 0, child, "x", 0), 1, parent=pts[0])
    assert pw.count(cpt.messages) == pw.count(pts[0].messages) + pw.min_fork_task


def test_subagent_inputs_never_exceed_max_context(tok):
    # The demo's shape: a 4096-token window with contexts scaled to a few thousand tokens and frequent forks.
    params = {"fork_p": 0.2, "max_context": 100_000}
    resets = first_resets = subagents = 0
    for seed in range(10):
        prof = build_profile("trace-stats", concurrency=4, context_scale=0.04, params=params)
        cap = plan_cap(prof)
        assert cap == 4000
        for plan in _plans(prof, 4, seed=seed):
            for sub in plan.walk():
                for t in sub.turns:
                    assert t.input_tokens <= cap, t
                    if t.is_subagent:
                        subagents += 1
                        resets += t.reset
                        first_resets += t.reset and t.turn_index == 0
                        if t.reset:
                            assert t.new_tokens == t.input_tokens
    assert subagents > 100 and resets > 0 and first_resets > 0
    # A capped sub-agent's first turn is a fresh context: the writer builds it without the parent's messages.
    w = Workload(build_profile("trace-stats", concurrency=4, context_scale=0.04, params=params), 0, "s")
    pw = PromptWriter(tok, w.salt)
    plan = next(p for p in w.sessions() if any(c.turns[0].reset for c in p.children))
    child = next(c for c in plan.children if c.turns[0].reset)
    parent = list(pw.session(plan, w.profile.model.system))[child.parent_turn_index]
    first = next(iter(pw.session(child, w.profile.model.system, parent=parent)))
    assert pw.count(first.messages) == first.turn.input_tokens <= 4000
    assert first.messages[0]["role"] == "system" and len(first.messages) == 2


@pytest.mark.parametrize("overflow", ["compact", "reset"])
def test_no_prompt_exceeds_the_model_window(overflow):
    # AgentX's ~195K-token contexts grow past a 262,144-token window within a session: without it in the plan, the
    # simulator sent prompts of up to 587K tokens that vLLM refuses (400). With it, a session compacts (or resets)
    # first, and each such turn is marked so a run can count them.
    window = 262_144
    params = {"overflow": overflow, "fork_p": 0.05}
    grown = _plans(build_profile("agentx", params=params), 32, seed=1)
    assert max(t.input_tokens + t.output_tokens for p in grown for t in p.all_turns()) > window
    prof = profile_from_spec(_spec(profile="agentx", params=params), "x", max_model_len=window).profile
    turns = [t for p in _plans(prof, 32, seed=1) for t in p.all_turns()]
    assert all(t.input_tokens + t.output_tokens <= window for t in turns)
    forced = [t for t in turns if t.overflow]
    assert len(forced) > 10 and any(t.is_subagent for t in forced)
    if overflow == "compact":
        assert all(t.compaction and not t.reset and t.new_tokens == t.input_tokens for t in forced)
        assert all(t.input_tokens < 0.2 * window for t in forced if not t.is_subagent)
    else:
        assert all(t.reset and not t.compaction for t in forced)
    # The same draws: turns before a session's first forced one are as they were without the window.
    before = _plans(build_profile("agentx", params=params), 1, seed=1)[0].turns
    after = _plans(prof, 1, seed=1)[0].turns
    first = next((i for i, t in enumerate(after) if t.overflow), len(after))
    assert before[:first] == [dataclasses.replace(t, overflow=False) for t in after[:first]]
    with pytest.raises(ValueError, match="max_model_len"):
        build_profile("agentx", max_model_len=100)


def test_prompts_fit_a_small_window(tok):
    # The demo's shape (a 4096-token window, contexts scaled to a few thousand tokens, frequent forks): every prompt
    # the writer renders, a sub-agent's compacted first turn included, fits with its max_tokens.
    params = {"fork_p": 0.2, "max_context": 100_000}
    prof = build_profile("trace-stats", concurrency=4, context_scale=0.04, params=params, max_model_len=4096)
    w = Workload(prof, 0, "s")
    pw = PromptWriter(tok, w.salt)
    sys_tokens = prof.model.system
    seen = 0
    for plan in _plans(prof, 4):
        prompts = list(pw.session(plan, sys_tokens))
        for child in plan.children:
            first = next(iter(pw.session(child, sys_tokens, parent=prompts[child.parent_turn_index])))
            if first.turn.overflow:
                seen += 1
                assert first.turn.compaction and first.messages[0]["role"] == "system" and len(first.messages) == 2
            assert pw.count(first.messages) == first.turn.input_tokens
            assert first.turn.input_tokens + first.turn.output_tokens <= 4096
        for p in prompts:
            assert p.turn.input_tokens + p.turn.output_tokens <= 4096
    assert seen > 0
