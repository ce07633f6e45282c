"""Helpers for the tests against real vLLM CPU servers: constants, the skip/fail rule, small HTTP and /metrics helpers.
(A module of its own, not conftest: test modules import it by name.)"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from llmd.discovery import PodInfo
from llmd.engines.vllm_deploy import VllmDeployment, vllm_installed
from llmd.router.proxy import Router, RouterConfig

BLOCK_SIZE = 32  # vLLM's CPU attention wants a multiple of 32
MAX_MODEL_LEN = 1024
SERVED_NAME = "tiny"
ROUTER_TIMEOUT_S = 300.0
START_TIMEOUT_S = 420.0  # three servers starting at once on a loaded 2-core machine took ~2 min


def vllm_importable() -> bool:
    return vllm_installed()


def require_vllm() -> None:
    """Skip without vLLM, unless LLMD_REQUIRE_VLLM=1 (make test) says its absence is a failure."""
    if vllm_importable():
        return
    if os.environ.get("LLMD_REQUIRE_VLLM") == "1":
        pytest.fail("vllm is not importable but LLMD_REQUIRE_VLLM=1; install it with `make install-full`")
    pytest.skip("vllm is not installed (pip install -e '.[vllm,fabric]'); set LLMD_REQUIRE_VLLM=1 to fail instead")


def post(url: str, body: Any, timeout: float = 120.0, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def metrics_text(base_url: str) -> str:
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as resp:
        return resp.read().decode()


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus family's samples whose labels include `labels` (vLLM's counters carry a _total suffix)."""
    total = 0.0
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        family, _, rest = series.partition("{")
        if family != name:
            continue
        if any(f'{k}="{v}"' not in rest for k, v in labels.items()):
            continue
        total += float(value)
    return total


def pod_named(dep: VllmDeployment, name: str) -> PodInfo:
    return next(p for p in dep.pods if p.name == name)


def router_config(dep: VllmDeployment, policy: str) -> RouterConfig:
    spec = dep.spec.model_copy(update={"router": dep.spec.router.model_copy(update={"policy": policy})})
    return RouterConfig.from_spec(
        spec, port=0, host="127.0.0.1", tokenizer=spec.model.path, health_interval_s=0.5, metrics_interval_s=0.5
    )


async def until_ready(router: Router, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(router.registry.healthy()) < n:
        assert time.monotonic() < deadline, f"router saw {len(router.registry.healthy())} of {n} pods healthy"
        await asyncio.sleep(0.1)


async def post_async(http: aiohttp.ClientSession, url: str, body: dict[str, Any], session: str) -> tuple[dict, Any]:
    async with http.post(url, json=body, headers={"X-Session-Id": session}) as r:
        data = await r.json()
        assert r.status == 200, f"{url} -> {r.status}: {data}"
        return dict(r.headers), data


def run_bounded(coro: Any, timeout: float = ROUTER_TIMEOUT_S) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


# ---- prompts ---------------------------------------------------------------------------------------------------------

WORDS = [
    "agent",
    "tool",
    "call",
    "file",
    "patch",
    "test",
    "build",
    "error",
    "trace",
    "cache",
    "block",
    "token",
    "router",
    "engine",
    "decode",
    "prefill",
    "session",
    "turn",
    "context",
    "prompt",
    "reply",
    "plan",
    "step",
    "fix",
    "review",
    "merge",
    "branch",
    "commit",
    "diff",
    "log",
    "metric",
    "queue",
    "batch",
    "shard",
    "node",
    "rank",
]


def words(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def session_turns(seed: int, turns: int, system_words: int = 50, user_words: int = 15) -> list[list[dict]]:
    """The message lists of one growing chat: each turn repeats the whole history and adds an exchange."""
    rng = random.Random(seed)
    history = [{"role": "system", "content": f"You are agent {seed}. " + words(rng, system_words)}]
    out = []
    for t in range(turns):
        history.append({"role": "user", "content": f"Turn {t}: " + words(rng, user_words)})
        out.append(list(history))
        history.append({"role": "assistant", "content": words(rng, 10)})
    return out


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out
