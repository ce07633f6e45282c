"""One turn on the wire: reading a chat completion's response (streamed or not) into the turn's metrics row."""

from __future__ import annotations

import contextlib
import itertools
import json
import statistics
import time
from typing import Any

import aiohttp

from llmd.metrics.schema import pd_path_of

# Byte patterns of streamed events (vLLM serializes without spaces); anything else is parsed as JSON.
_USAGE = b'"usage":{'
_ERROR = b'"error"'
_CONTENT, _NO_CONTENT = b'"content":"', b'"content":""'
_REASONING, _NO_REASONING = b'"reasoning_content":"', b'"reasoning_content":""'


def read_headers(row: dict[str, Any], resp: aiohttp.ClientResponse) -> None:
    """What the router said about the request: its queue time, pods and P/D path."""
    h = resp.headers
    q = h.get("x-llmd-queue-ms")
    if q:
        with contextlib.suppress(ValueError):
            row["router_queue_s"] = float(q) / 1000.0
    row["pod"] = h.get("x-llmd-pod", "")
    row["prefill_pod"] = h.get("x-llmd-prefill-pod", "")
    row["pd_path"] = pd_path_of(h)


def read_usage(row: dict[str, Any], usage: Any) -> None:
    """Token counts from an OpenAI usage object (cached tokens only when the server reports them)."""
    if not isinstance(usage, dict):
        return
    row["input_tokens"] = int(usage.get("prompt_tokens") or 0)
    row["output_tokens"] = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if cached is not None:
        row["cached_tokens"] = int(cached)


async def read_stream(resp: aiohttp.ClientResponse, row: dict[str, Any], t0: float, t_send: float) -> None:
    """Read a streamed chat answer into `row`: TTFT and inter-token gaps from when content arrived (perf_counter
    seconds; `t0` is the run's start, `t_send` the send time since it), usage, a stream error."""
    arrivals: list[float] = []
    usage: Any = None
    done = False
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        if _USAGE not in data and _ERROR not in data:
            # A plain delta event (vLLM's compact JSON): a token arrived when it carries non-empty content. Read
            # from the bytes: parsing every event was a quarter of the client's CPU per request.
            if (_CONTENT in data and _NO_CONTENT not in data) or (_REASONING in data and _NO_REASONING not in data):
                arrivals.append(time.perf_counter())
            continue
        event = json.loads(data)
        if "error" in event:
            row["error"] = f"stream error: {error_text(event['error'])}"
            break
        choices = event.get("choices") or ()
        for c in choices:
            delta = c.get("delta") or {}
            if delta.get("content") or delta.get("reasoning_content"):
                arrivals.append(time.perf_counter())
                break
        if event.get("usage"):
            usage = event["usage"]
    t_end = time.perf_counter() - t0
    row["e2e_s"] = t_end - t_send
    read_usage(row, usage)
    if arrivals:
        row["ttft_s"] = arrivals[0] - t0 - t_send
        if len(arrivals) > 1:
            # Plain Python: numpy's per-call overhead exceeds the work for a few dozen gaps, on the event loop.
            gaps = [b - a for a, b in itertools.pairwise(arrivals)]
            row["itl_mean_s"] = sum(gaps) / len(gaps)
            row["itl_p50_s"] = statistics.median(gaps)
            row["itl_max_s"] = max(gaps)
    if not done and not row.get("error"):
        row["error"] = "stream ended without [DONE]"


def error_text(err: Any) -> str:
    """A server's error (an OpenAI error object, a JSON body or text) as one short line for the row."""
    if isinstance(err, dict):
        msg = err.get("message") or err.get("error") or err
        return str(msg)[:240]
    if isinstance(err, str):
        try:
            return error_text(json.loads(err).get("error", err))
        except (ValueError, AttributeError):
            return err.strip()[:240]
    return str(err)[:240]
