"""The proxy's side of the engines: sending a request to its serving pod and the response back to the client, the
prefill hop, and the failures that leave an attempt retryable (nothing has reached the client yet).

Every exchange with an engine (a leg) runs under a deadline: `first_byte_s` until the engine's first bytes, then
`idle_s` between any two moves of the stream (a chunk in from the engine, or out to the client: a client that stops
reading is a peer that hangs too). When the health loop marks a pod down, its legs may stay silent for `down_grace_s`
at most: a hung (SIGSTOPped, wedged) engine holds its requests no longer than it takes to notice it. A leg that
nothing has reached the client from yet is cut only when another pod could serve it: a pod too busy to answer /health
(a CPU-bound engine on a loaded node) looks just like a hung one, and with nowhere else to go the answer it may still
give beats an error now (the first-byte and idle bounds still hold).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from llmd.net import h1
from llmd.router.metrics import RouterMetrics
from llmd.router.pods import Pod
from llmd.router.request import RequestCtx, json_encode

log = logging.getLogger(__name__)
_json_decode = msgspec.json.Decoder().decode
# Hop-by-hop and framing headers are the server's to set, not copied from the engine.
_SKIP_RESPONSE_HEADERS = frozenset(
    {"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server", "content-encoding"}
)
_SSE_ERROR = b'data: {"error"'


def _client_error(chunk: bytes) -> str | None:
    """The message of the stream's first error event if it says 4xx (vLLM's error body: {"error": {"message": ...,
    "code": 400}}), else None."""
    i = chunk.find(_SSE_ERROR)
    if i < 0:
        return None
    end = chunk.find(b"\n", i)
    try:
        err = _json_decode(chunk[i + 6 : end if end >= 0 else len(chunk)])["error"]
        code = err["code"]
    except (msgspec.DecodeError, KeyError, TypeError):
        return None
    if type(code) is not int or not 400 <= code < 500:
        return None
    return str(err.get("message", "")) if type(err) is dict else ""


_HOLD_MAX = 64 * 1024  # bytes of a stream's opening held back while they carry no output (a role chunk is ~200)


def starts_output(held: bytes) -> bool:
    """Whether the held opening of an SSE stream carries output or decides the stream: a token (text, content,
    reasoning, a tool call), a finish, usage, an error, [DONE] or anything not an OpenAI chunk. Only whole lines are
    read; a chat role chunk (`"delta": {"role": "assistant", "content": ""}`) is not output."""
    lines = held.split(b"\n")
    for line in lines[:-1]:  # the last piece has no newline yet: not whole
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        try:
            event = msgspec.json.decode(data)
        except msgspec.DecodeError:
            return True  # [DONE], or something this router does not read: pass it on
        if not isinstance(event, dict) or "choices" not in event:
            return True
        for choice in event["choices"] or ():
            delta = choice.get("delta") or {}
            if (
                choice.get("text")
                or choice.get("finish_reason")
                or any(delta.get(k) for k in ("content", "reasoning_content", "tool_calls"))
            ):
                return True
        if event.get("usage"):
            return True
    return False


_PROMPT_TOKENS = b'"prompt_tokens":'


class Leg:
    """One exchange with one pod and its deadline. `deadline(s)` opens a phase allowed `s` seconds of silence; `moved`
    (a chunk went by) pushes the deadline on; `cut` (the pod was marked down) shrinks the allowed silence to the grace
    and fires at once if the leg has been silent that long already."""

    __slots__ = ("_cm", "_next_arm", "idle_s", "last", "loop", "on_client", "pod", "streaming", "why")

    def __init__(self, pod: str, loop: asyncio.AbstractEventLoop) -> None:
        self.pod = pod
        self.loop = loop
        self.last = loop.time()
        self.idle_s = float("inf")  # the current phase's allowed silence
        self.why = ""  # set by cut(): why the leg ended early
        self.on_client = False  # awaiting the client (a write), not the engine
        self.streaming = False  # bytes reached the client: no other pod can take the request over any more
        self._cm: asyncio.Timeout | None = None
        self._next_arm = 0.0

    def deadline(self, seconds: float) -> asyncio.Timeout:
        """`async with leg.deadline(s):` a phase; TimeoutError at its end if it went silent for `s`."""
        self.idle_s = min(seconds, self.idle_s) if self.why else seconds
        now = self.loop.time()
        self.last = now
        self._next_arm = 0.0
        self._cm = asyncio.timeout_at(now + self.idle_s)
        return self._cm

    def moved(self) -> None:
        # Rescheduling costs a timer handle: done at most 8 times per allowed silence, not per chunk.
        now = self.loop.time()
        self.last = now
        if now >= self._next_arm and self._cm is not None:
            self._cm.reschedule(now + self.idle_s)
            self._next_arm = now + self.idle_s / 8

    def cut(self, why: str, grace_s: float) -> None:
        self.why = why
        self.idle_s = min(self.idle_s, grace_s)
        self._next_arm = 0.0
        cm = self._cm
        if cm is None or cm.expired():
            return
        with contextlib.suppress(RuntimeError):  # between phases: the next deadline() applies the grace
            when = max(self.loop.time(), self.last + grace_s)
            current = cm.when()
            if current is None or when < current:
                cm.reschedule(when)

    def reason(self, phase: str) -> str:
        what = f"sent nothing for {self.idle_s:g} s {phase}"
        return f"pod {self.pod} {self.why} and {what}" if self.why else f"pod {self.pod} {what}"


class Retry(Exception):
    """This attempt failed before anything reached the client; another pod may serve it."""

    def __init__(self, reason: str, pod: str, *, pod_down: bool, last: web.Response | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.pod = pod
        self.pod_down = pod_down
        self.last = last  # the engine's own error response, answered if no attempt is left


@dataclass(slots=True)
class PrefillResult:
    kv_params: dict[str, Any] | None  # None: the hop failed; `error` says why
    seconds: float
    error: str | None = None
    status: int | None = None
    cached_tokens: int | None = None  # the prefill pod's prefix hit, from its usage
    unreachable: bool = False  # the connection was refused: the pod is gone, not just failing this request


async def prefill_hop(
    http: h1.EnginePool,
    url: str,
    body: bytes,
    headers: dict[str, str],
    leg: Leg,
    first_byte_s: float,
    idle_s: float,
    on_resend: Callable[[BaseException], None] | None = None,
) -> PrefillResult:
    """POST the prefill body; any failure (status, timeout, connection, a response without kv_transfer_params) is a
    result with kv_params None, never an exception: the caller falls back to decode-only. The prefill response is not
    streamed: its first byte comes when the prefill is done, so `first_byte_s` bounds the prefill itself."""
    t0 = time.monotonic()
    try:
        async with leg.deadline(first_byte_s):
            r = await http.post(url, body, headers, on_resend=on_resend)
        ok = False
        try:
            async with leg.deadline(idle_s):
                raw = await r.read()
            ok = True
        finally:
            if ok:
                r.release()
            else:
                r.close()
        status = r.status
    except h1.ConnectFailed as exc:
        return PrefillResult(None, time.monotonic() - t0, f"{type(exc).__name__}: {exc}", unreachable=True)
    except TimeoutError:
        return PrefillResult(None, time.monotonic() - t0, leg.reason("to the prefill hop"))
    except (h1.EngineHTTPError, OSError) as exc:
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


class Upstream:
    """HTTP to the engines for one router: `http` is set while the router runs. `calibrate(chars, prompt_tokens)`
    hears the engine's prompt_tokens for requests whose length routing estimated from characters. The legs in flight
    are kept per pod, so that `pod_down` can cut them."""

    def __init__(
        self,
        metrics: RouterMetrics,
        calibrate: Callable[[int, int], None],
        *,
        first_byte_s: float = 600.0,
        idle_s: float = 60.0,
        down_grace_s: float = 1.0,
    ) -> None:
        self.metrics = metrics
        self.calibrate = calibrate
        self.first_byte_s = first_byte_s
        self.idle_s = idle_s
        self.down_grace_s = down_grace_s
        self.http: h1.EnginePool | None = None
        self.legs: dict[str, set[Leg]] = {}

    @contextlib.contextmanager
    def _leg(self, pod: str) -> Iterator[Leg]:
        leg = Leg(pod, asyncio.get_running_loop())
        legs = self.legs.setdefault(pod, set())
        legs.add(leg)
        try:
            yield leg
        finally:
            legs.discard(leg)
            if not legs:
                self.legs.pop(pod, None)

    def pod_down(self, pod: str, elsewhere: bool) -> None:
        """The pod was marked down: its legs may stay silent for the grace at most (a hung engine); those still
        retryable only if another pod could serve them (`elsewhere`)."""
        for leg in list(self.legs.get(pod, ())):
            if leg.streaming or elsewhere:
                leg.cut("was marked down", self.down_grace_s)

    async def prefill(self, pod: str, url: str, body: bytes, headers: dict[str, str]) -> PrefillResult:
        assert self.http is not None
        with self._leg(pod) as leg:
            return await prefill_hop(
                self.http, url, body, headers, leg, self.first_byte_s, self.idle_s, on_resend=self.resent
            )

    async def forward(
        self,
        request: web.Request,
        ctx: RequestCtx,
        pod: Pod,
        payload: bytes,
        headers: dict[str, str],
        out_headers: dict[str, str],
    ) -> web.StreamResponse:
        """Send the request to the serving pod and its response to the client, streaming chunk by chunk. Raises
        Retry while nothing has reached the client; after that a failure ends the stream with an error event."""
        with self._leg(pod.name) as leg:
            return await self._forward(request, ctx, pod, payload, headers, out_headers, leg)

    async def _forward(
        self,
        request: web.Request,
        ctx: RequestCtx,
        pod: Pod,
        payload: bytes,
        headers: dict[str, str],
        out_headers: dict[str, str],
        leg: Leg,
    ) -> web.StreamResponse:
        assert self.http is not None
        t0 = time.monotonic()
        try:
            async with leg.deadline(self.first_byte_s):
                up = await self.http.post(pod.info.url + ctx.route, payload, headers, on_resend=self.resent)
        except (h1.ConnectFailed, ConnectionRefusedError) as exc:
            raise Retry("connect", pod.name, pod_down=True) from exc
        except TimeoutError as exc:
            self._timed_out(ctx, leg, "before answering")
            raise Retry("first_byte_timeout", pod.name, pod_down=False) from exc
        except h1.Disconnected as exc:
            # Closed under the request (post resent it once if no byte of an answer had come): a clean close says
            # the engine is going away, a reset may be this request's alone.
            raise Retry("disconnect", pod.name, pod_down=exc.os_error is None) from exc
        except (h1.EngineHTTPError, OSError) as exc:
            raise Retry("disconnect", pod.name, pod_down=False) from exc
        done = False
        try:
            status = up.status
            if status != 200 or not (up.header("Content-Type") or "").startswith("text/event-stream"):
                try:
                    if up.complete:
                        # The whole body came with the head: read() cannot wait, so arming a deadline would cost a
                        # timer for nothing.
                        data = await up.read()
                    else:
                        async with leg.deadline(self.idle_s):
                            data = await up.read()
                except TimeoutError as exc:
                    self._timed_out(ctx, leg, "in the middle of its response body")
                    raise Retry("body_timeout", pod.name, pod_down=False) from exc
                except (h1.EngineHTTPError, OSError) as exc:
                    raise Retry("body", pod.name, pod_down=False) from exc
                done = True
                dt = time.monotonic() - t0
                self.metrics.first_byte_time.observe(dt)
                out_headers["x-llmd-upstream-ms"] = f"{dt * 1000:.1f}"
                if ctx.text_chars and status == 200:
                    self._calibrate(ctx, data)
                resp = web.Response(body=data, status=status, headers=_response_headers(up, out_headers))
                if status >= 500:
                    raise Retry(f"status_{status}", pod.name, pod_down=False, last=resp)
                return resp
            # Streaming: hold the client's headers until the engine's first bytes, so a pod failing before then is
            # still retried elsewhere; after that, pass every chunk on as it arrives. A chat stream opens with a role
            # chunk before its first token, and an engine that fails the request then (a failed KV pull) sends its
            # error event after it: chunks without output are held back too until output, an error or the end comes,
            # so such a failure is still retried, not passed on. They come together with the first token otherwise,
            # so holding costs no time to first token.
            try:
                async with leg.deadline(self.first_byte_s):
                    first = await up.readany()
                if not first:
                    raise Retry("empty_stream", pod.name, pod_down=False)
                async with leg.deadline(self.first_byte_s):
                    while len(first) < _HOLD_MAX and not starts_output(first):
                        more = await up.readany()
                        if not more:
                            break
                        first += more
            except TimeoutError as exc:
                self._timed_out(ctx, leg, "after its response headers")
                raise Retry("first_byte_timeout", pod.name, pod_down=False) from exc
            except (h1.EngineHTTPError, OSError) as exc:
                raise Retry("stream_start", pod.name, pod_down=False) from exc
            rejected = None
            if first.startswith(_SSE_ERROR) or b"\n" + _SSE_ERROR in first:
                # A 4xx in the stream is the request's own fault (vLLM streams "the decoder prompt cannot be empty"
                # as an error event): any engine would answer the same, so it goes to the client as sent.
                rejected = _client_error(first)
                if rejected is None:
                    # The engine failed the request before its first token (a failed KV pull): nothing reached the
                    # client, so another attempt (without KV transfer) can still serve it.
                    raise Retry("stream_error", pod.name, pod_down=False)
                ctx.error = f"engine {pod.name} rejected the request: {rejected}"
            now = time.monotonic()
            if rejected is None:
                ctx.first_byte = now  # an error event is no first token
            dt = ctx.serving_first_s = now - t0
            self.metrics.first_byte_time.observe(dt)
            out_headers["x-llmd-upstream-ms"] = f"{dt * 1000:.1f}"
            resp = web.StreamResponse(status=200, headers=_response_headers(up, out_headers))
            leg.streaming = True
            broke: str | None = None
            try:
                try:
                    async with leg.deadline(self.idle_s):
                        leg.on_client = True
                        await resp.prepare(request)
                        await resp.write(first)
                        if ctx.text_chars:
                            self._calibrate(ctx, first)
                        while True:
                            leg.on_client = False
                            chunk = await up.readany()
                            if not chunk:
                                break
                            leg.on_client = True
                            await resp.write(chunk)
                            leg.moved()
                            if ctx.text_chars:
                                self._calibrate(ctx, chunk)
                except h1.EngineHTTPError as exc:
                    broke = f"engine {pod.name} failed mid-stream"
                    log.warning("request %s: stream from %s broke: %s", ctx.request_id, pod.name, exc)
                    ctx.error = f"{broke}: {exc}"
                    self.metrics.error(ctx.route, "stream_broken")
                except TimeoutError:
                    if leg.on_client:
                        # The client stopped reading: nothing more can reach it. Dropping its connection (and the
                        # engine's, below) ends the request at both ends.
                        raise ConnectionResetError("the client stopped reading") from None
                    broke = leg.reason("mid-stream")
                    log.warning("request %s: %s", ctx.request_id, broke)
                    ctx.error = broke
                    self.metrics.error(ctx.route, "stream_timeout")
                if broke is not None:
                    # Bytes are out: end the stream the way vLLM ends a failed one, so the client sees why.
                    err = {"error": {"message": broke, "type": "InternalServerError", "param": None, "code": 500}}
                    await resp.write(b"data: " + json_encode(err) + b"\n\ndata: [DONE]\n\n")
                else:
                    done = True
                await resp.write_eof()
            except ConnectionResetError:
                # The client hung up (a client may close as soon as it has read `data: [DONE]`, before the chunked
                # stream's last frame), or stopped reading: nothing is left to send it. Unless the engine had
                # finished, closing the upstream connection below aborts the request there and frees its KV.
                if not done:
                    ctx.error = ctx.error or "client closed the connection before the stream ended"
                    if leg.on_client and request.transport is not None:
                        request.transport.abort()
                log.debug("request %s: client closed the stream", ctx.request_id)
            return resp
        finally:
            # A finished response gives its connection back to the pool; anything else closes it, which is also
            # how the engine learns that the request was abandoned (it aborts it and frees its KV).
            if done:
                up.release()
            else:
                up.close()

    def _timed_out(self, ctx: RequestCtx, leg: Leg, phase: str) -> None:
        why = leg.reason(phase)
        log.warning("request %s: %s; retrying elsewhere", ctx.request_id, why)
        self.metrics.error(ctx.route, "upstream_timeout")

    def resent(self, exc: BaseException) -> None:
        self.metrics.retries.labels("resent").inc()
        log.info("an engine closed a pooled connection under a request (%s); sent again", exc)

    def _calibrate(self, ctx: RequestCtx, data: bytes) -> None:
        """Approximate routing estimates prompt tokens from characters (P/D threshold, KV admission); the engine's
        usage.prompt_tokens in the response says how many there were: a moving average of the ratio keeps the
        estimate near the model's tokenizer without tokenizing anything."""
        i = data.rfind(_PROMPT_TOKENS)
        if i < 0:
            return
        j = i + len(_PROMPT_TOKENS)
        while j < len(data) and data[j] == 0x20:
            j += 1
        k = j
        while k < len(data) and 0x30 <= data[k] <= 0x39:
            k += 1
        if k == j:
            return
        self.calibrate(ctx.text_chars, int(data[j:k]))
        ctx.text_chars = 0  # once per request


def _response_headers(up: h1.Response, extra: dict[str, str]) -> dict[str, str]:
    h = {k: v for k, v in up.headers if k.lower() not in _SKIP_RESPONSE_HEADERS}
    h.update(extra)
    return h
