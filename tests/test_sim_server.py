"""The simulated engine server over real HTTP and real ZMQ on 127.0.0.1: vLLM's wire format, KV events with replay,
DP ranks, P/D pulls over the side channel, metrics, error bodies and fault injection."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio
from netutil import free_ports, run

from llmd.engines.sim.core import SimEngineConfig
from llmd.engines.sim.runner import FaultConfig
from llmd.engines.sim.server import SimEngineGroup, SimServer
from llmd.engines.sim.server_config import SimServerConfig, default_latency
from llmd.engines.sim.tokenizer import SimTokenizer
from llmd.kv.events import BlockStored, KVEventDecoder, is_replay_end, replay_request
from llmd.kv.hashing import BlockHasher

BS = 16
MAX_LEN = 512
PROMPT = "The quick brown fox jumps over the lazy dog. " * 8  # a few full blocks


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> SimTokenizer:
    return SimTokenizer(model_dir)


def config(model_dir: Path, **kw: Any) -> SimServerConfig:
    engine_kw = {k: kw.pop(k) for k in list(kw) if k in SimEngineConfig.__dataclass_fields__}
    engine = SimEngineConfig(block_size=BS, num_gpu_blocks=256, max_model_len=MAX_LEN, **engine_kw)
    kw.setdefault("side_channel_port", 0)
    kw.setdefault("served_name", "tiny")
    return SimServerConfig(str(model_dir), engine=engine, **kw)


async def post(http: aiohttp.ClientSession, url: str, body: Any, **kw: Any) -> tuple[int, Any]:
    async with http.post(url, json=body, **kw) as r:
        text = await r.text()
        return r.status, (json.loads(text) if text else None)


async def sse_events(http: aiohttp.ClientSession, url: str, body: Any, **kw: Any) -> list[Any]:
    """The stream's data payloads, [DONE] included as the string."""
    out: list[Any] = []
    async with http.post(url, json=body, **kw) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = await r.text()
    for block in raw.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: ")
        data = block[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def metric(http: aiohttp.ClientSession, url: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, _, value = line.rpartition(" ")
        sname, _, lab = series.partition("{")
        if sname != name:
            continue
        if all(f'{k}="{v}"' in lab for k, v in labels.items()):
            total += float(value)
            found = True
    assert found, f"{name}{labels} not in /metrics"
    return total


# ---- completions and chat ------------------------------------------------------------------------------------------


def test_completions_usage_and_cached_tokens(model_dir: Path, tok: SimTokenizer) -> None:
    async def body() -> None:
        async with SimServer(config(model_dir)) as s, aiohttp.ClientSession() as http:
            url = s.url + "/v1/completions"
            st, r1 = await post(http, url, {"model": "tiny", "prompt": PROMPT, "max_tokens": 5})
            assert st == 200
            assert r1["id"].startswith("cmpl-") and r1["object"] == "text_completion" and r1["model"] == "tiny"
            assert list(r1) == ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint",
                                "usage", "kv_transfer_params", "ec_transfer_params", "metrics"]  # fmt: skip
            (c,) = r1["choices"]
            assert c["index"] == 0 and c["finish_reason"] == "length" and c["stop_reason"] is None
            assert isinstance(c["text"], str) and c["logprobs"] is None
            n_prompt = len(tok.encode(PROMPT))
            assert r1["usage"]["prompt_tokens"] == n_prompt
            assert r1["usage"]["completion_tokens"] == 5 and r1["usage"]["total_tokens"] == n_prompt + 5
            assert r1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            # Same prefix again: every full block but the one holding the last prompt token comes from the cache.
            st, r2 = await post(http, url, {"prompt": PROMPT + " and more", "max_tokens": 2, "return_token_ids": True})
            assert st == 200
            cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == n_prompt // BS * BS and cached > 0
            assert r2["choices"][0]["prompt_token_ids"] == tok.encode(PROMPT + " and more")
            assert len(r2["choices"][0]["token_ids"]) == 2
            # Token-id prompts and batches of prompts.
            ids = tok.encode("hello there")
            st, r3 = await post(http, url, {"prompt": ids, "max_tokens": 3, "ignore_eos": True, "temperature": 0})
            assert st == 200 and r3["usage"]["prompt_tokens"] == len(ids)
            st, r4 = await post(http, url, {"prompt": ["one", "two words"], "max_tokens": 2})
            assert st == 200 and [c["index"] for c in r4["choices"]] == [0, 1]
            assert r4["usage"]["completion_tokens"] == 4
            # Streaming with usage.
            events = await sse_events(
                http,
                url,
                {"prompt": PROMPT, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}},
            )
            assert events[-1] == "[DONE]"
            chunks, usage = events[:-2], events[-2]
            assert len(chunks) == 4 and all(ch["choices"][0]["text"] is not None for ch in chunks)
            assert [ch["choices"][0]["finish_reason"] for ch in chunks] == [None, None, None, "length"]
            assert len({ch["id"] for ch in events[:-1]}) == 1
            assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
            assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": n_prompt // BS * BS}
            assert "system_fingerprint" in usage and "system_fingerprint" not in chunks[-1]

    run(body)


