"""Fuzzing the HTTP APIs of the router and of the simulated engine (hypothesis, a bounded number of examples): random
JSON of every type, size and nesting, chat and completion bodies with wrong types in every field, invalid UTF-8,
truncated JSON and wrong content types. Every answer is a 200 or a 4xx with an OpenAI-style error body, never a 500,
and both servers still answer /health afterwards.

The servers run in a background event loop of this process on 127.0.0.1; examples are sent over one keep-alive
connection per server with http.client, so each costs a few milliseconds."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from routerutil import engine, pod_of, rconfig

from llmd.engines.sim.server import SimServer
from llmd.router.proxy import Router

EXAMPLES = 150
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)

# ---- servers ---------------------------------------------------------------------------------------------------------


class Live:
    """A simulated engine and a router in front of it, served by an event loop on a thread of this process."""

    def __init__(self, model_dir: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-servers", daemon=True)
        self.thread.start()
        self.engine: SimServer = self.call(SimServer(engine(model_dir, "e0", time_scale=0.0)).start())
        cfg = rconfig(model_dir, max_body_bytes=1 << 20)
        self.router: Router = self.call(Router(cfg, [pod_of(self.engine)]).start())

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.call(self.router.stop())
        self.call(self.engine.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class Client:
    """One keep-alive connection; a connection the server closed (it may, after a 4xx) is opened again."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)

    def request(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> Any:
        for attempt in range(2):
            try:
                self.conn.request(method, path, body=body, headers=headers or {})
                r = self.conn.getresponse()
                data = r.read()
                if r.getheader("Connection", "").lower() == "close":
                    self.conn.close()
                return r.status, r.getheader("Content-Type", ""), data
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.conn.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def live(model_dir: Path) -> Iterator[Live]:
    servers = Live(model_dir)
    try:
        yield servers
    finally:
        servers.close()


@pytest.fixture(scope="module")
def clients(live: Live) -> dict[str, Client]:
    return {"router": Client(live.router.port), "engine": Client(live.engine.port)}


# ---- bodies ----------------------------------------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30)
)
json_values = st.recursive(
    scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=10), c, max_size=4), max_leaves=16
)


