"""The simulated engine's fault hooks the soak benchmark drives (benchmarks/soak.py): a failed KV transfer, as vLLM's
NixlConnector reports one, is retried by the router on a fresh attempt; a dropped KV event batch is a sequence gap the
router fills by replay; `llmd engine sim` arms both on SIGUSR2 / SIGUSR1 without stopping."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from routerutil import Servers, engine, metric, metric_text, pod_of, post, rconfig, run, until, words

from llmd.engines.sim.runner import FaultConfig, FaultInjector
from llmd.router.proxy import Router


def test_injector_fails_armed_transfers_once_each_and_at_its_rate() -> None:
    f = FaultInjector(FaultConfig())
    assert not f.transfer_fails()
    f.fail_next_transfers = 2
    assert [f.transfer_fails() for _ in range(3)] == [True, True, False]
    always = FaultInjector(FaultConfig(kv_transfer_failure_rate=1.0))
    assert all(always.transfer_fails() for _ in range(5)) and always.failed_transfers == 5
    with pytest.raises(ValueError):
        FaultConfig(kv_transfer_failure_rate=1.5)


async def _one_failed_pull(model_dir: Path, route: str, req: dict) -> tuple[str, dict, str, str]:
    """`req` through a router over a prefill and a decode engine whose next KV pull fails: (the streamed answer, its
    headers, the decode engine's /metrics, the router's /metrics)."""
    async with Servers() as sv, aiohttp.ClientSession() as http:
        pre = await sv.start(engine(model_dir, "p0", role="prefill"))
        dec = await sv.start(engine(model_dir, "d0", role="decode"))
        async with Router(rconfig(model_dir, pd_threshold=16), [pod_of(pre), pod_of(dec)]) as router:
            await until(lambda: all(p.healthy for p in router.registry.pods.values()), 10, "pods healthy")
            assert dec.engine is not None
            dec.engine.faults.fail_next_transfers = 1
            st, r, h = await post(http, router.url + route, req)
            # No error event in the stream (the generated text itself may say "error": it is random words).
            events = [json.loads(line[6:]) for line in r.splitlines() if line.startswith("data: {")]
            assert st == 200 and events and r.rstrip().endswith("[DONE]"), r
            assert not any("error" in e or e.get("object") == "error" for e in events), r
            assert dec.engine.faults.failed_transfers == 1
            return r, h, await metric_text(http, dec.url), await metric_text(http, router.url)


def test_failed_kv_transfer_is_retried_by_the_router_and_the_client_sees_none(model_dir: Path) -> None:
    req = {"prompt": words(5, 200), "max_tokens": 4, "stream": True}
    _, h, text, rtext = run(lambda: _one_failed_pull(model_dir, "/v1/completions", req))
    assert h["x-llmd-attempts"] == "2"
    assert metric(text, "vllm:nixl_num_failed_transfers_total") == 1
    assert metric(rtext, "llmd_router_retries_total", reason="stream_error") == 1


def test_dropped_kv_event_batch_is_a_gap_the_router_replays(model_dir: Path) -> None:
    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            eng = await sv.start(engine(model_dir, "e0"))
            async with Router(rconfig(model_dir), [pod_of(eng)]) as router:
                await until(lambda: all(p.healthy for p in router.registry.pods.values()), 10, "pod healthy")
                st, _, _ = await post(http, router.url + "/v1/completions", {"prompt": words(1, 100), "max_tokens": 2})
                assert st == 200
                await until(lambda: router.hub.stats.batches > 0, 10, "first batches")
                replayed = router.hub.stats.replay_batches
                eng.publishers[0].skip_next = 1
                for i in (2, 3):
                    st, _, _ = await post(
                        http, router.url + "/v1/completions", {"prompt": words(i, 100), "max_tokens": 2}
                    )
                    assert st == 200
                await until(lambda: router.hub.stats.replay_batches > replayed, 10, "the dropped batch replayed")
                assert eng.publishers[0].dropped == 1 and router.hub.stats.gaps == 0

    run(body)


@pytest.mark.integration
def test_engine_process_takes_fault_signals_and_keeps_serving(model_dir: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llmd.cli",
            "engine",
            "sim",
            "--model",
            str(model_dir),
            "--port",
            "0",
            "--side-channel-port",
            "0",
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert "serving" in line, line
        proc.send_signal(signal.SIGUSR1)
        proc.send_signal(signal.SIGUSR2)
        time.sleep(0.5)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0
        assert "SIGUSR1" in err and "SIGUSR2" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_failed_kv_transfer_after_a_chat_streams_role_chunk_is_retried(model_dir: Path) -> None:
    """On the chat API the engine sends the stream's role chunk before the failed pull reports its error (found by the
    soak benchmark: 12 client errors). The router holds chunks without output back, so the failure is still retried
    and the client gets one clean stream from the second attempt."""
    req = {"messages": [{"role": "user", "content": words(7, 200)}], "max_tokens": 4, "stream": True}
    r, h, _, rtext = run(lambda: _one_failed_pull(model_dir, "/v1/chat/completions", req))
    assert r.count('"role":"assistant"') == 1, r  # one opening, from the attempt that served it
    assert h["x-llmd-attempts"] == "2"
    assert metric(rtext, "llmd_router_retries_total", reason="stream_error") == 1


def test_starts_output_reads_only_whole_chunks() -> None:
    from llmd.router.upstream import starts_output

    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    token = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'
    assert not starts_output(role) and starts_output(role + token)
    assert not starts_output(role + token[:20])  # a token not yet whole
    assert starts_output(b'data: {"choices":[{"index":0,"text":"x"}]}\n\n')  # completions
    assert starts_output(b"data: [DONE]\n\n") and starts_output(b'data: {"error":{"message":"x"}}\n\n')