def test_truncate_prompt_tokens_keeps_the_last_tokens_as_vllm(model_dir: Path, tok: SimTokenizer) -> None:
    async def body() -> None:
        async with SimServer(config(model_dir)) as s, aiohttp.ClientSession() as http:
            url = s.url + "/v1/completions"
            ids = tok.encode(PROMPT)
            for prompt in (PROMPT, ids):  # text is tokenized first, then truncated like ids
                req = {"prompt": prompt, "max_tokens": 1, "truncate_prompt_tokens": 7, "return_token_ids": True}
                st, r = await post(http, url, req)
                assert st == 200, r
                assert r["usage"]["prompt_tokens"] == 7
                assert r["choices"][0]["prompt_token_ids"] == ids[-7:]
            # More than the prompt holds, or -1 (max_model_len less one): the prompt stays whole.
            for keep in (len(ids) + 5, -1):
                st, r = await post(http, url, {"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": keep})
                assert st == 200 and r["usage"]["prompt_tokens"] == len(ids)

    run(body)


def test_chat_streaming_and_not(model_dir: Path, tok: SimTokenizer) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]

    async def body() -> None:
        async with SimServer(config(model_dir)) as s, aiohttp.ClientSession() as http:
            url = s.url + "/v1/chat/completions"
            st, r = await post(http, url, {"messages": messages, "max_tokens": 3, "return_token_ids": True})
            assert st == 200
            assert r["id"].startswith("chatcmpl-") and r["object"] == "chat.completion"
            msg = r["choices"][0]["message"]
            assert msg["role"] == "assistant" and isinstance(msg["content"], str) and "tool_calls" not in msg
            assert r["prompt_token_ids"] == tok.chat_token_ids(messages)
            assert r["usage"]["prompt_tokens"] == len(tok.chat_token_ids(messages))
            events = await sse_events(http, url, {"messages": messages, "max_completion_tokens": 3, "stream": True})
            assert events[-1] == "[DONE]"
            role, *content = events[:-1]
            assert role["object"] == "chat.completion.chunk"
            assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert len(content) == 3 and content[-1]["choices"][0]["finish_reason"] == "length"
            assert all(set(c["choices"][0]["delta"]) == {"content"} for c in content)
            # max_tokens defaults to what is left of the context for chat.
            st, r = await post(http, url, {"messages": messages, "max_tokens": 1, "n": 2})
            assert st == 200 and len(r["choices"]) == 2 and r["usage"]["completion_tokens"] == 2

    run(body)


def test_tokenize_and_detokenize(model_dir: Path, tok: SimTokenizer) -> None:
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi!"}]

    async def body() -> None:
        async with SimServer(config(model_dir)) as s, aiohttp.ClientSession() as http:
            st, r = await post(http, s.url + "/tokenize", {"prompt": PROMPT})
            assert st == 200 and r == {
                "count": len(tok.encode(PROMPT)),
                "max_model_len": MAX_LEN,
                "tokens": tok.encode(PROMPT),
                "token_strs": None,
            }
            st, r = await post(http, s.url + "/tokenize", {"messages": messages})
            assert st == 200 and r["tokens"] == tok.chat_token_ids(messages)
            st, r2 = await post(http, s.url + "/tokenize", {"messages": messages, "add_generation_prompt": False})
            assert r2["count"] < r["count"]
            st, r = await post(http, s.url + "/detokenize", {"tokens": tok.encode(PROMPT)})
            assert st == 200 and r == {"prompt": PROMPT}
            async with http.get(s.url + "/v1/models") as resp:
                models = await resp.json()
            (card,) = models["data"]
            assert card["id"] == "tiny" and card["object"] == "model" and card["max_model_len"] == MAX_LEN
            async with http.get(s.url + "/health") as resp:
                assert resp.status == 200 and await resp.read() == b""

    run(body)


