"""KV admission against a real simulated engine: the router never sends a pod more prompt + output tokens than its KV
cache holds (it reads the capacity from vllm:cache_config_info), so the engine never preempts; the same burst sent to
the engine directly does preempt."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
from netutil import run
from routerutil import Servers, engine, pod_of, rconfig

from llmd.router.proxy import Router

BLOCKS = 260  # x 16 tokens: 4,160 tokens of KV (max_model_len 4,096 must fit)
PROMPT_WORDS = 600


async def _burst(http: aiohttp.ClientSession, url: str, n: int) -> list[dict[str, str]]:
    async def one(i: int) -> dict[str, str]:
        body = {"model": "tiny", "prompt": f"agent {i} " + "word " * PROMPT_WORDS, "max_tokens": 400,
                "ignore_eos": True}  # fmt: skip
        async with http.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            await r.read()
            return dict(r.headers)

    return await asyncio.gather(*(one(i) for i in range(n)))


def test_router_holds_requests_the_decode_kv_cannot_take_so_the_engine_never_preempts(model_dir: Path) -> None:
    async def body() -> tuple[int, int, list[float]]:
        async with Servers() as ss:
            direct = await ss.start(engine(model_dir, "direct", num_gpu_blocks=BLOCKS, time_scale=1.0))
            routed = await ss.start(engine(model_dir, "routed", num_gpu_blocks=BLOCKS, time_scale=1.0))
            async with aiohttp.ClientSession() as http:
                await _burst(http, direct.url, 8)  # ~1,000 tokens each at the end: eight overflow 4,160
                async with Router(rconfig(model_dir), [pod_of(routed)]) as router:
                    t0 = time.monotonic()
                    while (
                        not router.registry.healthy() or router.registry.pods["routed"].ranks[0].kv_capacity_blocks == 0
                    ):
                        assert time.monotonic() - t0 < 10, "the router never learned the pod's KV capacity"
                        await asyncio.sleep(0.05)
                    headers = await _burst(http, router.url, 8)
            queued = [float(h["x-llmd-queue-ms"]) for h in headers]
            return (
                direct.ranks[0].core.stats().num_preemptions,
                routed.ranks[0].core.stats().num_preemptions,
                queued,
            )

    direct_preemptions, routed_preemptions, queued = run(body, 60.0)
    assert direct_preemptions > 0  # the burst overflows the cache: the test would catch a router that let it through
    assert routed_preemptions == 0
    assert sum(q > 1.0 for q in queued) >= 2  # some waited in the router for KV to free up


def test_inflight_kv_counts_a_shared_prefix_once() -> None:
    from llmd.router.scheduling.kv_demand import InflightKV, request_kv

    kv = InflightKV()
    parent = list(range(100, 110))  # 10 chained blocks of 16 tokens
    fork_a, fork_b = [*parent, 1, 2], [*parent, 3]
    a, b = request_kv(fork_a, 12 * 16 + 5, 50, 16), request_kv(fork_b, 11 * 16, 20, 16)
    assert a == (16, 55) and b == (16, 20)
    kv.add(fork_a, *a)
    assert kv.tokens == 12 * 16 + 55
    assert kv.shared_tokens(fork_b, 16) == 10 * 16 and kv.shared_tokens([7, *parent], 16) == 0
    kv.add(fork_b, *b)
    assert kv.tokens == 13 * 16 + 55 + 20  # the ten shared blocks once
    kv.remove(fork_a, *a)
    assert kv.tokens == 11 * 16 + 20 and kv.shared_tokens(fork_a, 16) == 10 * 16
    kv.remove(fork_b, *b)
    assert kv.tokens == 0 and kv.shared_tokens(fork_b, 16) == 0
    assert request_kv([], 0, 7) == (0, 7)
    # In whole blocks, as the engine allocates them: the prompt's 5-token tail and 50 output tokens take 4 blocks.
    assert request_kv(fork_a, 12 * 16 + 5, 50, 16, block_size=16) == (16, 64)
    assert request_kv([], 0, 7, block_size=16) == (0, 16)


def test_approximate_router_learns_characters_per_token_from_the_engine(model_dir: Path) -> None:
    async def body() -> tuple[float, float]:
        async with Servers() as ss:
            s = await ss.start(engine(model_dir, "d0", time_scale=0.0))
            async with Router(rconfig(model_dir, policy="approximate"), [pod_of(s)]) as router:
                t0 = time.monotonic()
                while not router.registry.healthy():
                    assert time.monotonic() - t0 < 10
                    await asyncio.sleep(0.05)
                before = router.core.chars_per_token
                async with aiohttp.ClientSession() as http:
                    for i in range(8):
                        prompt = f"agent {i} " + "word " * PROMPT_WORDS
                        body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
                        if i % 2:  # streamed (usage in the last event) and not
                            body.update(stream=True, stream_options={"include_usage": True})
                        async with http.post(router.url + "/v1/completions", json=body) as r:
                            assert r.status == 200
                            await r.read()
                return before, router.core.chars_per_token

    before, after = run(body, 30.0)
    from llmd.tokens import Tokenizer

    text = "agent 3 " + "word " * PROMPT_WORDS
    actual = len(text) / len(Tokenizer(model_dir).encode(text))
    assert before == 4.0
    assert abs(after - actual) < abs(before - actual) / 2, (before, after, actual)
