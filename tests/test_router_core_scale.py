"""The router core on the 544-endpoint deployment (examples/glm52-544gpu.yaml): its decisions are pinned.

A seeded scenario drives RouterCore as the cluster simulator does: agents' requests sharing a system prompt and growing
turn by turn, sub-agents forking a context, the KV index learning where requests went, engines' gauges changing,
requests finishing in a random order, exclusions after failures. Every decision (target, prefill endpoint, reason,
hit tokens, the winning total to the last bit) is compared with a record made by the core before its per-decision
cost was cut (tests/fixtures/router_core_544.json): the snapshot caching and the scheduler's cheaper bookkeeping must
not change a single choice. `python tests/test_router_core_scale.py --record` rewrites the record (only when a change
of decisions is intended).

The core's snapshot is also checked against the definition it implements, recomputed naively, on every decision.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
from pathlib import Path
from typing import Any

from llmd.discovery import PodInfo
from llmd.kv.index import KVIndex
from llmd.router.config import cost_models
from llmd.router.core import Job, QueueFull, RouterCore
from llmd.router.pods import Pod
from llmd.router.scheduling import EndpointState, RouteRequest, Scheduler, Tuning
from llmd.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "tests" / "fixtures" / "router_core_544.json"
BS = 64
N = 400  # submissions per recorded seed


def _core(spec: Any) -> tuple[RouterCore, list[Pod]]:
    models = cost_models(spec)
    # Few slots per rank, so requests also wait for room, for their prefix holder, and P2P moves some off a full one.
    rspec = spec.router.model_copy(update={"max_inflight_per_pod": 3})
    sched = Scheduler(
        rspec, 1, latency=models.get("latency"), prefill_latency=models.get("prefill_latency"), tuning=Tuning()
    )
    core = RouterCore(sched, KVIndex(), max_inflight=3, queue_limit=10_000, now=0.0)
    pods = []
    for role, n, dp, blocks in (("prefill", 10, 16, 4097), ("decode", 3, 128, 13366)):
        for k in range(n):
            name = f"{role}-{k}"
            info = PodInfo(name, role, f"http://{name}:8000", dp, engine_id=name, side_channel_host=name,
                           side_channel_port=5600)  # fmt: skip
            pod = Pod(info, healthy=True)
            for st in pod.ranks:
                st.kv_capacity_blocks = blocks
                st.cpu_capacity_blocks = 39107
            pods.append(pod)
            core.pod_up(pod)
    return core, pods


def _naive_snapshot(core: RouterCore, job: Job, now: float) -> dict[tuple[str, int], EndpointState]:
    """RouterCore.snapshot's definition, computed the slow way: every endpoint from scratch."""
    from llmd.router.scheduling.kv_demand import request_kv

    req = job.req
    hashes = req.block_hashes
    unit, _ = request_kv(hashes, req.num_tokens, req.max_tokens, req.block_size, req.block_size)
    cached = {m.holder: m.blocks_gpu for m in core.index.query(hashes)} if hashes else {}
    out = {}
    for name in sorted({p.info.name for p in core._pods.values()}):
        pod = core._pods[name]
        if name in job.excluded:
            continue
        for r, st in enumerate(pod.ranks):
            ld = core.ledger.load((name, r))
            upto = cached.get((name, r), 0)
            shared = ld.kv.shared_tokens(list(hashes[:upto]), unit) if unit and upto else 0
            out[(name, r)] = EndpointState(
                True, st.waiting, st.running, st.kv_usage, ld.inflight, ld.inflight_tokens, ld.kv.tokens - shared,
                st.kv_capacity_blocks, st.cpu_capacity_blocks,
            )  # fmt: skip
    return out


