"""The KV-transfer hops, exactly as vLLM's NixlConnector expects them from a proxy (vllm-router, llm-d's sidecar).

P/D (two hops):
1. prefill pod: the client's body with `max_tokens: 1`, `stream: false`, no `stream_options` (chat: no
   `max_completion_tokens`; also `n: 1` and no `min_tokens`, which would contradict max_tokens 1), plus
   `kv_transfer_params` = PREFILL_KV_PARAMS below. Its response's `kv_transfer_params` (do_remote_prefill,
   remote_engine_id, remote_block_ids, remote_request_id, remote_host, remote_port, tp_size, ...) name the leased
   blocks.
2. decode pod: the client's original body (its own max_tokens and stream) plus those `kv_transfer_params` verbatim; the
   decode engine pulls the blocks over its side channel and computes only the last prompt token.

P2P (a peer holds the prefix; the chosen pod pulls it instead of recomputing), two forms:
- "hash" (the simulated engine; llm-d's peer pull by block hash): one hop to the chosen pod with
  `kv_transfer_params` = {"do_remote_prefill": true, "remote_engine_id": <holder's engine id>, "remote_host": <holder's
  side-channel host>, "remote_port": <its side-channel port + DP rank>, "remote_num_tokens": <prefix tokens the
  holder has>}. No remote_request_id: the puller asks the holder for its cached blocks by hash.
- "two-hop" (stock vLLM, whose NixlConnector only pulls leased blocks): the P/D flow above with the holder as the
  prefill pod: it computes only what it lacks, and the chosen pod pulls the whole prompt from it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import msgspec

from llmd.net import http_client

P2PMode = Literal["hash", "two-hop"]

# Key for key what vLLM's proxies send to the prefill pod (vllm/examples/.../disagg_proxy, vllm-router).
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_PREFILL_DROP = ("stream_options", "min_tokens", "best_of")
_json_decode = msgspec.json.Decoder().decode


def prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The prefill hop's body: one token, not streamed, asking the engine to keep the KV for a remote decode."""
    out = dict(body)
    out["max_tokens"] = 1
    out["stream"] = False
    for key in _PREFILL_DROP:
        out.pop(key, None)
    if chat:
        out.pop("max_completion_tokens", None)
    if "n" in out:
        out["n"] = 1  # one lease is all the decode pod pulls; more would sit until they expire
    out["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return out


def with_kv_params(body: dict[str, Any], kv_params: dict[str, Any]) -> dict[str, Any]:
    """The client's body for the serving pod, carrying the KV transfer parameters it must act on."""
    out = dict(body)
    out["kv_transfer_params"] = kv_params
    return out


def p2p_params(engine_id: str, host: str, port: int, num_tokens: int) -> dict[str, Any]:
    """The serving pod's kv_transfer_params for a peer pull by hash ("hash" mode)."""
    return {
        "do_remote_prefill": True,
        "remote_engine_id": engine_id,
        "remote_host": host,
        "remote_port": port,
        "remote_num_tokens": num_tokens,
    }


@dataclass(slots=True)
class PrefillResult:
    kv_params: dict[str, Any] | None  # None: the hop failed; `error` says why
    seconds: float
    error: str | None = None
    status: int | None = None
    cached_tokens: int | None = None  # the prefill pod's prefix hit, from its usage
    unreachable: bool = False  # the connection was refused: the pod is gone, not just failing this request


async def prefill_hop(
    http: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: dict[str, str],
    timeout: aiohttp.ClientTimeout,
    on_resend: Callable[[BaseException], None] | None = None,
) -> PrefillResult:
    """POST the prefill body; any failure (status, timeout, connection, a response without kv_transfer_params) is a
    result with kv_params None, never an exception: the caller falls back to decode-only."""
    t0 = time.monotonic()
    try:
        async with await http_client.post(
            http, url, data=body, headers=headers, timeout=timeout, on_resend=on_resend
        ) as r:
            raw = await r.read()
            status = r.status
    except aiohttp.ClientConnectorError as exc:
        return PrefillResult(None, time.monotonic() - t0, f"{type(exc).__name__}: {exc}", unreachable=True)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return PrefillResult(None, time.monotonic() - t0, f"{type(exc).__name__}: {exc}")
    dt = time.monotonic() - t0
    if status != 200:
        return PrefillResult(None, dt, f"prefill pod answered {status}: {raw[:200]!r}", status)
    try:
        data = _json_decode(raw)
    except msgspec.DecodeError as exc:
        return PrefillResult(None, dt, f"prefill response is not JSON: {exc}", status)
    kv = data.get("kv_transfer_params") if isinstance(data, dict) else None
    if not isinstance(kv, dict) or not kv.get("do_remote_prefill"):
        return PrefillResult(None, dt, "prefill response has no kv_transfer_params (no KV connector?)", status)
    cached = None
    usage = data.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens_details"), dict):
        c = usage["prompt_tokens_details"].get("cached_tokens")
        cached = c if isinstance(c, int) else None
    return PrefillResult(kv, dt, None, status, cached)
