"""KV identity benchmark: index query latency, KV event throughput and latency, index memory, incremental block
hashing. One run, one core.

Prints `name: value  # target ... (ratio R)` lines, R >= 1 meaning the target is met (value/target where higher is
better, target/value where lower is), and `# name: value` lines for context. `python benchmarks/kv_identity.py`:
~60 s, ~1 GB (the 20M-entry memory figure is measured in a child process of its own).

Scenario (numbers from the llm-d reference's agentic profile):
- index: 64 pods, one DP rank each, 10M distinct blocks in all (64-token blocks, ~3,000-block sessions), built
  through the bulk path (`KVIndex.store`, one call per run of blocks) rather than 10M single events; random 64-bit
  ints stand in for block hashes. Every pod holds the shared 3,000-token system prompt (47 blocks) in GPU.
- query: a 3,000-block session. Its owner holds blocks 0-999 in CPU only and 1000-2999 in GPU and CPU (older blocks
  offloaded), stored turn by turn in 10 separate runs; a neighbour pod holds the first 1,500 in CPU (an earlier copy);
  the other 62 pods only the system prompt. Queries rotate over 64 such sessions, each hashed afresh (new int
  objects, as a router's hasher makes them).
- events: batches of 16 BlockStored events (one engine step: one event per running request that filled blocks,
  extending that request's chain), 1/2/3/4 new blocks per event with probability 40/30/20/10%, 64 token ids per
  block drawn log-uniformly from a 151,936-token vocabulary (Zipf-like: BPE vocabularies give frequent tokens low
  ids), map form as vLLM 0.32 sends it. Applied to the 10M-entry index below its cap (engines report their own
  evictions, so the cap is a safety net); three more passes with the cap binding, where every stored block also
  evicts one (their median: one pass alone swung 0.99-1.37M events/s between runs on this shared machine). Rates are
  per CPU second of this process.
- hashing: a 195,000-token prompt hashed from scratch vs extending it by 632 tokens (the median turn growth) given
  the earlier hashes, llmd.kv.hashing.BlockHasher(block_size=64, algo="sha256"); medians over repeats.
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _report import info, report

from llmd.kv.events import BlockRemoved, BlockStored, KVEventDecoder, encode_batch
from llmd.kv.index import KVIndex

PODS = 64
SYS_BLOCKS = 47
SESSION_BLOCKS = 3000
RUNS_PER_SESSION = 10
BLOCK_SIZE = 64
VOCAB = 151_936
HASHES_PER_EVENT = (1, 2, 3, 4)
HASHES_WEIGHTS = (0.4, 0.3, 0.2, 0.1)
EVENTS_PER_BATCH = 16


def rand_hashes(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, 2**64, size=n, dtype=np.uint64, endpoint=False).tolist()


def build_index(total_blocks: int, rng: np.random.Generator) -> tuple[KVIndex, list[list[int]], list[np.ndarray]]:
    # headroom above the 10M blocks: with engines reporting their own evictions the cap is a safety net, not hit
    ix = KVIndex(max_entries=total_blocks * 5 // 4)
    sys_prompt = rand_hashes(rng, SYS_BLOCKS)
    holders = [(f"pod-{p:02d}", 0) for p in range(PODS)]
    for h in holders:
        ix.store(h, sys_prompt, "GPU")
    per_pod = (total_blocks - SYS_BLOCKS) // PODS
    own = SESSION_BLOCKS - SYS_BLOCKS
    queries: list[list[int]] = []
    olders: list[np.ndarray] = []  # each pod's older blocks, oldest first: what its engine evicts first
    for p, holder in enumerate(holders):
        older = per_pod - own
        kept = []
        while older > 0:  # older sessions: all GPU
            n = min(own, older)
            arr = rng.integers(0, 2**64, size=n, dtype=np.uint64, endpoint=False)
            ix.store(holder, arr.tolist(), "GPU", parent=sys_prompt[-1])
            kept.append(arr)
            older -= n
        olders.append(np.concatenate(kept) if kept else np.zeros(0, dtype=np.uint64))
        # the newest session, queried below: blocks 0-999 CPU only, 1000-2999 GPU and CPU; a neighbour copy in CPU
        session = sys_prompt + rand_hashes(rng, own)
        # stored turn by turn; each turn first grows a branch that goes nowhere (a re-rendered chat template, a
        # dropped reasoning block), so the session lies in RUNS_PER_SESSION separate runs, not one
        parent = sys_prompt[-1]
        for turn in np.array_split(np.arange(SYS_BLOCKS, SESSION_BLOCKS), RUNS_PER_SESSION):
            ix.store(holder, rand_hashes(rng, 1), "CPU", parent=parent)
            ix.store(holder, session[turn[0] : turn[-1] + 1], "CPU", parent=parent)
            parent = session[turn[-1]]
        ix.store(holder, session[1000:], "GPU", parent=session[999])
        ix.store(holders[(p + 1) % PODS], session[:1500], "CPU")
        queries.append(session)
    return ix, queries, olders


def bench_query(ix: KVIndex, queries: list[list[int]], rounds: int) -> list[float]:
    expect = ix.query(queries[0])
    assert len(expect) == PODS, expect[:3]
    assert expect[0].blocks_any == SESSION_BLOCKS and expect[0].blocks_gpu == SESSION_BLOCKS - 1000 + SYS_BLOCKS
    assert expect[1].blocks_any == 1500 and expect[1].blocks_gpu == SYS_BLOCKS
    # A router hashes each request afresh: new int objects, equal to but not the ones the index holds.
    arrays = [np.array(q, dtype=np.uint64) for q in queries]
    times = []
    pc = time.perf_counter
    for _ in range(rounds):
        for arr in arrays:
            q = arr.tolist()
            t = pc()
            ix.query(q)
            times.append((pc() - t) * 1e6)
    return times


def make_payloads(
    n_batches: int, seed: int, block_size: int = BLOCK_SIZE, evict_from: list[list[int]] | None = None
) -> tuple[list[bytes], int]:
    """Batches for pods 0..63 in turn; each of a pod's 16 running requests extends its own chain every step, and a
    finished request (1 in 200 per step) is replaced by a new chain. `evict_from`: per pod, the blocks its engine
    evicts, in order (popped from the end): each stored block comes with a BlockRemoved of one of them."""
    rng = np.random.default_rng(seed)
    n_events = n_batches * EVENTS_PER_BATCH
    ks = rng.choice(HASHES_PER_EVENT, size=n_events, p=HASHES_WEIGHTS).tolist()
    restart = (rng.random(n_events) < 1 / 200).tolist()
    tokens = (np.exp(rng.random(sum(ks) * block_size) * math.log(VOCAB)).astype(np.int64) - 1).tolist()
    hashes = rand_hashes(rng, sum(ks))
    tails: list[list[int | None]] = [[None] * EVENTS_PER_BATCH for _ in range(PODS)]
    payloads = []
    e = pos = 0
    n_removed = 0
    for b in range(n_batches):
        chains = tails[b % PODS]
        evs: list = []
        if evict_from is not None:  # vLLM evicts to make room first, one BlockRemoved per block
            victims = evict_from[b % PODS]
            for _ in range(sum(ks[e : e + EVENTS_PER_BATCH])):
                evs.append(BlockRemoved([victims.pop()], "GPU"))
            n_removed += len(evs)
        for r in range(EVENTS_PER_BATCH):
            k = ks[e]
            if restart[e]:
                chains[r] = None
            hs = hashes[pos : pos + k]
            toks = tokens[pos * block_size : (pos + k) * block_size]
            evs.append(BlockStored(hs, chains[r], toks, block_size, None, "GPU", None))
            chains[r] = hs[-1]
            e += 1
            pos += k
        payloads.append(encode_batch(evs, 1.7e9 + b * 0.01, 0))
    return payloads, n_events + n_removed


def bench_events(
    ix: KVIndex, queries: list[list[int]], olders: list[np.ndarray], n_batches: int, repeats: int, seed: int
) -> dict[str, float]:
    """Rates in events per CPU second of the applying thread (other processes and the query thread don't count)."""
    pods = [f"pod-{p:02d}" for p in range(PODS)]
    rates: dict[str, list[float]] = {k: [] for k in ("decode", "apply", "stored", "mix", "block16", "at_cap")}
    clock = time.thread_time
    apply = ix.apply
    chunk = 64  # decode-only / apply-only alternate per 1,024 events, so applied events are as cache-warm as live
    bytes_per_event = 0.0
    lat: list[int] = []
    qtimes: list[float] = []
    # popped from the end: oldest first; only as many as the passes take, so the harness doesn't hold 10M ints
    need = (n_batches // PODS + 1) * EVENTS_PER_BATCH * len(HASHES_PER_EVENT) * (repeats // 3 + 2)
    victims = [o[:need][::-1].tolist() for o in olders]
    tail = ("latency", "block16", "mix", "at_cap", "at_cap", "at_cap")
    for r in range(repeats + len(tail)):
        # fresh hashes for every pass, so each stores new blocks as a live engine does
        mode = ("split", "stored", "mix")[r % 3] if r < repeats else tail[r - repeats]
        pay, n = make_payloads(
            n_batches,
            seed + r,
            16 if mode == "block16" else BLOCK_SIZE,
            victims if mode in ("mix", "latency") else None,
        )
        if mode == "stored":
            bytes_per_event = sum(map(len, pay)) / n
        dec = KVEventDecoder()
        decode = dec.decode_payload
        gc.collect()
        if mode == "split":
            t_dec = t_app = 0.0
            for c in range(0, len(pay), chunk):
                t = clock()
                batches = [decode(p) for p in pay[c : c + chunk]]
                t_dec += clock() - t
                t = clock()
                for i, b in enumerate(batches, c):
                    apply(pods[i % PODS], b)  # type: ignore[arg-type]
                t_app += clock() - t
            rates["decode"].append(n / t_dec)
            rates["apply"].append(n / t_app)
        elif mode == "latency":  # per batch, decode + apply, in CPU ns of this thread
            tt = time.thread_time_ns
            for i, p in enumerate(pay):
                t0 = tt()
                apply(pods[i % PODS], decode(p))  # type: ignore[arg-type]
                lat.append(tt() - t0)
        else:
            if mode == "at_cap":  # the cap binding: every stored block evicts one, as when engines' removals are lost
                ix.max_entries = len(ix)
                ix.evict_batch = 0
            stop = threading.Event()
            if mode == "mix":
                arrays = [np.array(q, dtype=np.uint64) for q in queries]

                def querier(stop: threading.Event = stop, arrays: list = arrays) -> None:
                    k = 0
                    while not stop.wait(0.002):
                        q = arrays[k % len(arrays)].tolist()
                        t = time.perf_counter()
                        ix.query(q)
                        qtimes.append((time.perf_counter() - t) * 1e6)
                        k += 1

                th = threading.Thread(target=querier, daemon=True)
                th.start()
            t = clock()
            for i, p in enumerate(pay):
                apply(pods[i % PODS], decode(p))  # type: ignore[arg-type]
            rates[mode].append(n / (clock() - t))
            stop.set()
        assert dec.garbage_frames == 0 and dec.bad_events == 0
        del pay
    out = {k: statistics.median(v) for k, v in rates.items()}
    out["bytes_per_event"] = bytes_per_event
    mix_events = EVENTS_PER_BATCH * 2 - EVENTS_PER_BATCH + sum(HASHES_WEIGHTS[i] * (i + 1) for i in range(4)) * 16
    out["lat_p50_us"] = float(np.percentile(lat, 50)) / 1e3
    out["lat_p99_us"] = float(np.percentile(lat, 99)) / 1e3
    out["lat_max_us"] = max(lat) / 1e3
    out["events_per_batch"] = mix_events
    out["q_n"] = len(qtimes)
    out["q_p50"] = float(np.percentile(qtimes, 50)) if qtimes else 0.0
    out["q_p99"] = float(np.percentile(qtimes, 99)) if qtimes else 0.0
    return out


def build_for_memory(entries: int, seed: int) -> None:
    """In a process of its own: store `entries` distinct blocks, print RSS before and peak RSS after (KB)."""
    rng = np.random.default_rng(seed)
    ix = KVIndex(max_entries=entries * 5 // 4)
    sys_prompt = rand_hashes(rng, SYS_BLOCKS)
    holders = [(f"pod-{p:02d}", 0) for p in range(PODS)]
    gc.collect()
    before = _rss_kb()
    for h in holders:
        ix.store(h, sys_prompt, "GPU")
    left = entries - SYS_BLOCKS
    p = 0
    while left > 0:
        n = min(SESSION_BLOCKS, left)
        ix.store(holders[p % PODS], rand_hashes(rng, n), "GPU", parent=sys_prompt[-1])
        left -= n
        p += 1
    assert len(ix) == entries
    peak = _status_kb("VmHWM")  # not ru_maxrss: Linux carries the parent's over fork and exec
    nbytes = ix.nbytes() if hasattr(ix, "nbytes") else 0
    print(f"{before} {peak} {nbytes} {type(ix).__name__}")


def _rss_kb() -> int:
    return _status_kb("VmRSS")


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def bench_memory(entries: int, seed: int) -> tuple[float, float, float, str]:
    out = subprocess.run(
        [sys.executable, __file__, "--memory-child", str(entries), "--seed", str(seed)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    before, peak, nbytes = (int(x) for x in out[:3])
    return (peak - before) * 1024 / entries, peak / 1024, nbytes / entries, out[3]


def bench_hashing(seed: int) -> tuple[float, float]:
    from llmd.kv.hashing import BlockHasher

    rnd = random.Random(seed)
    hasher = BlockHasher(block_size=BLOCK_SIZE, algo="sha256")
    prompt = [rnd.randrange(VOCAB) for _ in range(195_000)]
    extended = prompt + [rnd.randrange(VOCAB) for _ in range(632)]
    pc = time.perf_counter
    scratch = []
    for _ in range(7):
        t = pc()
        base = hasher.hash_tokens(prompt)
        scratch.append(pc() - t)
    incr = []
    for _ in range(101):
        t = pc()
        out = hasher.hash_tokens(extended, prefix=base)
        incr.append(pc() - t)
    assert out == hasher.hash_tokens(extended)
    return statistics.median(scratch), statistics.median(incr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--entries", type=int, default=10_000_000, help="distinct blocks in the index")
    ap.add_argument("--memory-entries", type=int, default=20_000_000, help="entries for the bytes-per-entry figure")
    ap.add_argument("--event-batches", type=int, default=4_000, help="batches of 16 events per timed pass")
    ap.add_argument("--repeats", type=int, default=6, help="timed event passes: split, stored-only, mix in turn")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--events-only", action="store_true", help="skip the 20M-entry memory figure and hashing")
    ap.add_argument("--memory-child", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_child:
        build_for_memory(args.memory_child, args.seed)
        return

    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    gc.disable()  # the index holds no reference cycles; collections over 10M ints only add pauses
    ix, queries, olders = build_index(args.entries, rng)
    build_s = time.perf_counter() - t0
    info("index", f"{len(ix):,} entries, {PODS} pods, built in {build_s:.1f} s ({type(ix).__name__}, bulk path)")
    info("index_rss_mb", f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} (peak RSS so far)")

    times = bench_query(ix, queries, rounds=5)
    report("index_query_us_p50", statistics.median(times), 1000, higher_is_better=False)
    info("index_query_us_p99", f"{np.percentile(times, 99):.1f} over {len(times)} queries of {SESSION_BLOCKS} blocks")

    mix = ", ".join(f"{k}:{w:.0%}" for k, w in zip(HASHES_PER_EVENT, HASHES_WEIGHTS, strict=True))
    info(
        "event_mix",
        f"BlockStored hashes/event {mix}, {BLOCK_SIZE} tokens/block, {EVENTS_PER_BATCH} per batch; vLLM's mix adds "
        "a BlockRemoved of one hash per stored block",
    )
    ev = bench_events(ix, queries, olders, args.event_batches, args.repeats, args.seed + 100)
    info("event_bytes", f"{ev['bytes_per_event']:.0f} msgpack bytes/BlockStored event (map form, vLLM 0.32)")
    report("events_per_s", ev["mix"], 1_000_000, higher_is_better=True, fmt="{:,.0f}")
    info(
        "queries_during_events",
        f"{ev['q_n']} answered meanwhile, p50 {ev['q_p50']:.0f} us, p99 {ev['q_p99']:.0f} us (wall clock)",
    )
    report("events_stored_only_per_s", ev["stored"], 1_000_000, higher_is_better=True, fmt="{:,.0f}")
    report("events_at_cap_per_s", ev["at_cap"], 1_000_000, higher_is_better=True, fmt="{:,.0f}")
    report("apply_p99_us", ev["lat_p99_us"], 50, higher_is_better=False, fmt="{:.1f}")
    info(
        "apply_latency_us",
        f"p50 {ev['lat_p50_us']:.1f}, max {ev['lat_max_us']:.0f} per batch of ~{ev['events_per_batch']:.0f} events "
        "(vLLM's mix, decode + apply)",
    )
    report("events_apply_only_per_s", ev["apply"], 1_000_000, higher_is_better=True, fmt="{:,.0f}")
    info("events_decode_only_per_s", f"{ev['decode']:,.0f} (BlockStored only)")
    info("events_per_s_16_token_blocks", f"{ev['block16']:,.0f} (decode+apply, BlockStored only, 16-token blocks)")
    info("index_after_events", f"{len(ix):,} entries, {ix.evictions:,} evicted")
    del ix, queries, olders
    if args.events_only:
        return
    gc.enable()
    gc.collect()

    per_entry, peak_mb, core_per_entry, impl = bench_memory(args.memory_entries, args.seed)
    report("index_bytes_per_entry", per_entry, 32, higher_is_better=False, fmt="{:.1f}")
    info(
        "index_memory",
        f"{args.memory_entries:,} entries ({impl}): peak RSS {peak_mb:,.0f} MB, arrays {core_per_entry:.1f} B/entry",
    )

    scratch, incr = bench_hashing(args.seed)
    report("incremental_speedup", scratch / incr, 100, higher_is_better=True)
    info("hash_195k_ms", f"{scratch * 1e3:.1f} from scratch, {incr * 1e6:.0f} us to extend by 632 tokens")
    info("total_s", f"{time.perf_counter() - t0:.0f}")
    info("peak_rss_mb", f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}")


if __name__ == "__main__":
    main()