def scenario(seed: int, decisions: int, check: bool = False) -> list[list[Any]]:
    """Drives a core through `decisions` submissions; returns what each decision chose."""
    rng = random.Random(seed)
    spec = load_spec(ROOT / "examples" / "glm52-544gpu.yaml")
    core, pods = _core(spec)
    system = [rng.getrandbits(64) for _ in range(46)]  # a 3,000-token system prompt: every engine has it cached
    holders = [(p.info.name, r) for p in pods for r in range(p.info.dp_size)]
    for h in holders:
        core.index.store(h, system[: rng.randrange(30, 47)])
    sessions: list[list[int]] = []
    flights: list[Job] = []
    log: list[list[Any]] = []
    now = 0.0
    seq = 0

    def record(jobs: list[Job]) -> None:
        for j in jobs:
            if j.flight is None:
                log.append([j.req.request_id, "error", str(j.error)])
                continue
            d = j.flight.decision
            total = d.scores[d.target].total if d.scores else None
            pre = d.pd.prefill.name if d.pd else ""
            src = d.p2p_source.name if d.p2p_source else ""
            log.append([j.req.request_id, d.target.name, pre, src, d.reason, d.pd_reason, d.expected_hit_tokens,
                        d.gpu_hit_tokens, d.wait_s, total.hex() if total is not None else None])  # fmt: skip
            flights.append(j)
            # The engines report what the routed request left cached (as the simulator's KV events do).
            core.index.store(d.target.holder, list(j.req.block_hashes))
            if d.pd:
                core.index.store(d.pd.prefill.holder, list(j.req.block_hashes))

    while seq < decisions:
        now += rng.expovariate(200.0)
        r = rng.random()
        if r < 0.1 and core.queue.waiting:
            record(core.pump(now))  # a wakeup: a request waiting for its prefix holder may stop waiting
            continue
        if r < 0.15 and flights:
            j = flights.pop(rng.randrange(len(flights)))
            assert j.flight is not None
            if rng.random() < 0.05:
                out = core.fail(j, "test", False, now)
                record(out.admitted)
                if out.retry:
                    with contextlib.suppress(QueueFull):
                        record(core.submit(j, now))
            else:
                record(core.complete(j.flight, now))
            continue
        if r < 0.2:
            for p in rng.sample(pods, 3):  # a scrape
                for st in p.ranks:
                    st.waiting = rng.choice((0, 0, 0, 1, 3, 20))
                    st.running = rng.randrange(0, 64)
                    st.kv_usage = rng.random()
            continue
        if r < 0.25 and sessions:  # a sub-agent forks a context
            chain = rng.choice(sessions)[: rng.randrange(46, 200)] + [rng.getrandbits(64) for _ in range(5)]
        elif r < 0.3 and sessions:  # a request again (a retry from the client): all but its last block cached
            chain = rng.choice(sessions)
        elif r < 0.6 and sessions:  # the next turn of a session
            k = rng.randrange(len(sessions))
            chain = sessions[k] = sessions[k] + [rng.getrandbits(64) for _ in range(rng.randrange(1, 60))]
        else:
            chain = system + [rng.getrandbits(64) for _ in range(rng.randrange(1, 400))]
            sessions.append(chain)
        seq += 1
        req = RouteRequest(f"q{seq}", tuple(chain), len(chain) * BS + rng.randrange(BS), BS, f"s{len(sessions)}",
                           max_tokens=rng.choice((1, 300, 2000)))  # fmt: skip
        job = Job(req, req.session_id or "")
        if check:
            want = _naive_snapshot(core, job, now)
            kv = (req.block_hashes, BS, 0)
            cached = {m.holder: m.blocks_gpu for m in core.index.query(req.block_hashes)}
            got = core.snapshot(job.excluded, kv, cached, now)
            assert {ep.holder: st for ep, st in got.states.items()} == want
        try:
            record(core.submit(job, now))
        except QueueFull:
            log.append([req.request_id, "queue-full"])
    return log


def test_decisions_on_the_544_endpoint_fleet_are_the_recorded_ones() -> None:
    want = json.loads(RECORD.read_text())
    for seed, rows in want.items():
        assert scenario(int(seed), N) == rows


def test_the_snapshot_is_what_its_definition_says() -> None:
    scenario(7, 120, check=True)


if __name__ == "__main__" and "--record" in sys.argv:
    runs = {str(s): scenario(s, N) for s in (1, 2)}
    body = ",\n".join(f"{json.dumps(k)}: [\n" + ",\n".join(map(json.dumps, rows)) + "\n]" for k, rows in runs.items())
    RECORD.write_text("{\n" + body + "\n}\n")  # a row a line: a changed decision shows as one line in a diff