CONVERSATIONS = [
    [{"role": "user", "content": "hello there"}],
    [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "def f(x):\n    return x * 2\n\nWhat does f do?"},
        {"role": "assistant", "content": "It doubles x."},
        {"role": "user", "content": "ünïcödé 🎉 and tabs\tok?"},
    ],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "  spaced  "}],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(model_dir: Path, tok: SimTokenizer, add_generation_prompt: bool) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    for conv in CONVERSATIONS:
        want = hf.apply_chat_template(
            conv, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
        )
        assert tok.chat_token_ids(conv, add_generation_prompt=add_generation_prompt) == list(want)
    conv = CONVERSATIONS[1][:3]
    want_text = hf.apply_chat_template(conv, tokenize=False, continue_final_message=True)
    assert tok.render_chat(conv, add_generation_prompt=False, continue_final_message=True) == want_text


# ---- metrics -------------------------------------------------------------------------------------------------------

METRIC_NAMES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:request_queue_time_seconds_count",
    "vllm:prompt_tokens_by_source_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:nixl_xfer_time_seconds_count",
    "vllm:nixl_bytes_transferred_sum",
]


def test_metrics_names_and_values(model_dir: Path, tok: SimTokenizer) -> None:
    async def body() -> None:
        async with SimServer(config(model_dir)) as s, aiohttp.ClientSession() as http:
            for name in METRIC_NAMES:
                await metric(http, s.url, name, model_name="tiny", engine="0")
            assert await metric(http, s.url, "vllm:prompt_tokens_total") == 0
            for _ in range(2):
                st, _ = await post(http, s.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
                assert st == 200
            n = len(tok.encode(PROMPT))
            assert await metric(http, s.url, "vllm:prompt_tokens_total", engine="0") == 2 * n
            assert await metric(http, s.url, "vllm:generation_tokens_total") == 6
            assert await metric(http, s.url, "vllm:request_success_total", finished_reason="length") == 2
            assert await metric(http, s.url, "vllm:prefix_cache_queries_total") == 2 * n
            assert await metric(http, s.url, "vllm:prefix_cache_hits_total") == n // BS * BS
            assert await metric(http, s.url, "vllm:time_to_first_token_seconds_count") == 2
            assert await metric(http, s.url, "vllm:inter_token_latency_seconds_count") == 4
            assert await metric(http, s.url, "vllm:e2e_request_latency_seconds_count") == 2
            assert (
                await metric(http, s.url, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
                == n // BS * BS
            )
            assert await metric(http, s.url, "vllm:num_requests_running") == 0

    run(body)


def test_metric_families_follow_the_engine_config(model_dir: Path) -> None:
    """vllm:cache_config_info carries the cache config as labels; NIXL families exist only with a KV connector; the
    MFU counters move only under --enable-mfu-metrics, as in vLLM."""

    async def body() -> None:
        plain = SimServer(config(model_dir, kv_transfer=False))
        mfu = SimServer(config(model_dir, enable_mfu_metrics=True, latency=default_latency()))
        async with plain, mfu, aiohttp.ClientSession() as http:
            async with http.get(plain.url + "/metrics") as r:
                text = await r.text()
            assert "vllm:nixl_" not in text and "vllm:num_requests_kv_fetch_by_stage" not in text
            info = await metric(http, plain.url, "vllm:cache_config_info", block_size=str(BS), num_gpu_blocks="256")
            assert info == 1
            await metric(http, plain.url, "vllm:cache_config_info", enable_prefix_caching="True", engine="0")
            assert await metric(http, plain.url, "vllm:engine_sleep_state", sleep_state="awake") == 1
            assert await metric(http, plain.url, "vllm:num_requests_waiting_by_reason", reason="capacity") == 0
            assert await metric(http, plain.url, "vllm:admission_rejections_total") == 0
            for s in (plain, mfu):
                st, _ = await post(http, s.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
                assert st == 200
            assert await metric(http, plain.url, "vllm:estimated_flops_per_gpu_total") == 0
            assert await metric(http, mfu.url, "vllm:estimated_flops_per_gpu_total") > 0
            assert await metric(http, mfu.url, "vllm:estimated_read_bytes_per_gpu_total") > 0
            assert await metric(http, mfu.url, "vllm:estimated_write_bytes_per_gpu_total") > 0
            await metric(http, mfu.url, "vllm:nixl_xfer_time_seconds_count")  # a connector: its families are there
            await metric(http, mfu.url, "vllm:num_requests_kv_fetch_by_stage", stage="in_progress")
            assert await metric(http, plain.url, "http_requests_total", handler="/v1/completions", status="2xx") == 1

    run(body)


# ---- KV events -----------------------------------------------------------------------------------------------------


async def recv_batches(sub: zmq.asyncio.Socket, decoder: KVEventDecoder, want: int, timeout: float = 5.0) -> list:
    out = []
    async with asyncio.timeout(timeout):
        while len(out) < want:
            b = decoder.decode_frames(await sub.recv_multipart())
            if b is not None:
                out.append(b)
    return out


def test_kv_events_hashes_and_replay(model_dir: Path, tok: SimTokenizer) -> None:
    port = free_ports(2)

    async def body() -> None:
        cfg = config(model_dir, kv_events_endpoint=f"tcp://*:{port}", kv_events_replay_endpoint=f"tcp://*:{port + 1}")
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            async with SimServer(cfg) as s, aiohttp.ClientSession() as http:
                sub.connect(f"tcp://127.0.0.1:{port}")
                await asyncio.sleep(0.2)  # slow joiner: let the subscription reach the publisher
                decoder = KVEventDecoder(token_ids=True)
                st, _ = await post(http, s.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
                assert st == 200
                (first,) = await recv_batches(sub, decoder, 1)
                assert first.seq == 0 and first.batch.data_parallel_rank == 0
                stored = [e for e in first.batch.events if isinstance(e, BlockStored)]
                ids = tok.encode(PROMPT)
                want = BlockHasher(BS).event_hashes(ids)
                assert [h for e in stored for h in e.block_hashes] == want
                assert stored[0].parent_block_hash is None and stored[0].medium == "GPU"
                assert [t for e in stored for t in e.token_ids] == ids[: len(want) * BS]
                # Miss a message: unsubscribe, publish, then ask the replay socket for everything from seq 0.
                sub.setsockopt(zmq.UNSUBSCRIBE, b"")
                salt = {"prompt": "Another prompt, different blocks entirely! " * 4, "max_tokens": 1}
                st, _ = await post(http, s.url + "/v1/completions", salt)
                assert st == 200
                dealer = ctx.socket(zmq.DEALER)
                dealer.connect(f"tcp://127.0.0.1:{port + 1}")
                await dealer.send_multipart(replay_request(0))
                replayed = []
                async with asyncio.timeout(5):
                    while True:
                        frames = await dealer.recv_multipart()
                        if is_replay_end(frames):
                            break
                        replayed.append(decoder.decode_frames(frames))
                dealer.close(linger=0)
                assert [b.seq for b in replayed] == [0, 1]
                assert replayed[0].batch.events == first.batch.events
                second = [h for e in replayed[1].batch.events if isinstance(e, BlockStored) for h in e.block_hashes]
                assert second == BlockHasher(BS).event_hashes(tok.encode(salt["prompt"]))
        finally:
            sub.close(linger=0)
            ctx.term()

    run(body)


def test_dp_rank_header_routes_to_that_rank(model_dir: Path) -> None:
    port = free_ports(2)

    async def body() -> None:
        cfg = config(model_dir, dp_size=2, kv_events_endpoint=f"tcp://*:{port}")
        ctx = zmq.asyncio.Context()
        subs = []
        try:
            async with SimServer(cfg) as s, aiohttp.ClientSession() as http:
                for r in range(2):
                    sub = ctx.socket(zmq.SUB)
                    sub.setsockopt(zmq.SUBSCRIBE, b"")
                    sub.connect(f"tcp://127.0.0.1:{port + r}")
                    subs.append(sub)
                await asyncio.sleep(0.2)
                async with http.get(s.url + "/kv_event_sources") as resp:
                    sources = await resp.json()
                assert sources["1"]["endpoint"] == f"tcp://*:{port + 1}"
                for _ in range(2):
                    st, _ = await post(
                        http,
                        s.url + "/v1/completions",
                        {"prompt": PROMPT, "max_tokens": 2},
                        headers={"X-data-parallel-rank": "1"},
                    )
                    assert st == 200
                (batch,) = await recv_batches(subs[1], KVEventDecoder(), 1)
                assert batch.batch.data_parallel_rank == 1 and batch.seq == 0
                assert (
                    await metric(http, s.url, "vllm:request_success_total", engine="1", finished_reason="length") == 2
                )
                assert (
                    await metric(http, s.url, "vllm:request_success_total", engine="0", finished_reason="length") == 0
                )
                # The second request hit rank 1's cache; rank 0 never saw the prompt.
                assert await metric(http, s.url, "vllm:prefix_cache_hits_total", engine="1") > 0
                assert await subs[0].poll(100) == 0
                st, err = await post(
                    http, s.url + "/v1/completions", {"prompt": "x"}, headers={"X-data-parallel-rank": "2"}
                )
                assert st == 400 and "out of range [0, 2)" in err["error"]["message"]
                # Without the header, internal balancing spreads concurrent requests over both ranks.
                await asyncio.gather(
                    *(post(http, s.url + "/v1/completions", {"prompt": f"p{i}", "max_tokens": 8}) for i in range(4))
                )
                assert (
                    await metric(http, s.url, "vllm:request_success_total", engine="0", finished_reason="length") >= 1
                )
        finally:
            for sub in subs:
                sub.close(linger=0)
            ctx.term()

    run(body)


# ---- P/D -----------------------------------------------------------------------------------------------------------

PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def test_pd_two_hop_pulls_over_the_side_channel(model_dir: Path, tok: SimTokenizer) -> None:
    port = free_ports(1)

    async def body() -> None:
        cfgs = [
            config(model_dir, role="prefill", name="p"),
            config(model_dir, role="decode", name="d", kv_events_endpoint=f"tcp://*:{port}"),
        ]
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            async with SimEngineGroup(cfgs) as g, aiohttp.ClientSession() as http:
                prefill, decode = g.urls
                sub.connect(f"tcp://127.0.0.1:{port}")
                await asyncio.sleep(0.2)
                body1 = {"prompt": PROMPT, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS}
                st, r1 = await post(http, prefill + "/v1/completions", body1)
                assert st == 200
                kv = r1["kv_transfer_params"]
                assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
                assert kv["remote_engine_id"] == g[0].engine_id and kv["remote_port"] == g[0].side_channels[0].port
                assert kv["remote_host"] == "127.0.0.1" and kv["remote_block_ids"][0]
                st, r2 = await post(
                    http, decode + "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": kv}
                )
                assert st == 200 and r2["usage"]["completion_tokens"] == 4
                n = len(tok.encode(PROMPT))
                # The decode engine computed (at most) the last prompt token; the rest came over the side channel.
                local = await metric(http, decode, "vllm:prompt_tokens_by_source_total", source="local_compute")
                ext = await metric(http, decode, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
                assert local <= 1 and ext >= n - 1
                assert await metric(http, decode, "vllm:nixl_xfer_time_seconds_count") == 1
                assert await metric(http, decode, "vllm:nixl_bytes_transferred_sum") > 0
                assert await metric(http, decode, "vllm:external_prefix_cache_hits_total") > 0
                # The lease was released by the pull: the prefill holds no request blocks any more.
                assert g[0].ranks[0].core.leases == {}
                # The decode engine announced the pulled blocks.
                batches = await recv_batches(sub, KVEventDecoder(), 1)
                hashes = [
                    h for b in batches for e in b.batch.events if isinstance(e, BlockStored) for h in e.block_hashes
                ]
                assert hashes[: n // BS] == BlockHasher(BS).event_hashes(tok.encode(PROMPT))
        finally:
            sub.close(linger=0)
            ctx.term()

    run(body)


def test_p2p_pull_of_a_cached_prefix_from_a_peer(model_dir: Path, tok: SimTokenizer) -> None:
    async def body() -> None:
        async with SimEngineGroup([config(model_dir), config(model_dir)]) as g, aiohttp.ClientSession() as http:
            peer, me = g.urls
            st, _ = await post(http, peer + "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
            assert st == 200
            n = len(tok.encode(PROMPT))
            # No remote_request_id: the peer is asked by block hash for what its prefix cache holds.
            kv = {
                "do_remote_prefill": True,
                "remote_engine_id": g[0].engine_id,
                "remote_host": "127.0.0.1",
                "remote_port": g[0].side_channels[0].port,
                "remote_num_tokens": n,
            }
            prompt = PROMPT + " and a new question"
            st, r = await post(
                http, me + "/v1/completions", {"prompt": prompt, "max_tokens": 2, "kv_transfer_params": kv}
            )
            assert st == 200 and r["usage"]["prompt_tokens_details"]["cached_tokens"] == n // BS * BS
            ext = await metric(http, me, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
            local = await metric(http, me, "vllm:prompt_tokens_by_source_total", source="local_compute")
            assert ext == n // BS * BS and local == len(tok.encode(prompt)) - ext

    run(body)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_pull_policy(model_dir: Path, tok: SimTokenizer, policy: str) -> None:
    dead = free_ports(1)  # nobody listens there

    async def body() -> None:
        cfg = config(model_dir, pull_failure_policy=policy, pull_timeout_s=2.0)
        kv = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "gone",
            "remote_block_ids": [[1, 2, 3]],
            "remote_request_id": "cmpl-gone-0",
            "remote_host": "127.0.0.1",
            "remote_port": dead,
            "tp_size": 1,
        }
        async with SimServer(cfg) as s, aiohttp.ClientSession() as http:
            st, r = await post(
                http, s.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": kv}
            )
            assert await metric(http, s.url, "vllm:nixl_num_failed_transfers_total") == 1
            if policy == "fail":
                assert st == 500
                assert r == {
                    "error": {
                        "message": "Internal server error",
                        "type": "InternalServerError",
                        "param": None,
                        "code": 500,
                    }
                }
                assert await metric(http, s.url, "vllm:request_success_total", finished_reason="error") == 1
                # Streaming: the failure arrives as an error event inside the 200 stream, then [DONE].
                body = {"prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": kv, "stream": True}
                events = await sse_events(http, s.url + "/v1/completions", body)
                assert events == [r, "[DONE]"]
            else:
                assert st == 200 and r["usage"]["completion_tokens"] == 2
                local = await metric(http, s.url, "vllm:prompt_tokens_by_source_total", source="local_compute")
                assert local == len(tok.encode(PROMPT))

    run(body)


# ---- errors and faults ---------------------------------------------------------------------------------------------


def test_error_bodies_and_codes(model_dir: Path) -> None:
    async def body() -> None:
        async with SimServer(config(model_dir)) as s, aiohttp.ClientSession() as http:
            url = s.url + "/v1/completions"
            async with http.post(url, data=b"{not json", headers={"Content-Type": "application/json"}) as r:
                err = await r.json()
                assert r.status == 400 and err["error"]["type"] == "Bad Request" and err["error"]["code"] == 400
                assert "JSON decode error" in err["error"]["message"] and err["error"]["param"] == "body.1"
            async with http.post(url, data=b"prompt=x", headers={"Content-Type": "text/plain"}) as r:
                err = await r.json()
                assert r.status == 400 and "Unsupported Media Type" in err["error"]["message"]
            st, err = await post(http, url, {"max_tokens": 3})
            assert st == 400 and err == {
                "error": {
                    "message": "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
                    "type": "BadRequestError",
                    "param": "prompt",
                    "code": 400,
                }
            }
            st, err = await post(http, s.url + "/v1/chat/completions", {"model": "tiny"})
            assert st == 400 and err["error"]["param"] == "body.messages"
            assert err["error"]["message"].startswith(
                "1 validation error:\n  {'type': 'missing', 'loc': 'body.messages'"
            )
            st, err = await post(http, url, {"prompt": "word " * (MAX_LEN + 10)})
            assert st == 400 and err["error"]["param"] == "input_tokens"
            assert err["error"]["message"].startswith(f"This model's maximum context length is {MAX_LEN} tokens.")
            # vLLM's renderer only knows "at least" when the count is max_model_len + 1 (its tokenizing cap).
            st, err = await post(http, url, {"prompt": list(range(MAX_LEN + 1))})
            assert st == 400 and f"contains at least {MAX_LEN + 1} input tokens" in err["error"]["message"]
            st, err = await post(http, url, {"prompt": list(range(MAX_LEN + 2))})
            assert st == 400 and f"contains {MAX_LEN + 2} input tokens" in err["error"]["message"]
            st, err = await post(http, url, {"prompt": "x", "max_tokens": MAX_LEN + 1})
            assert st == 400 and err["error"]["param"] == "max_tokens"
            st, err = await post(http, url, {"model": "gpt-5", "prompt": "x"})
            assert st == 404 and err == {
                "error": {
                    "message": "The model `gpt-5` does not exist. Valid aliases: tiny.",
                    "type": "NotFoundError",
                    "param": "model",
                    "code": 404,
                }
            }
            st, err = await post(http, url, {"prompt": "x", "temperature": 3})
            assert st == 400 and err["error"]["param"] == "temperature"
            async with http.get(s.url + "/nope") as r:
                assert r.status == 404 and await r.json() == {"detail": "Not Found"}  # Starlette's, not vLLM's

    run(body)


def test_fault_failure_rate_and_slow_start(model_dir: Path) -> None:
    async def body() -> None:
        cfgs = [
            config(model_dir, faults=FaultConfig(failure_rate=1.0)),
            config(model_dir, faults=FaultConfig(slow_start_s=0.5)),
        ]
        async with SimEngineGroup(cfgs) as g, aiohttp.ClientSession() as http:
            failing, slow = g.urls
            st, err = await post(http, failing + "/v1/completions", {"prompt": "x", "max_tokens": 1})
            assert st == 500 and err["error"]["type"] == "InternalServerError" and err["error"]["code"] == 500
            async with http.get(slow + "/health") as r:
                assert r.status == 503
            st, _ = await post(http, slow + "/v1/completions", {"prompt": "x", "max_tokens": 1})
            assert st == 503
            await asyncio.sleep(0.6)
            async with http.get(slow + "/health") as r:
                assert r.status == 200
            st, _ = await post(http, slow + "/v1/completions", {"prompt": "x", "max_tokens": 1})
            assert st == 200

    run(body)


def test_fault_crash_after_and_hang_after(model_dir: Path) -> None:
    async def body() -> None:
        crash = SimServer(config(model_dir, faults=FaultConfig(crash_after=1)))
        hang = SimServer(config(model_dir, faults=FaultConfig(hang_after=1)))
        async with crash, hang, aiohttp.ClientSession() as http:
            st, _ = await post(http, crash.url + "/v1/completions", {"prompt": "x", "max_tokens": 1})
            assert st == 200
            with pytest.raises(aiohttp.ClientError):
                await post(http, crash.url + "/v1/completions", {"prompt": "x", "max_tokens": 1})
            await asyncio.wait_for(crash.crashed.wait(), 5)
            with pytest.raises(aiohttp.ClientError):
                async with http.get(crash.url + "/health"):
                    pass
            st, _ = await post(http, hang.url + "/v1/completions", {"prompt": "x", "max_tokens": 1})
            assert st == 200
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(post(http, hang.url + "/v1/completions", {"prompt": "x", "max_tokens": 1}), 0.5)

    run(body)


def test_cli_builds_config_from_spec_defaults_and_flags(model_dir: Path) -> None:
    import argparse

    from llmd.engines.sim import cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    argv = "engine sim --port 0 --dp-ranks 2 --num-gpu-blocks 300 --fail-rate 0.5 --time-scale 0"
    args = parser.parse_args([*argv.split(), "--model", str(model_dir), "--kv-events-endpoint", "tcp://*:5557"])
    assert args.func is cli.run_sim
    cfg = cli.build_config(args)
    assert cfg.dp_size == 2 and cfg.port == 0 and cfg.engine.num_gpu_blocks == 300 and cfg.time_scale == 0
    assert cfg.faults.failure_rate == 0.5 and cfg.kv_events_endpoint == "tcp://*:5557"
    assert cfg.served_name == model_dir.name  # a bare folder names the model, as `vllm serve DIR`
    assert cfg.engine.block_size == 16 and cfg.engine.max_model_len == 4096  # from the default spec


# `llmd engine sim` as a process; llmd/cli.py wires `register` in, this drives the same entry point directly.
_CLI = "import sys; from llmd.cli import main; sys.exit(main(sys.argv[1:]))"


def test_cli_process_serves_until_sigterm(model_dir: Path) -> None:
    import signal
    import subprocess
    import sys
    import urllib.request

    cmd = [sys.executable, "-c", _CLI, "engine", "sim", "--model", str(model_dir), "--port", "0"]
    cmd += ["--side-channel-port", "0", "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "simulated engine serving NAME on URL", once listening
        assert "serving" in line, proc.stderr.read() if proc.stderr else line
        url = line.split()[-1]
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            assert r.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _layout_base() -> int:
    """A base port whose layout ports (+0..+101, +1000.., +2000.., +3000..) are all free and below the ephemeral range
    (32768+), where other connections' local ports could otherwise take one between the check and the bind."""
    import random
    import socket

    rng = random.Random()
    for _ in range(100):
        base = rng.randrange(10_000, 28_000, 10)
        ports = [base + off + d for off in (0, 100, 1000, 1100, 2000, 2100, 3000, 3100) for d in (0, 1)]
        try:
            for port in ports:
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free layout port range")


def test_cli_all_runs_every_replica_of_the_spec_in_one_process(model_dir: Path, tmp_path: Path) -> None:
    """`--all`: every pool's replicas in one process, on the ports llmd.spec.layout gives them, events included."""
    import signal
    import subprocess
    import sys
    import urllib.request

    from llmd.spec import load_spec
    from llmd.spec.layout import engine_endpoints

    base = _layout_base()
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(
        f"model:\n  path: {model_dir}\n"
        f"prefill:\n  nodes: 1\n  port: {base}\n"
        f"decode:\n  nodes: 2\n  replicas: 2\n  port: {base + 100}\n"
    )
    endpoints = engine_endpoints(load_spec(spec_file))
    assert [(e.role, e.http_port) for e in endpoints] == [
        ("prefill", base),
        ("decode", base + 100),
        ("decode", base + 101),
    ]
    cmd = [sys.executable, "-c", _CLI, "engine", "sim", "--all", "--spec", str(spec_file), "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in endpoints]
        assert all("serving" in line for line in lines), (lines, proc.stderr.read() if proc.stderr else "")
        for e in endpoints:
            with urllib.request.urlopen(e.url + "/health", timeout=5) as r:
                assert r.status == 200
        # Each replica publishes KV events on its own layout port.
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(f"tcp://127.0.0.1:{endpoints[2].kv_events_port}")
        try:
            import time as _time

            served = load_spec(spec_file).model.served_name
            decoded = None
            deadline = _time.monotonic() + 10
            attempt = 0
            while decoded is None and _time.monotonic() < deadline:
                # A fresh prompt each time: the subscription may miss the first BlockStored (ZMQ's slow joiner), and
                # a repeated prompt would only hit the cache and publish nothing more.
                attempt += 1
                prompt = [attempt, *range(5, 200)]
                body = json.dumps({"model": served, "prompt": prompt, "max_tokens": 2}).encode()
                req = urllib.request.Request(
                    endpoints[2].url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
                )
                with urllib.request.urlopen(req, timeout=5) as r:
                    assert r.status == 200
                if sub.poll(500):
                    decoded = KVEventDecoder().decode_frames(sub.recv_multipart())
            assert decoded is not None and decoded.batch.events
        finally:
            sub.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_all_refuses_a_single_port(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from llmd.cli import main

    assert main(["engine", "sim", "--all", "--port", "9000"]) == 2
    assert "--all takes every port" in capsys.readouterr().err
