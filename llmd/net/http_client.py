"""HTTP to engines, as the router and the load generator speak it: pooled connections kept idle for less time than
the engines keep them, and a POST that survives the engine closing an idle pooled connection under it.

vLLM's API server (uvicorn) closes a keep-alive connection after VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s) idle. A client
that keeps idle connections longer will sometimes send a request on one the server is closing at that very moment:
the request dies with ServerDisconnectedError before any byte of a response. aiohttp resends idempotent requests in
that case but not POSTs, so the router did not either, took the pod for dead and failed the request (503 with one
decode pod, a decode-only fallback on the prefill hop). Two defences: the pool drops idle connections before vLLM
does, and a POST whose reused connection drops before any response is sent once more.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp

# Below vLLM's 5 s (and far below aiohttp servers' 75 s), so llmd closes an idle connection before the engine does;
# reconnecting on 127.0.0.1 or a cluster fabric costs well under a millisecond.
KEEPALIVE_S = 4.0


def engine_session(connect_timeout_s: float, keepalive_s: float = KEEPALIVE_S) -> aiohttp.ClientSession:
    """The router's pooled session: no connection limit (admission control bounds the load), connection reuse
    (most of what keeps a hop cheap), bodies passed through as they come. No Accept-Encoding: the router passes
    engine bodies on as they are, without their Content-Encoding, so it must never be sent a compressed one. No
    cookies: an engine's Set-Cookie is no business of the router's (nor of its other clients')."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=keepalive_s),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
        cookie_jar=aiohttp.DummyCookieJar(),
    )


async def post(
    http: aiohttp.ClientSession,
    url: str,
    *,
    on_resend: Callable[[BaseException], None] | None = None,
    **kw: Any,
) -> aiohttp.ClientResponse:
    """POST `url`; if the connection drops before any response (the engine closed the pooled connection as the
    request went out), send it once more on another connection. The body is in memory (bytes or str), so resending
    is exact; an engine that never saw the request loses nothing, and one that did only did work nobody reads."""
    try:
        return await http.post(url, **kw)
    except aiohttp.ClientConnectorError:
        raise  # refused or unreachable: the pod is gone, and sending again cannot help
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        if on_resend is not None:
            on_resend(exc)
    return await http.post(url, **kw)