def mostly(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`good` three times in four, any JSON value otherwise: requests get deep into the servers, and still every
    field is sometimes of a wrong type."""
    return st.one_of(good, good, good, json_values)


small_ints = st.integers(-3, 12)
roles = mostly(st.sampled_from(["user", "system", "assistant", "tool", "developer", "function", "x"]))
text = st.text(max_size=40)
content_parts = st.lists(
    st.fixed_dictionaries(
        {"type": mostly(st.sampled_from(["text", "text", "image_url", "refusal", "input_text"]))},
        optional={"text": mostly(text), "refusal": json_values, "image_url": json_values},
    ),
    max_size=3,
)
message = st.fixed_dictionaries(
    {"role": roles, "content": mostly(text | content_parts)},
    optional={"name": mostly(text), "tool_calls": json_values, "tool_call_id": mostly(text)},
)
messages = mostly(st.lists(mostly(message), min_size=1, max_size=3))
common = {
    "model": mostly(st.just("tiny")),
    "max_tokens": mostly(small_ints),
    "max_completion_tokens": mostly(small_ints),
    "n": mostly(st.integers(0, 3)),
    "stream": mostly(st.booleans()),
    "stream_options": mostly(st.fixed_dictionaries({}, optional={"include_usage": mostly(st.booleans())})),
    "temperature": mostly(st.floats(-1, 3)),
    "top_p": mostly(st.floats(-0.5, 1.5)),
    "logprobs": mostly(small_ints),
    "top_logprobs": mostly(small_ints),
    "prompt_logprobs": mostly(small_ints),
    "seed": mostly(small_ints),
    "ignore_eos": mostly(st.booleans()),
    "min_tokens": mostly(small_ints),
    "cache_salt": mostly(text),
    "kv_transfer_params": json_values,
    "truncate_prompt_tokens": mostly(small_ints),
    "add_special_tokens": mostly(st.booleans()),
    "stop": json_values,
    "user": mostly(text),
}
chat_body = st.fixed_dictionaries(
    {"messages": messages},
    optional={
        **common,
        "tools": json_values,
        "chat_template_kwargs": json_values,
        "add_generation_prompt": mostly(st.booleans()),
        "continue_final_message": mostly(st.booleans()),
        "documents": json_values,
    },
)
completion_body = st.fixed_dictionaries(
    {"prompt": mostly(text | st.lists(st.integers(-5, 70_000), max_size=30) | st.lists(text, min_size=1, max_size=2))},
    optional={**common, "echo": mostly(st.booleans()), "suffix": json_values},
)
tokenize_body = st.fixed_dictionaries(
    {},
    optional={
        "prompt": mostly(text),
        "messages": messages,
        "tokens": mostly(st.lists(st.integers(-5, 70_000), max_size=20)),
        "return_token_strs": mostly(st.booleans()),
        **common,
    },
)


def deep(n: int) -> bytes:
    return b'{"messages":' + b"[" * n + b"]" * n + b"}"


@st.composite
def raw_bodies(draw: st.DrawFn, shaped: st.SearchStrategy[Any]) -> bytes:
    """Bytes on the wire: JSON of a shaped or arbitrary value (ASCII-escaped or not), cut short, spoiled with bytes
    that are not UTF-8 or with escapes of unpaired surrogates, deeply nested, or random bytes."""
    kind = draw(st.sampled_from(["shaped"] * 12 + ["any", "cut", "spoiled", "surrogate", "deep", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "deep":
        return deep(draw(st.sampled_from([50, 129, 1000, 50_000])))
    value = draw(shaped) if kind != "any" else draw(json_values)
    text = json.dumps(value, ensure_ascii=draw(st.booleans()))
    raw = text.encode("utf-8", "surrogatepass")
    if kind == "cut" and raw:
        return raw[: draw(st.integers(0, len(raw) - 1))]
    if kind == "spoiled" and raw:
        i = draw(st.integers(0, len(raw)))
        return (
            raw[:i] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b"\xf4\x90\x80\x80"])) + raw[i:]
        )
    if kind == "surrogate":
        return raw.replace(b'"', b'"\\ud800', 1) if b'"' in raw else raw
    return raw


content_types = st.sampled_from(
    ["application/json"] * 12
    + [
        "application/json; charset=utf-8",
        "APPLICATION/JSON",
        "application/vnd.api+json",
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "",
        None,
    ]
)


def check_answer(status: int, ctype: str, data: bytes, what: str) -> None:
    assert status == 200 or 400 <= status < 500, f"{what}: {status} {data[:300]!r}"
    if status != 200:
        assert ctype.startswith("application/json"), f"{what}: {status} {ctype} {data[:200]!r}"
        body = json.loads(data)
        err = body["error"]
        assert isinstance(err, dict) and {"message", "type", "code"} <= set(err), body
        assert err["code"] == status or isinstance(err["code"], str), body


SEEN: dict[tuple[str, int], int] = {}  # (path, status) -> answers, for looking at what the fuzzer reached


def post(client: Client, path: str, raw: bytes, ctype: str | None) -> None:
    headers = {} if ctype is None else {"Content-Type": ctype}
    status, got_type, data = client.request("POST", path, raw, headers)
    SEEN[(path, status)] = SEEN.get((path, status), 0) + 1
    check_answer(status, got_type, data, f"POST {path} [{ctype}] {raw[:200]!r}")


# ---- the properties --------------------------------------------------------------------------------------------------

paths = {"router": ["/v1/chat/completions", "/v1/completions"],
         "engine": ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"]}  # fmt: skip
shapes = {"/v1/chat/completions": chat_body, "/v1/completions": completion_body, "/tokenize": tokenize_body,
          "/detokenize": tokenize_body}  # fmt: skip


@pytest.mark.parametrize("server", ["router", "engine"])
def test_fuzzed_requests_never_get_a_500(server: str, live: Live, clients: dict[str, Client]) -> None:
    client = clients[server]

    @FUZZ
    @given(data=st.data(), ctype=content_types)
    def one(data: st.DataObject, ctype: str | None) -> None:
        path = data.draw(st.sampled_from(paths[server]))
        raw = data.draw(raw_bodies(shapes[path]))
        post(client, path, raw, ctype)

    one()
    status, _, _ = client.request("GET", "/health")
    assert status == 200


def test_fuzzed_paths_and_methods_are_4xx_json(live: Live, clients: dict[str, Client]) -> None:
    client = clients["router"]

    @FUZZ
    @given(
        method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]),
        path=st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=40),
    )
    def one(method: str, path: str) -> None:
        status, ctype, data = client.request(method, "/" + path.lstrip("/"))
        assert status < 500, (method, path, status, data[:200])
        if status >= 400 and method != "HEAD":
            check_answer(status, ctype, data, f"{method} /{path}")

    one()
    assert client.request("GET", "/health")[0] == 200
