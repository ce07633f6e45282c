"""The KV-transfer hops' wire format, exactly as vLLM's NixlConnector expects it from a proxy (vllm-router, llm-d's
sidecar). Pure: the router core builds P2P parameters with it, the proxy's upstream (llmd.router.upstream) sends them.

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

from typing import Any, Literal

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
