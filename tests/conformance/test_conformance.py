"""Conformance: the simulated engine against a real vLLM CPU server, through the same client-side tests.

Each scenario runs once per server (memoized by the `observe` fixture, since a rerun would hit the prefix cache).
Per-engine tests (`engine` = sim | vllm) check an observation against a SHAPE SPEC written from vLLM 0.32's answers
(keys, types, nesting, fixed values; never generated text). Cross tests (marker `vllm`, fixture `both`) compare the
two servers' observations directly: same keys and types, same usage and cached tokens, same metric names and counter
moves, the same KV event payloads (ts aside), the same error bodies.

Known sim mismatches are `xfail(strict=True)` with the reason "sim bug: ...": they are reported, not hidden, and an
XPASS flags the fix. Prompts carry the scenario's name, so no scenario sees another one's prefix cache.
"""

from __future__ import annotations

import copy
import json
import re
import time
import zlib
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest

from llmd.kv.events import KVEventDecoder
from llmd.kv.hashing import BlockHasher

from .conftest import BLOCK_SIZE, ENGINE_PARAMS, HASH_ALGO, KV_TOPIC, MAX_MODEL_LEN, SERVED_NAME, Server

# Every test here starts server processes.
pytestmark = pytest.mark.integration

BS = BLOCK_SIZE
VOCAB = 1024  # make_tiny's vocabulary
SENTENCES = [
    "The router scores every engine by the longest cached prefix of the prompt.",
    "A coding agent reads the failing test, edits one file and runs the suite again.",
    "Prefill and decode run on separate pools when the prompts are long.",
    "Each engine publishes the blocks it caches so that the index stays fresh.",
    "Slurm starts one job per replica and the gateway discovers them by name.",
]


def fresh_text(tag: str, sentences: int) -> str:
    """A prompt no other scenario sends: the tag leads, so even its first block is new."""
    return f"[{tag}] " + " ".join(SENTENCES[i % len(SENTENCES)] for i in range(sentences))


def fresh_ids(tag: str, n: int) -> list[int]:
    """n in-vocabulary, non-special token ids that start differently for every tag."""
    base = zlib.crc32(tag.encode()) % 997
    return [5 + (base + 37 * i) % (VOCAB - 5) for i in range(n)]


def gen(prompt: Any = None, *, messages: list[dict[str, str]] | None = None, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": SERVED_NAME, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    if messages is not None:
        body["messages"] = messages
    else:
        body["prompt"] = prompt
    body.update(kw)
    return body


def full_blocks(n: int) -> int:
    return n // BS * BS


def vllm_cached(n: int, cached_blocks_tokens: int) -> int:
    """Tokens vLLM reports cached: whole cached blocks, but never the prompt's last token (it must be computed)."""
    return min(cached_blocks_tokens, (n - 1) // BS * BS)


# ---- shape specs -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lit:
    value: Any


@dataclass(frozen=True)
class Match:
    pattern: str


@dataclass(frozen=True)
class Seq:
    item: Any
    min: int = 0
    max: int | None = None


def check(obj: Any, spec: Any, ignore: frozenset[str] = frozenset(), path: str = "") -> list[str]:
    """Where `obj` departs from `spec`: a dict spec means exactly these keys; a type, an instance of it (bool is not
    an int); None, null; a tuple, any of the alternatives; Lit, that value; Match, a string matching; Seq, a list.
    `ignore` holds dotted paths ("*" for any list index) left unchecked."""
    if path.lstrip(".") in ignore:
        return []
    where = path.lstrip(".") or "$"
    if isinstance(spec, tuple):
        alts = [check(obj, s, ignore, path) for s in spec]
        return [] if any(not a for a in alts) else [f"{where}: {obj!r:.80} matches none of {spec!r:.120}"]
    if spec is None:
        return [] if obj is None else [f"{where}: expected null, got {obj!r:.80}"]
    if isinstance(spec, Lit):
        return (
            [] if obj == spec.value and type(obj) is type(spec.value) else [f"{where}: {obj!r:.80} != {spec.value!r}"]
        )
    if isinstance(spec, Match):
        ok = isinstance(obj, str) and re.search(spec.pattern, obj) is not None
        return [] if ok else [f"{where}: {obj!r:.80} does not match {spec.pattern!r}"]
    if isinstance(spec, type):
        if spec is int:
            ok = isinstance(obj, int) and not isinstance(obj, bool)
        elif spec is float:
            ok = isinstance(obj, int | float) and not isinstance(obj, bool)
        else:
            ok = isinstance(obj, spec)
        return [] if ok else [f"{where}: expected {spec.__name__}, got {type(obj).__name__} {obj!r:.60}"]
    if isinstance(spec, Seq):
        if not isinstance(obj, list):
            return [f"{where}: expected a list, got {type(obj).__name__}"]
        errs = []
        if len(obj) < spec.min or (spec.max is not None and len(obj) > spec.max):
            errs.append(f"{where}: list of {len(obj)}, expected {spec.min}..{spec.max}")
        for x in obj:
            errs += check(x, spec.item, ignore, f"{path}.*")
        return errs
    if isinstance(spec, dict):
        if not isinstance(obj, dict):
            return [f"{where}: expected an object, got {type(obj).__name__} {obj!r:.60}"]
        errs = []
        for k in sorted(set(spec) - set(obj)):
            if f"{path}.{k}".lstrip(".") not in ignore:
                errs.append(f"{where}: missing key {k!r}")
        for k in sorted(set(obj) - set(spec)):
            if f"{path}.{k}".lstrip(".") not in ignore:
                errs.append(f"{where}: unexpected key {k!r}")
        for k in sorted(set(spec) & set(obj)):
            errs += check(obj[k], spec[k], ignore, f"{path}.{k}")
        return errs
    raise TypeError(f"bad spec {spec!r}")


def assert_spec(obj: Any, spec: Any, ignore: frozenset[str] = frozenset(), what: str = "") -> None:
    errs = check(obj, spec, ignore)
    assert not errs, f"{what} departs from vLLM's shape:\n  " + "\n  ".join(errs)


def shape(obj: Any) -> Any:
    """Keys, nesting and types; values dropped (generated text, ids and timestamps differ by nature)."""
    if isinstance(obj, dict):
        return {k: shape(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [shape(x) for x in obj]
    return type(obj).__name__


def drop(obj: Any, paths: frozenset[str]) -> Any:
    """A copy of obj without the dotted paths ("*" = every list element)."""
    obj = copy.deepcopy(obj)
    for p in paths:
        _drop(obj, p.split("."))
    return obj


def _drop(obj: Any, parts: list[str]) -> None:
    head, rest = parts[0], parts[1:]
    if head == "*" and isinstance(obj, list):
        for x in obj:
            if rest:
                _drop(x, rest)
        return
    if isinstance(obj, dict) and head in obj:
        if rest:
            _drop(obj[head], rest)
        else:
            del obj[head]


# vLLM 0.32 with --enable-prompt-tokens-details, ids/fingerprints as it formats them.
FINGERPRINT = Match(r"^vllm-\d+\.\d+\.\d+.*-[0-9a-f]{8}$")
USAGE_COMPLETION = {
    "prompt_tokens": int,
    "total_tokens": int,
    "completion_tokens": int,
    "prompt_tokens_details": {"cached_tokens": int, "created_cache_tokens": None, "multimodal_tokens": None},
    "completion_tokens_details": None,
}
# Chat fills created_cache_tokens (tokens of the prompt newly written to the prefix cache).
USAGE_CHAT = {**USAGE_COMPLETION, "prompt_tokens_details": {**USAGE_COMPLETION["prompt_tokens_details"]}}
USAGE_CHAT["prompt_tokens_details"]["created_cache_tokens"] = int
COMPLETION = {
    "id": Match(r"^cmpl-\S+$"),
    "object": Lit("text_completion"),
    "created": int,
    "model": Lit(SERVED_NAME),
    "choices": Seq(
        {
            "index": Lit(0),
            "text": str,
            "logprobs": None,
            "finish_reason": Lit("length"),
            "stop_reason": None,
            "token_ids": None,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "routed_experts": None,
        },
        1,
        1,
    ),
    "service_tier": None,
    "system_fingerprint": FINGERPRINT,
    "usage": USAGE_COMPLETION,
    "kv_transfer_params": None,
    "ec_transfer_params": None,
    "metrics": None,
}
CHAT = {
    "id": Match(r"^chatcmpl-\S+$"),
    "object": Lit("chat.completion"),
    "created": int,
    "model": Lit(SERVED_NAME),
    "choices": Seq(
        {
            "index": Lit(0),
            "message": {
                "role": Lit("assistant"),
                "content": str,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "reasoning": None,
            },
            "logprobs": None,
            "finish_reason": Lit("length"),
            "stop_reason": None,
            "token_ids": None,
            "routed_experts": None,
        },
        1,
        1,
    ),
    "service_tier": None,
    "system_fingerprint": FINGERPRINT,
    "usage": USAGE_CHAT,
    "prompt_logprobs": None,
    "prompt_token_ids": None,
    "prompt_text": None,
    "kv_transfer_params": None,
    "ec_transfer_params": None,
    "metrics": None,
}
_CHUNK_HEAD = {"id": Match(r"^cmpl-\S+$"), "object": Lit("text_completion"), "created": int, "model": Lit(SERVED_NAME)}
_CMPL_CHUNK_CHOICE = {
    "index": Lit(0),
    "text": str,
    "logprobs": None,
    "finish_reason": None,
    "stop_reason": None,
    "prompt_token_ids": None,
    "token_ids": None,
}
COMPLETION_CHUNK = {**_CHUNK_HEAD, "choices": Seq(_CMPL_CHUNK_CHOICE, 1, 1)}
COMPLETION_LAST_CHUNK = {**_CHUNK_HEAD, "choices": Seq({**_CMPL_CHUNK_CHOICE, "finish_reason": Lit("length")}, 1, 1)}
# Without include_usage the finishing chunk carries the fingerprint.
COMPLETION_LAST_CHUNK_NO_USAGE = {**COMPLETION_LAST_CHUNK, "system_fingerprint": FINGERPRINT}
USAGE_CHUNK_USAGE = {
    "prompt_tokens": int,
    "total_tokens": int,
    "completion_tokens": int,
    "prompt_tokens_details": {"cached_tokens": int},
}
COMPLETION_USAGE_CHUNK = {
    **_CHUNK_HEAD,
    "choices": Seq(None, 0, 0),
    "usage": USAGE_CHUNK_USAGE,
    "system_fingerprint": FINGERPRINT,
}
_CHAT_HEAD = {
    "id": Match(r"^chatcmpl-\S+$"),
    "object": Lit("chat.completion.chunk"),
    "created": int,
    "model": Lit(SERVED_NAME),
}
CHAT_ROLE_CHUNK = {
    **_CHAT_HEAD,
    "choices": Seq(
        {
            "index": Lit(0),
            "delta": {"role": Lit("assistant"), "content": Lit("")},
            "logprobs": None,
            "finish_reason": None,
        },
        1,
        1,
    ),
    "prompt_token_ids": None,
    "prompt_text": None,
}
_CHAT_CHUNK_CHOICE = {
    "index": Lit(0),
    "delta": {"content": str},
    "logprobs": None,
    "finish_reason": None,
    "token_ids": None,
}
CHAT_CHUNK = {**_CHAT_HEAD, "choices": Seq(_CHAT_CHUNK_CHOICE, 1, 1)}
CHAT_LAST_CHUNK = {
    **_CHAT_HEAD,
    "choices": Seq({**_CHAT_CHUNK_CHOICE, "finish_reason": Lit("length"), "stop_reason": None}, 1, 1),
}
CHAT_USAGE_CHUNK = {
    **_CHAT_HEAD,
    "choices": Seq(None, 0, 0),
    "usage": {**USAGE_CHUNK_USAGE, "prompt_tokens_details": {"cached_tokens": int, "created_cache_tokens": int}},
    "system_fingerprint": FINGERPRINT,
}
ERROR = {"error": {"message": str, "type": str, "param": (str, None), "code": int}}
MODELS = {
    "object": Lit("list"),
    "data": Seq(
        {
            "id": Lit(SERVED_NAME),
            "object": Lit("model"),
            "created": int,
            "owned_by": Lit("vllm"),
            "root": str,
            "parent": None,
            "max_model_len": Lit(MAX_MODEL_LEN),
            "permission": Seq(
                {
                    "id": Match(r"^modelperm-\S+$"),
                    "object": Lit("model_permission"),
                    "created": int,
                    "allow_create_engine": Lit(False),
                    "allow_sampling": Lit(True),
                    "allow_logprobs": Lit(True),
                    "allow_search_indices": Lit(False),
                    "allow_view": Lit(True),
                    "allow_fine_tuning": Lit(False),
                    "organization": Lit("*"),
                    "group": None,
                    "is_blocking": Lit(False),
                },
                1,
                1,
            ),
        },
        1,
        1,
    ),
}
TOKENIZE = {"count": int, "max_model_len": Lit(MAX_MODEL_LEN), "tokens": Seq(int), "token_strs": (None, Seq(str))}
DETOKENIZE = {"prompt": str}


def sim_xfail(reason: str) -> list[Any]:
    """ENGINE_PARAMS with the sim's run marked as a known (strict) failure."""
    return [pytest.param("sim", marks=pytest.mark.xfail(strict=True, reason=reason)), ENGINE_PARAMS[1]]


# ---- scenarios: each runs once per server ----------------------------------------------------------------------------


def sc_completion(s: Server) -> dict[str, Any]:
    prompt = fresh_text("completion", 3)
    resp = s.post("/v1/completions", gen(prompt))
    count = s.ok("/tokenize", {"model": SERVED_NAME, "prompt": prompt})["count"]
    return {"status": resp.status, "content_type": resp.headers.get("content-type"), "body": resp.json(), "n": count}


def sc_completion_stream(s: Server) -> dict[str, Any]:
    prompt = fresh_text("completion-stream", 3)
    body = gen(prompt, stream=True, stream_options={"include_usage": True})
    resp = s.post("/v1/completions", body)
    plain = s.post("/v1/completions", gen(fresh_text("completion-stream-plain", 2), stream=True))
    count = s.ok("/tokenize", {"model": SERVED_NAME, "prompt": prompt})["count"]
    return {
        "status": resp.status,
        "content_type": resp.headers.get("content-type"),
        "events": resp.sse(),
        "ends_with_done": resp.text.endswith("data: [DONE]\n\n"),
        "plain_status": plain.status,
        "plain_events": plain.sse(),
        "n": count,
    }


CHAT_MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name one reason to route by prefix."},
]


def chat_messages(tag: str, sentences: int = 1) -> list[dict[str, str]]:
    return [CHAT_MESSAGES[0], {"role": "user", "content": fresh_text(tag, sentences)}]


def sc_chat(s: Server) -> dict[str, Any]:
    msgs = chat_messages("chat")
    resp = s.post("/v1/chat/completions", gen(messages=msgs))
    count = s.ok("/tokenize", {"model": SERVED_NAME, "messages": msgs})["count"]
    return {"status": resp.status, "content_type": resp.headers.get("content-type"), "body": resp.json(), "n": count}


def sc_chat_stream(s: Server) -> dict[str, Any]:
    msgs = chat_messages("chat-stream")
    resp = s.post("/v1/chat/completions", gen(messages=msgs, stream=True, stream_options={"include_usage": True}))
    count = s.ok("/tokenize", {"model": SERVED_NAME, "messages": msgs})["count"]
    return {
        "status": resp.status,
        "content_type": resp.headers.get("content-type"),
        "events": resp.sse(),
        "ends_with_done": resp.text.endswith("data: [DONE]\n\n"),
        "n": count,
    }


def sc_cached_tokens(s: Server) -> dict[str, Any]:
    text = fresh_text("cached-tokens", 9)
    ext = text + " Then it streams the answer back to the client."
    ids = fresh_ids("cached-tokens", 3 * BS)  # exactly three blocks: the last one is recomputed on a repeat
    tok = {t: s.ok("/tokenize", {"model": SERVED_NAME, "prompt": t})["tokens"] for t in (text, ext)}

    def usage(prompt: Any) -> dict[str, Any]:
        return s.ok("/v1/completions", gen(prompt, max_tokens=1))["usage"]

    return {
        "text_tokens": tok[text],
        "ext_tokens": tok[ext],
        "text": [usage(text), usage(text)],
        "ext": usage(ext),
        "ids": [usage(ids), usage(ids)],
        "ids_prefix": usage(ids[: 2 * BS + 5]),
        "ids_longer": usage([*ids, *fresh_ids("cached-tokens-tail", BS + 3)]),
    }


def sc_chat_cache_creation(s: Server) -> dict[str, Any]:
    msgs = chat_messages("chat-cache-creation", 6)
    n = s.ok("/tokenize", {"model": SERVED_NAME, "messages": msgs})["count"]
    first = s.ok("/v1/chat/completions", gen(messages=msgs, max_tokens=1))["usage"]
    second = s.ok("/v1/chat/completions", gen(messages=msgs, max_tokens=1))["usage"]
    body = gen(messages=msgs, max_tokens=1, stream=True, stream_options={"include_usage": True})
    streamed = s.post("/v1/chat/completions", body).sse()[-2]["usage"]
    return {"n": n, "first": first, "second": second, "streamed": streamed}


def sc_clamped(s: Server) -> dict[str, Any]:
    """max_tokens larger than the room left in the context: vLLM clamps it to max_model_len - prompt."""
    ids = fresh_ids("clamped", MAX_MODEL_LEN - 4)
    body = s.ok("/v1/completions", gen(ids, max_tokens=10))
    return {"usage": body["usage"], "finish_reason": body["choices"][0]["finish_reason"]}


TOKENIZE_CASES = [
    {"prompt": "Hello, world! Ünïcödé ✓ and    spaces\n\ttabs"},
    {"prompt": "<|im_start|>user\nhi<|im_end|>", "return_token_strs": True},
    {"prompt": "def f(x):\n    return x * 2\n", "add_special_tokens": False},
    {"messages": CHAT_MESSAGES},
    {"messages": CHAT_MESSAGES, "add_generation_prompt": False},
    {"messages": CHAT_MESSAGES, "return_token_strs": True},
]
DETOKENIZE_CASES = [[3, 89, 400, 203], list(range(5, 60)), [0, 1, 2, 3, 4], [1000, 1023], []]


def sc_tokenize(s: Server) -> dict[str, Any]:
    tok = [s.post("/tokenize", {"model": SERVED_NAME, **c}) for c in TOKENIZE_CASES]
    first = tok[0].json()["tokens"]
    detok = [s.post("/detokenize", {"model": SERVED_NAME, "tokens": t}) for t in [first, *DETOKENIZE_CASES]]
    return {
        "tokenize": [(r.status, r.json()) for r in tok],
        "detokenize": [(r.status, r.json()) for r in detok],
    }


def sc_models(s: Server) -> dict[str, Any]:
    resp = s.get("/v1/models")
    return {"status": resp.status, "content_type": resp.headers.get("content-type"), "body": resp.json()}


def sc_plain_endpoints(s: Server) -> dict[str, Any]:
    health = s.get("/health")
    version = s.get("/version")
    metrics = s.get("/metrics")
    return {
        "health": (health.status, health.body),
        "version": (version.status, version.json()),
        "metrics_status": metrics.status,
        "metrics_content_type": metrics.headers.get("content-type"),
    }


# ---- metrics ---------------------------------------------------------------------------------------------------------

METRICS_OF_INTEREST = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds",
    "vllm:request_success_total",
]
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass
class Metrics:
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float]
    types: dict[str, str]  # family name -> counter/gauge/histogram/...

    @classmethod
    def parse(cls, text: str) -> Metrics:
        samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        types: dict[str, str] = {}
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(None, 3)
                types[name] = kind.strip()
                continue
            if not line or line.startswith("#"):
                continue
            m = _SAMPLE.match(line)
            assert m, f"unparsable metrics line {line!r}"
            labels = frozenset(_LABEL.findall(m.group(2) or ""))
            samples[(m.group(1), labels)] = float(m.group(3))
        return cls(samples, types)

    def names(self) -> set[str]:
        return {n for n, _ in self.samples}

    def total(self, name: str, **labels: str) -> float:
        want = set(labels.items())
        found = [v for (n, ls), v in self.samples.items() if n == name and want <= ls]
        assert found, f"{name}{labels} not in /metrics"
        return sum(found)

    def label_names(self, name: str) -> set[frozenset[str]]:
        return {frozenset(k for k, _ in ls if k != "le") for n, ls in self.samples.items() if n == name}

    def type_of(self, name: str) -> str | None:
        """A family's type; counters are typed under their _total name (prometheus_client) or without it."""
        return self.types.get(name) or self.types.get(name.removesuffix("_total"))

    def family(self, sample_name: str) -> str | None:
        """The # TYPE family a sample belongs to."""
        for suffix in ("", "_total", "_bucket", "_count", "_sum", "_created"):
            if suffix and sample_name.endswith(suffix) and sample_name[: -len(suffix)] in self.types:
                return sample_name[: -len(suffix)]
            if not suffix and sample_name in self.types:
                return sample_name
        return None


def has_metric(m: Metrics, name: str) -> bool:
    """A counter is there as name (its _total sample), a histogram through its _count/_bucket samples."""
    return name in m.names() or f"{name}_count" in m.names()


COUNTERS = [
    ("vllm:prefix_cache_queries_total", {}),
    ("vllm:prefix_cache_hits_total", {}),
    ("vllm:prompt_tokens_total", {}),
    ("vllm:generation_tokens_total", {}),
    ("vllm:num_preemptions_total", {}),
    ("vllm:request_success_total", {"finished_reason": "length"}),
    ("vllm:request_success_total", {"finished_reason": "stop"}),
    ("vllm:time_to_first_token_seconds_count", {}),
    ("vllm:e2e_request_latency_seconds_count", {}),
    ("vllm:request_prompt_tokens_sum", {}),
    ("vllm:request_generation_tokens_sum", {}),
]


def sc_metrics(s: Server) -> dict[str, Any]:
    before = Metrics.parse(s.metrics_text())
    text = fresh_text("metrics", 7)
    reqs = [
        ("/v1/completions", gen(text, max_tokens=2)),
        ("/v1/completions", gen(text, max_tokens=2)),
        ("/v1/completions", gen(text + " And then some more.", max_tokens=3)),
        ("/v1/chat/completions", gen(messages=chat_messages("metrics", 4), max_tokens=2)),
        ("/v1/completions", gen(fresh_ids("metrics", 2 * BS), max_tokens=1)),
        ("/v1/completions", gen(fresh_ids("metrics", 2 * BS), max_tokens=1)),
    ]
    usages = [s.ok(path, body)["usage"] for path, body in reqs]
    want_queries = sum(u["prompt_tokens"] for u in usages)

    def deltas(after: Metrics) -> dict[str, float]:
        return {f"{n}{sorted(lab.items())}": after.total(n, **lab) - before.total(n, **lab) for n, lab in COUNTERS}

    # vLLM records stats a moment after the response: wait (bounded) until every request is counted.
    deadline = time.monotonic() + 15.0
    while True:
        after = Metrics.parse(s.metrics_text())
        d = deltas(after)
        done = d["vllm:e2e_request_latency_seconds_count[]"] >= len(reqs)
        if (done and d["vllm:prefix_cache_queries_total[]"] >= want_queries) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return {
        "usages": usages,
        "deltas": d,
        "running": after.total("vllm:num_requests_running"),
        "waiting": after.total("vllm:num_requests_waiting"),
        "kv_usage": after.total("vllm:kv_cache_usage_perc"),
        "metrics": after,
    }


# ---- KV events -------------------------------------------------------------------------------------------------------

_GENERIC = msgspec.msgpack.Decoder()


def sc_kv_events(s: Server) -> dict[str, Any]:
    start = s.next_seq()
    tag = "kv-events"
    text = fresh_text(tag, 8)
    ids64 = fresh_ids(tag, 2 * BS)
    sentinel = fresh_ids(tag + "-sentinel", BS + 1)
    salt = f"tenant-{tag}"
    reqs: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", gen(text)),
        ("/v1/completions", gen(text)),  # all cached: nothing new
        ("/v1/completions", gen(text + " The index then answers the router.")),  # only the new blocks
        ("/v1/completions", gen(ids64)),
        ("/v1/completions", gen(ids64)),  # the last block is recomputed (cached <= n - 1) and stored again
        ("/v1/chat/completions", gen(messages=chat_messages(tag, 5))),
        ("/v1/completions", gen(text, cache_salt=salt)),  # same tokens, different hashes
        ("/v1/completions", gen(sentinel)),
    ]
    prompts: list[dict[str, Any]] = []
    for path, body in reqs:
        # max_tokens=1: no generated token is ever computed, so every stored block is all prompt tokens.
        out = s.ok(path, {**body, "max_tokens": 1, "return_token_ids": True})
        pids = out.get("prompt_token_ids") or out["choices"][0]["prompt_token_ids"]
        cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
        prompts.append({"ids": pids, "salt": body.get("cache_salt"), "cached": cached})
    hasher = BlockHasher(BS, HASH_ALGO, None)
    sentinel_hash = hasher.event_hashes(sentinel)[0]
    decoder = KVEventDecoder(token_ids=True)
    deadline = time.monotonic() + 15.0
    while True:
        frames = s.replay(start)
        stored = {h for f in frames for e in decoder.decode_frames(f).batch.events for h in e.block_hashes}
        if sentinel_hash in stored:
            break
        assert time.monotonic() < deadline, f"{s.name}: the sentinel block was not published in 15 s"
        time.sleep(0.2)
    batches = []
    for topic, seq, payload in frames:
        ts, events, dp_rank = _GENERIC.decode(payload)
        batches.append(
            {
                "topic": topic.decode(),
                "seq": int.from_bytes(seq, "big") - start,
                "dp_rank": dp_rank,
                "ts_type": type(ts).__name__,
                "events": events,
                "decoded": [
                    msgspec.structs.asdict(e) for e in decoder.decode_frames([topic, seq, payload]).batch.events
                ],
            }
        )
    live = [f for f in s.drain_sub() if int.from_bytes(f[1], "big") >= start]
    return {"start": start, "prompts": prompts, "batches": batches, "replayed": frames, "live": live}


def expected_block_events(prompts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a vLLM server stores, prompt by prompt, computed from the token ids with llmd's reference hasher."""
    hasher = BlockHasher(BS, HASH_ALGO, None)
    seen: set[int] = set()
    out = []
    for p in prompts:
        ids = p["ids"]
        ref = hasher.event_hashes(ids, cache_salt=p["salt"])
        hit = 0
        while hit < len(ref) and ref[hit] in seen:
            hit += 1
        k = min(hit, (len(ids) - 1) // BS)  # the last prompt token is always computed
        new = ref[k:]
        if new:
            out.append(
                {
                    "block_hashes": new,
                    "parent_block_hash": ref[k - 1] if k else None,
                    "token_ids": ids[k * BS : len(ref) * BS],
                    "block_size": BS,
                }
            )
        seen.update(new)
    return out


# ---- errors ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ErrorCase:
    id: str
    method: str
    path: str
    body: Any = None
    raw: bytes | None = None
    status: int = 400
    type: str | None = "BadRequestError"  # the error body's type; None: `body` gives the whole expected body
    param: Any = None
    body_expected: Any = None
    sim_bug: str | None = None  # the sim departs from vLLM's status/type/param/body (per-engine test xfails)
    sim_msg_bug: str | None = None  # the sim's body differs from vLLM's only in the message (cross test xfails)


LONG_TEXT = "word " * (MAX_MODEL_LEN + 76)
_M = SERVED_NAME
ERROR_CASES = [
    ErrorCase("prompt_too_long", "POST", "/v1/completions", {"model": _M, "prompt": LONG_TEXT, "max_tokens": 1},
              param="input_tokens"),
    ErrorCase("prompt_too_long_stream", "POST", "/v1/completions",
              {"model": _M, "prompt": LONG_TEXT, "max_tokens": 1, "stream": True}, param="input_tokens"),
    ErrorCase("prompt_too_long_chat", "POST", "/v1/chat/completions",
              {"model": _M, "messages": [{"role": "user", "content": LONG_TEXT}], "max_tokens": 1},
              param="input_tokens"),
    ErrorCase("prompt_too_long_token_ids", "POST", "/v1/completions",
              {"model": _M, "prompt": [i % 1000 + 5 for i in range(MAX_MODEL_LEN + 1)], "max_tokens": 1},
              param="input_tokens"),
    ErrorCase("prompt_fills_context_token_ids", "POST", "/v1/completions",
              {"model": _M, "prompt": [i % 1000 + 5 for i in range(MAX_MODEL_LEN)], "max_tokens": 1},
              param="max_tokens"),
    ErrorCase("unknown_model", "POST", "/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 1},
              status=404, type="NotFoundError", param="model"),
    ErrorCase("unknown_model_chat", "POST", "/v1/chat/completions",
              {"model": "nope", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
              status=404, type="NotFoundError", param="model"),
    ErrorCase("unknown_model_tokenize", "POST", "/tokenize", {"model": "nope", "prompt": "x"},
              status=404, type="NotFoundError", param="model"),
    ErrorCase("malformed_json", "POST", "/v1/completions", raw=b"{not json", type="Bad Request", param="body.1"),
    ErrorCase("malformed_json_chat", "POST", "/v1/chat/completions", raw=b"{bad", type="Bad Request",
              param="body.1"),
    ErrorCase("body_not_object", "POST", "/v1/completions", raw=b"[1, 2]", type="Bad Request", param="body"),
    ErrorCase("empty_body", "POST", "/v1/completions", raw=b"", type="Bad Request", param="body"),
    ErrorCase("missing_prompt", "POST", "/v1/completions", {"model": _M, "max_tokens": 1}, param="prompt"),
    ErrorCase("missing_messages", "POST", "/v1/chat/completions", {"model": _M, "max_tokens": 1},
              type="Bad Request", param="body.messages"),
    ErrorCase("missing_tokens", "POST", "/detokenize", {"model": _M}, type="Bad Request", param="body.tokens"),
    ErrorCase("missing_prompt_tokenize", "POST", "/tokenize", {"model": _M}, type="Bad Request", param="body.prompt"),
    ErrorCase("message_missing_role", "POST", "/v1/chat/completions",
              {"model": _M, "messages": [{"content": "x"}], "max_tokens": 1}, type="Bad Request",
              param="body.messages.0.ChatCompletionDeveloperMessageParam.role"),
    ErrorCase("empty_messages", "POST", "/v1/chat/completions", {"model": _M, "messages": [], "max_tokens": 2}),
    ErrorCase("max_tokens_too_large", "POST", "/v1/completions", {"model": _M, "prompt": "hi", "max_tokens": 5000},
              param="max_tokens"),
    ErrorCase("max_completion_tokens_too_large", "POST", "/v1/chat/completions",
              {"model": _M, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5000},
              param="max_completion_tokens"),
    ErrorCase("max_tokens_zero", "POST", "/v1/completions", {"model": _M, "prompt": "hi", "max_tokens": 0},
              param="max_tokens"),
    ErrorCase("max_tokens_not_int", "POST", "/v1/completions", {"model": _M, "prompt": "hi", "max_tokens": "abc"},
              type="Bad Request", param="body.max_tokens"),
    ErrorCase("negative_temperature", "POST", "/v1/completions",
              {"model": _M, "prompt": "hi", "max_tokens": 1, "temperature": -1}, param="temperature"),
    ErrorCase("token_out_of_vocab", "POST", "/v1/completions", {"model": _M, "prompt": [1, 5000], "max_tokens": 1}),
    ErrorCase("stream_options_without_stream", "POST", "/v1/completions",
              {"model": _M, "prompt": "hi", "max_tokens": 1, "stream_options": {"include_usage": True}},
              param="stream_options"),
    ErrorCase("n_with_greedy", "POST", "/v1/completions",
              {"model": _M, "prompt": "hi", "max_tokens": 1, "n": 2, "temperature": 0}),
    ErrorCase("logprobs_over_max", "POST", "/v1/completions",
              {"model": _M, "prompt": "hi", "max_tokens": 1, "logprobs": 50}, param="logprobs"),
    ErrorCase("detokenize_out_of_vocab", "POST", "/detokenize", {"model": _M, "tokens": [5000]}, status=200,
              type=None, body_expected={"prompt": ""}),
    ErrorCase("unknown_route", "GET", "/no/such/route", status=404, type=None, body_expected={"detail": "Not Found"}),
    ErrorCase("wrong_method", "GET", "/v1/completions", status=405, type=None,
              body_expected={"detail": "Method Not Allowed"}),
    ErrorCase("wrong_method_post_on_get", "POST", "/v1/models", status=405, type=None,
              body_expected={"detail": "Method Not Allowed"}),
    # The order of vLLM's checks: renderer (length), sampling parameters (max_tokens from the room left, greedy n),
    # then the engine's input checks (max logprobs, vocabulary).
    ErrorCase("prompt_fills_context_out_of_vocab", "POST", "/v1/completions",
              {"model": _M, "prompt": [i % 1000 + 5 for i in range(MAX_MODEL_LEN - 1)] + [5000], "max_tokens": 1},
              param="max_tokens"),
    ErrorCase("prompt_too_long_out_of_vocab", "POST", "/v1/completions",
              {"model": _M, "prompt": [i % 1000 + 5 for i in range(MAX_MODEL_LEN)] + [5000], "max_tokens": 1},
              param="input_tokens"),
    ErrorCase("prompt_too_long_token_ids_by_more", "POST", "/v1/completions",
              {"model": _M, "prompt": [i % 1000 + 5 for i in range(MAX_MODEL_LEN + 6)], "max_tokens": 1},
              param="input_tokens"),
    ErrorCase("logprobs_over_max_out_of_vocab", "POST", "/v1/completions",
              {"model": _M, "prompt": [5, 6, 5000], "max_tokens": 1, "logprobs": 30}, param="logprobs"),
    ErrorCase("n_with_greedy_and_logprobs_over_max", "POST", "/v1/completions",
              {"model": _M, "prompt": "hi", "max_tokens": 1, "logprobs": 30, "n": 2, "temperature": 0}),
    ErrorCase("negative_temperature_with_n", "POST", "/v1/completions",
              {"model": _M, "prompt": "hi", "max_tokens": 1, "temperature": -1, "n": 2}, param="temperature"),
    ErrorCase("min_tokens_over_max_tokens", "POST", "/v1/completions",
              {"model": _M, "prompt": "hi", "max_tokens": 3, "min_tokens": 5}),
    ErrorCase("n_zero", "POST", "/v1/completions", {"model": _M, "prompt": "hi", "max_tokens": 3, "n": 0}),
    ErrorCase("n_too_large", "POST", "/v1/completions", {"model": _M, "prompt": "hi", "max_tokens": 3, "n": 20000}),
    ErrorCase("prompt_empty_list", "POST", "/v1/completions", {"model": _M, "prompt": [], "max_tokens": 1}),
    ErrorCase("prompt_mixed_list", "POST", "/v1/completions", {"model": _M, "prompt": [[5, 6], "x"], "max_tokens": 1},
              type="Bad Request", param="body.prompt.0"),
    ErrorCase("prompt_negative_id", "POST", "/v1/completions", {"model": _M, "prompt": [-1, 5], "max_tokens": 1},
              type="Bad Request", param="body.prompt.0"),
    ErrorCase("prompt_fractional_id", "POST", "/v1/completions", {"model": _M, "prompt": [1.5], "max_tokens": 1},
              type="Bad Request", param="body.prompt.0"),
    ErrorCase("logprobs_not_int", "POST", "/v1/completions",
              {"model": _M, "prompt": "hi", "max_tokens": 1, "logprobs": "2"}, param="logprobs"),
    ErrorCase("logprobs_negative", "POST", "/v1/completions",
              {"model": _M, "prompt": "hi", "max_tokens": 1, "logprobs": -2}, param="logprobs"),
    ErrorCase("logprobs_fractional", "POST", "/v1/completions",
              {"model": _M, "prompt": "hi", "max_tokens": 1, "logprobs": 2.5}, type="Bad Request",
              param="body.logprobs"),
    ErrorCase("logprobs_all", "POST", "/v1/completions",
              {"model": _M, "prompt": "hi", "max_tokens": 1, "logprobs": -1}, param="logprobs"),
    ErrorCase("prompt_logprobs_over_max", "POST", "/v1/completions",
              {"model": _M, "prompt": "hi", "max_tokens": 1, "prompt_logprobs": 21}, param="prompt_logprobs"),
    ErrorCase("top_logprobs_without_logprobs", "POST", "/v1/chat/completions",
              {"model": _M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "top_logprobs": 2},
              param="top_logprobs"),
    ErrorCase("top_logprobs_not_int", "POST", "/v1/chat/completions",
              {"model": _M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logprobs": True,
               "top_logprobs": "x"}, param="top_logprobs"),
    ErrorCase("top_logprobs_over_max", "POST", "/v1/chat/completions",
              {"model": _M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logprobs": True,
               "top_logprobs": 21}, param="logprobs"),
    # A chat message against every member of vLLM's ChatCompletionMessageParam union.
    ErrorCase("message_empty", "POST", "/v1/chat/completions", {"model": _M, "messages": [{}], "max_tokens": 1},
              type="Bad Request", param="body.messages.0.ChatCompletionDeveloperMessageParam.content"),
    ErrorCase("message_not_object", "POST", "/v1/chat/completions", {"model": _M, "messages": ["hi"], "max_tokens": 1},
              type="Bad Request", param="body.messages.0.ChatCompletionDeveloperMessageParam"),
    ErrorCase("message_role_not_string", "POST", "/v1/chat/completions",
              {"model": _M, "messages": [{"role": 3, "content": "x"}], "max_tokens": 1}, type="Bad Request",
              param="body.messages.0.ChatCompletionDeveloperMessageParam.role"),
    ErrorCase("message_content_null", "POST", "/v1/chat/completions",
              {"model": _M, "messages": [{"role": "user", "content": None}], "max_tokens": 1}, type="Bad Request",
              param="body.messages.0.ChatCompletionDeveloperMessageParam.content"),
    ErrorCase("message_content_number", "POST", "/v1/chat/completions",
              {"model": _M, "messages": [{"role": "user", "content": 5}], "max_tokens": 1}, type="Bad Request",
              param="body.messages.0.ChatCompletionDeveloperMessageParam.content"),
    ErrorCase("message_name_number", "POST", "/v1/chat/completions",
              {"model": _M, "messages": [{"role": "user", "content": "x", "name": 5}], "max_tokens": 1},
              type="Bad Request", param="body.messages.0.ChatCompletionDeveloperMessageParam.role"),
    ErrorCase("message_tool_call_id_number", "POST", "/v1/chat/completions",
              {"model": _M, "messages": [{"role": "tool", "content": "x", "tool_call_id": 5}], "max_tokens": 1},
              type="Bad Request", param="body.messages.0.ChatCompletionDeveloperMessageParam.role"),
    ErrorCase("second_message_missing_role", "POST", "/v1/chat/completions",
              {"model": _M, "max_tokens": 1,
               "messages": [{"role": "user", "content": "x"}, {"content": [{"type": "text", "text": "y"}]}]},
              type="Bad Request", param="body.messages.1.ChatCompletionDeveloperMessageParam.role"),
    ErrorCase("message_missing_role_and_bad_max_tokens", "POST", "/v1/chat/completions",
              {"model": _M, "messages": [{"content": "x"}], "max_tokens": "abc"}, type="Bad Request",
              param="body.messages.0.ChatCompletionDeveloperMessageParam.role"),
    ErrorCase("tokenize_message_missing_role", "POST", "/tokenize", {"model": _M, "messages": [{"content": "x"}]},
              type="Bad Request", param="body.prompt"),
    ErrorCase("tokenize_prompt_not_string", "POST", "/tokenize", {"model": _M, "prompt": 3}, type="Bad Request",
              param="body.prompt"),
    ErrorCase("tokenize_empty_body", "POST", "/tokenize", {}, type="Bad Request", param="body.prompt"),
    ErrorCase("tokenize_empty_messages", "POST", "/tokenize", {"model": _M, "messages": []}),
    ErrorCase("detokenize_partly_out_of_vocab", "POST", "/detokenize", {"model": _M, "tokens": [5, 5000, 6]},
              status=200, type=None, body_expected=None),
]  # fmt: skip
ERRORS_BY_ID = {c.id: c for c in ERROR_CASES}


def sc_error(s: Server, case_id: str) -> dict[str, Any]:
    c = ERRORS_BY_ID[case_id]
    resp = s.request(c.method, c.path, c.body, raw=c.raw)
    return {"status": resp.status, "content_type": resp.headers.get("content-type"), "body": resp.json()}


def error_params(cross: bool) -> list[Any]:
    out = []
    for c in ERROR_CASES:
        reason = c.sim_bug or (c.sim_msg_bug if cross else None)
        if cross:
            marks = [pytest.mark.vllm] + ([pytest.mark.xfail(strict=True, reason=reason)] if reason else [])
            out.append(pytest.param(c.id, id=c.id, marks=marks))
        else:
            sim_marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            out.append(pytest.param("sim", c.id, id=f"{c.id}-sim", marks=sim_marks))
            out.append(pytest.param("vllm", c.id, id=f"{c.id}-vllm", marks=[pytest.mark.vllm]))
    return out


def sc_stream_engine_errors(s: Server) -> dict[str, Any]:
    """Errors vLLM meets in the engine (max logprobs, vocabulary) after a stream has started: 200, an error event."""
    out = {}
    for name, path, body in (
        ("out_of_vocab", "/v1/completions", {"model": _M, "prompt": [5, 6, 5000], "max_tokens": 1, "stream": True}),
        ("logprobs", "/v1/completions", {"model": _M, "prompt": "hi", "max_tokens": 1, "logprobs": 30, "stream": True}),
        ("chat_logprobs", "/v1/chat/completions",
         {"model": _M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "logprobs": True,
          "top_logprobs": 30, "stream": True}),
        # Parameter checks happen before the stream starts: a plain 400.
        ("greedy_n", "/v1/completions",
         {"model": _M, "prompt": "hi", "max_tokens": 1, "n": 2, "temperature": 0, "stream": True}),
    ):  # fmt: skip
        resp = s.post(path, body)
        out[name] = {"status": resp.status, "content_type": resp.headers.get("content-type"), "text": resp.text}
    return out


def _surface(resp: Any) -> dict[str, Any]:
    keep = ("allow", "vary", "content-type", "server")
    headers = {k: v for k, v in resp.headers.items() if k in keep or k.startswith("access-control-")}
    return {"status": resp.status, "headers": headers, "body": resp.text}


def sc_http_surface(s: Server) -> dict[str, Any]:
    """What any HTTP client sees around the API: CORS (vLLM allows no origin), the Vary header, 404/405 with Allow."""
    origin = {"Origin": "http://client.example"}
    preflight = {**origin, "Access-Control-Request-Method": "POST"}
    return {
        "models": _surface(s.get("/v1/models", headers=origin)),
        "completion": _surface(s.post("/v1/completions", gen(fresh_text("http-surface", 1), max_tokens=1))),
        "bad_request": _surface(s.post("/v1/completions", {"model": _M, "prompt": "hi", "max_tokens": 0})),
        "health": _surface(s.get("/health")),
        "metrics_vary": s.get("/metrics").headers.get("vary"),
        "head_health": _surface(s.request("HEAD", "/health")),
        "options_plain": _surface(s.request("OPTIONS", "/v1/completions")),
        "delete_ping": _surface(s.request("DELETE", "/ping")),
        "unknown": _surface(s.get("/v2/nothing", headers=origin)),
        "preflight": _surface(s.request("OPTIONS", "/v1/completions", headers=preflight)),
        "preflight_headers": _surface(
            s.request(
                "OPTIONS",
                "/v1/chat/completions",
                headers={**preflight, "Access-Control-Request-Headers": "content-type, x-foo"},
            )
        ),
    }


def sc_http_metrics(s: Server) -> dict[str, Any]:
    """prometheus-fastapi-instrumentator's counters over a known set of requests (health and metrics excluded)."""
    before = Metrics.parse(s.metrics_text())
    s.ok("/v1/completions", gen(fresh_text("http-metrics", 1), max_tokens=1))
    s.ok("/v1/completions", gen(fresh_text("http-metrics", 1), max_tokens=1))
    s.post("/v1/completions", {"model": _M, "prompt": "hi", "max_tokens": 0})
    s.ok("/v1/chat/completions", gen(messages=chat_messages("http-metrics"), max_tokens=1))
    s.get("/v1/models")
    s.get("/health")
    s.get("/version")
    s.get("/no/such/route")
    s.post("/v1/models")
    s.ok("/tokenize", {"model": _M, "prompt": "hi"})

    def moves(after: Metrics) -> dict[str, float]:
        out = {}
        for (name, labels), value in after.samples.items():
            if name in (
                "http_requests_total",
                "http_request_size_bytes_count",
                "http_response_size_bytes_count",
                "http_request_duration_seconds_count",
                "http_request_duration_highr_seconds_count",
            ):
                old = before.samples.get((name, labels), 0.0)
                if value != old:
                    out[f"{name}{sorted(labels)}"] = value - old
        return out  # fmt: skip

    deadline = time.monotonic() + 15.0
    while True:
        after = Metrics.parse(s.metrics_text())
        d = moves(after)
        if d.get("http_request_duration_highr_seconds_count[]", 0) >= 8 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return {"moves": d, "metrics": after}


def logprob_view(obj: Any) -> Any:
    """A logprobs-bearing body with the generated text and numbers abstracted away: dicts keyed by token text or id
    become markers (two alternatives may decode alike and share a key, so not even their sizes are fixed), lists keep
    their lengths, values their types."""
    if isinstance(obj, dict):
        if obj and all(isinstance(v, float | int) and not isinstance(v, bool) for v in obj.values()):
            return "token-dict"
        if obj and all(k.isdigit() for k in obj):
            return ("id-dict", sorted({json.dumps(logprob_view(v)) for v in obj.values()}))
        return {k: (type(v).__name__ if k == "bytes" else logprob_view(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [logprob_view(x) for x in obj]
    return type(obj).__name__


LOGPROB_REQUESTS = [
    ("completion", "/v1/completions", {"max_tokens": 3, "logprobs": 2}),
    ("completion_echo", "/v1/completions", {"max_tokens": 2, "logprobs": 1, "echo": True}),
    ("completion_prompt_logprobs", "/v1/completions", {"max_tokens": 2, "prompt_logprobs": 1}),
    ("completion_token_ids", "/v1/completions", {"max_tokens": 2, "logprobs": 1, "return_tokens_as_token_ids": True}),
    ("completion_stream", "/v1/completions", {"max_tokens": 3, "logprobs": 2, "stream": True}),
    ("completion_echo_stream", "/v1/completions", {"max_tokens": 2, "logprobs": 1, "echo": True, "stream": True}),
    ("chat", "/v1/chat/completions", {"max_tokens": 3, "logprobs": True, "top_logprobs": 2}),
    ("chat_no_top", "/v1/chat/completions", {"max_tokens": 2, "logprobs": True}),
    ("chat_prompt_logprobs", "/v1/chat/completions",
     {"max_tokens": 2, "logprobs": True, "top_logprobs": 1, "prompt_logprobs": 1}),
    ("chat_echo", "/v1/chat/completions", {"max_tokens": 2, "echo": True}),
    ("chat_stream", "/v1/chat/completions", {"max_tokens": 3, "logprobs": True, "top_logprobs": 2, "stream": True}),
]  # fmt: skip


def sc_logprobs(s: Server) -> dict[str, Any]:
    """Greedy requests for logprobs in every shape vLLM has (greedy: the sampled token is the top-1)."""
    out = {}
    for name, path, extra in LOGPROB_REQUESTS:
        tag = f"logprobs-{name}"
        if path == "/v1/chat/completions":
            body = gen(messages=chat_messages(tag), **extra)
        else:
            body = gen(fresh_text(tag, 1), **extra)
        resp = s.post(path, body)
        assert resp.status == 200, f"{s.name} {name}: {resp.status} {resp.text[:300]}"
        out[name] = resp.sse() if extra.get("stream") else resp.json()
    return out


# ======================================================================================================================
# Per-engine tests: each engine against the shape spec.
# ======================================================================================================================


def test_health(engine: Server, observe: Any) -> None:
    o = observe(sc_plain_endpoints, engine)
    assert o["health"] == (200, b"")
    assert o["version"][0] == 200 and isinstance(o["version"][1]["version"], str)
    assert o["metrics_status"] == 200


def test_models(engine: Server, observe: Any) -> None:
    o = observe(sc_models, engine)
    assert o["status"] == 200 and o["content_type"] == "application/json"
    assert_spec(o["body"], MODELS, what="/v1/models")
    assert o["body"]["data"][0]["root"] == str(engine.model_dir)


def test_completion(engine: Server, observe: Any) -> None:
    o = observe(sc_completion, engine)
    assert o["status"] == 200 and o["content_type"] == "application/json"
    body = o["body"]
    assert_spec(body, COMPLETION, what="completion")
    u = body["usage"]
    assert u["prompt_tokens"] == o["n"]
    assert u["completion_tokens"] == 3
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert u["prompt_tokens_details"]["cached_tokens"] == 0


def check_completion_stream(events: list[Any], with_usage: bool) -> None:
    assert events[-1] == "[DONE]"
    chunks = events[:-2] if with_usage else events[:-1]
    assert len(chunks) == 3, "one chunk per generated token"
    for c in chunks[:-1]:
        assert_spec(c, COMPLETION_CHUNK, what="stream chunk")
    assert_spec(chunks[-1], COMPLETION_LAST_CHUNK if with_usage else COMPLETION_LAST_CHUNK_NO_USAGE, what="last chunk")
    if with_usage:
        assert_spec(events[-2], COMPLETION_USAGE_CHUNK, what="usage chunk")
    assert len({c["id"] for c in events[:-1]}) == 1, "every chunk of a stream has the same id"


def test_completion_stream(engine: Server, observe: Any) -> None:
    o = observe(sc_completion_stream, engine)
    assert o["status"] == 200 and o["content_type"] == "text/event-stream; charset=utf-8"
    assert o["ends_with_done"]
    check_completion_stream(o["events"], with_usage=True)
    u = o["events"][-2]["usage"]
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (o["n"], 3, o["n"] + 3)
    assert u["prompt_tokens_details"] == {"cached_tokens": 0}
    assert o["plain_status"] == 200
    check_completion_stream(o["plain_events"], with_usage=False)


def test_chat(engine: Server, observe: Any) -> None:
    o = observe(sc_chat, engine)
    assert o["status"] == 200 and o["content_type"] == "application/json"
    assert_spec(o["body"], CHAT, what="chat completion")
    u = o["body"]["usage"]
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (o["n"], 3, o["n"] + 3)


def test_chat_stream(engine: Server, observe: Any) -> None:
    o = observe(sc_chat_stream, engine)
    assert o["status"] == 200 and o["content_type"] == "text/event-stream; charset=utf-8"
    assert o["ends_with_done"]
    ev = o["events"]
    assert ev[-1] == "[DONE]"
    assert_spec(ev[0], CHAT_ROLE_CHUNK, what="role chunk")
    content = ev[1:-2]
    assert len(content) == 3, "one chunk per generated token"
    for c in content[:-1]:
        assert_spec(c, CHAT_CHUNK, what="chat chunk")
    assert_spec(content[-1], CHAT_LAST_CHUNK, what="last chat chunk")
    assert_spec(ev[-2], CHAT_USAGE_CHUNK, what="chat usage chunk")
    u = ev[-2]["usage"]
    assert (u["prompt_tokens"], u["completion_tokens"]) == (o["n"], 3)
    assert len({c["id"] for c in ev[:-1]}) == 1


def test_chat_created_cache_tokens(engine: Server, observe: Any) -> None:
    o = observe(sc_chat_cache_creation, engine)
    n = o["n"]
    assert n > 2 * BS
    first, second, streamed = (o[k]["prompt_tokens_details"] for k in ("first", "second", "streamed"))
    assert first == {"cached_tokens": 0, "created_cache_tokens": full_blocks(n), "multimodal_tokens": None}
    cached = vllm_cached(n, full_blocks(n))
    assert second == {
        "cached_tokens": cached,
        "created_cache_tokens": full_blocks(n) - cached,
        "multimodal_tokens": None,
    }
    assert streamed == {"cached_tokens": cached, "created_cache_tokens": full_blocks(n) - cached}


def test_cached_tokens(engine: Server, observe: Any) -> None:
    o = observe(sc_cached_tokens, engine)
    n = len(o["text_tokens"])
    assert n > 4 * BS
    first, again = (u["prompt_tokens_details"]["cached_tokens"] for u in o["text"])
    assert [u["prompt_tokens"] for u in o["text"]] == [n, n]
    assert first == 0
    assert again == (n - 1) // BS * BS
    # An extended prompt hits the blocks of the common prefix.
    ext = o["ext_tokens"]
    common = next((i for i, (a, b) in enumerate(zip(o["text_tokens"], ext, strict=False)) if a != b), min(n, len(ext)))
    assert o["ext"]["prompt_tokens"] == len(ext)
    assert o["ext"]["prompt_tokens_details"]["cached_tokens"] == vllm_cached(len(ext), full_blocks(common))
    # 96 token ids: the repeat reuses 2 blocks, not 3 (the last token is always computed).
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in o["ids"]] == [0, 2 * BS]
    assert o["ids_prefix"]["prompt_tokens_details"]["cached_tokens"] == 2 * BS
    assert o["ids_longer"]["prompt_tokens_details"]["cached_tokens"] == 3 * BS


def test_max_tokens_clamped_to_context(engine: Server, observe: Any) -> None:
    o = observe(sc_clamped, engine)
    assert o["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 4
    assert o["usage"]["completion_tokens"] == 4
    assert o["finish_reason"] == "length"


def test_tokenize_detokenize(engine: Server, observe: Any) -> None:
    o = observe(sc_tokenize, engine)
    for case, (status, body) in zip(TOKENIZE_CASES, o["tokenize"], strict=True):
        assert status == 200, body
        assert_spec(body, TOKENIZE, what=f"/tokenize {case}")
        assert body["count"] == len(body["tokens"])
        assert (body["token_strs"] is not None) == bool(case.get("return_token_strs"))
        if body["token_strs"] is not None:
            assert len(body["token_strs"]) == body["count"]
    for status, body in o["detokenize"]:
        assert status == 200, body
        assert_spec(body, DETOKENIZE, what="/detokenize")
    assert o["detokenize"][0][1]["prompt"] == TOKENIZE_CASES[0]["prompt"], "tokenize/detokenize round trip"
    with_gen, without = o["tokenize"][3][1], o["tokenize"][4][1]
    assert with_gen["tokens"][: without["count"]] == without["tokens"]
    assert with_gen["count"] > without["count"], "add_generation_prompt (default) appends the assistant header"


def test_metric_names(engine: Server, observe: Any) -> None:
    m = observe(sc_metrics, engine)["metrics"]
    missing = [n for n in METRICS_OF_INTEREST if not has_metric(m, n)]
    assert not missing, f"{engine.name} /metrics lacks {missing}"
    for n in METRICS_OF_INTEREST:
        assert m.type_of(n) in ("counter", "gauge", "histogram"), (n, m.type_of(n))
        labels = m.label_names(n if n in m.names() else f"{n}_count")
        assert all({"engine", "model_name"} <= ls for ls in labels), (n, labels)
    assert m.types["vllm:time_to_first_token_seconds"] == "histogram"
    assert m.type_of("vllm:prefix_cache_queries_total") == "counter"
    assert m.types["vllm:kv_cache_usage_perc"] == "gauge"


def test_prefix_cache_counters(engine: Server, observe: Any) -> None:
    o = observe(sc_metrics, engine)
    u = o["usages"]
    d = o["deltas"]
    assert d["vllm:prefix_cache_queries_total[]"] == sum(x["prompt_tokens"] for x in u)
    assert d["vllm:prefix_cache_hits_total[]"] == sum(x["prompt_tokens_details"]["cached_tokens"] for x in u)
    assert d["vllm:prefix_cache_hits_total[]"] > 0
    assert d["vllm:prompt_tokens_total[]"] == sum(x["prompt_tokens"] for x in u)
    assert d["vllm:generation_tokens_total[]"] == sum(x["completion_tokens"] for x in u)
    assert d["vllm:request_success_total[('finished_reason', 'length')]"] == len(u)
    assert d["vllm:time_to_first_token_seconds_count[]"] == len(u)
    assert d["vllm:num_preemptions_total[]"] == 0
    assert o["running"] == 0 and o["waiting"] == 0
    assert 0.0 <= o["kv_usage"] <= 1.0


def test_kv_events(engine: Server, observe: Any) -> None:
    o = observe(sc_kv_events, engine)
    batches = o["batches"]
    assert [b["seq"] for b in batches] == list(range(len(batches))), "consecutive seq numbers from the start"
    assert all(b["topic"] == KV_TOPIC and b["dp_rank"] == 0 and b["ts_type"] == "float" for b in batches)
    events = [e for b in batches for e in b["decoded"]]
    assert all(set(e) >= {"block_hashes", "parent_block_hash", "token_ids"} for e in events), "BlockStored only"
    want = expected_block_events(o["prompts"])
    # text, its extension, 64 ids, the same 64 ids (last block stored again), chat, salted text, sentinel.
    assert len(want) == 7 and want[3]["block_hashes"] == want[2]["block_hashes"][1:]
    got = [{k: e[k] for k in ("block_hashes", "parent_block_hash", "token_ids", "block_size")} for e in events]
    assert got == want, "BlockStored events differ from the reference hasher's blocks"
    assert {h for e in events for h in e["block_hashes"]} == {h for e in want for h in e["block_hashes"]}
    for e in events:
        assert (e["medium"], e["lora_id"], e["lora_name"], e["group_idx"]) == ("GPU", None, None, 0)
        assert e["kv_cache_spec_kind"] == "full_attention"
    # The live PUB stream carries the very frames the replay socket buffered.
    assert [list(f) for f in o["live"]] == [list(f) for f in o["replayed"]]


@pytest.mark.parametrize("engine,case_id", error_params(cross=False), indirect=["engine"])
def test_error(engine: Server, case_id: str, observe: Any) -> None:
    c = ERRORS_BY_ID[case_id]
    o = observe(sc_error, engine, case_id)
    assert o["status"] == c.status, o["body"]
    assert o["content_type"] == "application/json"
    if c.type is None:
        if c.body_expected is not None:
            assert o["body"] == c.body_expected
        return
    assert_spec(o["body"], ERROR, what="error body")
    err = o["body"]["error"]
    assert (err["type"], err["param"], err["code"]) == (c.type, c.param, c.status), err


def test_logprobs(engine: Server) -> None:
    body = engine.ok("/v1/completions", gen(fresh_text("logprobs", 1), max_tokens=2, logprobs=2))
    lp = body["choices"][0]["logprobs"]
    assert_spec(
        lp, {"text_offset": Seq(int, 2, 2), "token_logprobs": Seq(float, 2, 2), "tokens": Seq(str, 2, 2),
             "top_logprobs": Seq(dict, 2, 2)}, what="completion logprobs"
    )  # fmt: skip
    chat = engine.ok("/v1/chat/completions", gen(messages=chat_messages("logprobs"), logprobs=True, top_logprobs=2))
    top = {"token": str, "logprob": float, "bytes": Seq(int)}
    assert_spec(chat["choices"][0]["logprobs"], {"content": Seq({**top, "top_logprobs": Seq(top, 2, 2)}, 3, 3)})


def test_logprob_values(engine: Server, observe: Any) -> None:
    """What holds of any model's greedy logprobs: log-probabilities, the sampled token first and the most likely,
    tokens that spell the text, offsets that follow them, bytes of the token strings."""
    o = observe(sc_logprobs, engine)
    c = o["completion"]["choices"][0]
    lp = c["logprobs"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    for value, top in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert value <= 0 and 1 <= len(top) <= 2
        assert all(v <= value + 1e-6 for v in top.values()), "greedy: the sampled token is the most likely"
    echo = o["completion_echo"]["choices"][0]
    elp = echo["logprobs"]
    n_prompt = o["completion_echo"]["usage"]["prompt_tokens"]
    assert len(elp["tokens"]) == n_prompt + 2
    assert elp["token_logprobs"][0] is None and elp["top_logprobs"][0] is None
    assert len(echo["prompt_logprobs"]) == n_prompt and echo["prompt_logprobs"][0] is None
    for pos in echo["prompt_logprobs"][1:]:
        assert 1 <= len(pos) <= 2 and all(set(e) == {"logprob", "rank", "decoded_token"} for e in pos.values())
    plp = o["completion_prompt_logprobs"]
    assert (
        plp["choices"][0]["logprobs"] is None
        and len(plp["choices"][0]["prompt_logprobs"]) == plp["usage"]["prompt_tokens"]
    )
    assert plp["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, "prompt logprobs skip the prefix cache"
    ids = o["completion_token_ids"]["choices"][0]["logprobs"]
    assert all(re.fullmatch(r"token_id:\d+", t) for t in ids["tokens"])
    stream = [e for e in o["completion_stream"][:-1] if e["choices"]]
    offsets = [x for e in stream for x in e["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == sorted(offsets) and offsets[0] == 0
    echo_stream = o["completion_echo_stream"]
    assert echo_stream[0]["choices"][0]["prompt_token_ids"] is not None, "the echo chunk carries the prompt ids"
    chat = o["chat"]["choices"][0]["logprobs"]["content"]
    for entry in chat:
        assert entry["bytes"] == list(entry["token"].encode())
        values = [t["logprob"] for t in entry["top_logprobs"]]
        assert values == sorted(values, reverse=True) and entry["top_logprobs"][0]["token"] == entry["token"]
    assert all(e["top_logprobs"] == [] for e in o["chat_no_top"]["choices"][0]["logprobs"]["content"])
    assert o["chat_prompt_logprobs"]["prompt_logprobs"][0] is None
    assert o["chat_echo"]["prompt_logprobs"] is not None, "chat echo asks for prompt logprobs (top_logprobs=0)"
    assert all(len(p) == 1 for p in o["chat_echo"]["prompt_logprobs"][1:])


def test_stream_engine_errors(engine: Server, observe: Any) -> None:
    o = observe(sc_stream_engine_errors, engine)
    for name in ("out_of_vocab", "logprobs", "chat_logprobs"):
        r = o[name]
        assert (r["status"], r["content_type"]) == (200, "text/event-stream; charset=utf-8"), r
        events = r["text"].split("\n\n")
        assert events[0].startswith('data: {"error": {') and events[1] == "data: [DONE]", r["text"]
    assert o["greedy_n"]["status"] == 400


def test_http_surface(engine: Server, observe: Any) -> None:
    o = observe(sc_http_surface, engine)
    for name in ("models", "completion", "bad_request", "health", "head_health", "unknown", "options_plain"):
        assert o[name]["headers"].get("vary") == "Origin", (name, o[name])
        assert not any(k.startswith("access-control-") for k in o[name]["headers"]), (name, o[name])
    assert o["metrics_vary"] == "Origin"
    assert (o["head_health"]["status"], o["head_health"]["headers"].get("allow")) == (405, "GET")
    assert (o["options_plain"]["status"], o["options_plain"]["headers"].get("allow")) == (405, "POST")
    assert (o["delete_ping"]["status"], o["delete_ping"]["headers"].get("allow")) == (405, "GET")
    assert o["unknown"]["status"] == 404 and json.loads(o["unknown"]["body"]) == {"detail": "Not Found"}
    assert (o["preflight"]["status"], o["preflight"]["body"]) == (400, "Disallowed CORS origin")
    assert o["preflight_headers"]["headers"]["access-control-allow-headers"] == "content-type, x-foo"


def test_http_metrics(engine: Server, observe: Any) -> None:
    o = observe(sc_http_metrics, engine)
    d = o["moves"]
    key = "http_requests_total[('handler', '{}'), ('method', '{}'), ('status', '{}')]"
    assert d[key.format("/v1/completions", "POST", "2xx")] == 2
    assert d[key.format("/v1/completions", "POST", "4xx")] == 1
    assert d[key.format("/v1/chat/completions", "POST", "2xx")] == 1
    assert d[key.format("none", "GET", "4xx")] == 1 and d[key.format("none", "POST", "4xx")] == 1
    assert not any("/health" in k or "/version" in k or "/metrics" in k for k in d), "excluded handlers"
    m = o["metrics"]
    for family, kind in (("http_requests_total", "counter"), ("http_request_size_bytes", "summary"),
                         ("http_response_size_bytes", "summary"), ("http_request_duration_seconds", "histogram"),
                         ("http_request_duration_highr_seconds", "histogram"),
                         ("process_cpu_seconds_total", "counter"), ("process_resident_memory_bytes", "gauge"),
                         ("python_info", "gauge"), ("python_gc_collections_total", "counter")):  # fmt: skip
        assert m.type_of(family) == kind, (family, m.type_of(family))


# ======================================================================================================================
# Cross tests: the simulated engine against real vLLM, directly.
# ======================================================================================================================


@pytest.mark.vllm
def test_same_plain_endpoints(both: dict[str, Server], observe: Any) -> None:
    sim, real = (observe(sc_plain_endpoints, both[k]) for k in ("sim", "vllm"))
    assert sim == real


@pytest.mark.vllm
def test_same_models(both: dict[str, Server], observe: Any) -> None:
    sim, real = (observe(sc_models, both[k]) for k in ("sim", "vllm"))
    masked = frozenset({"body.data.*.created", "body.data.*.permission.*.id", "body.data.*.permission.*.created"})
    assert drop(sim, masked) == drop(real, masked)
    assert shape(sim) == shape(real)


@pytest.mark.vllm
@pytest.mark.parametrize("scenario", [sc_completion, sc_chat], ids=["completion", "chat"])
def test_same_response(both: dict[str, Server], observe: Any, scenario: Any) -> None:
    sim, real = (observe(scenario, both[k]) for k in ("sim", "vllm"))
    assert (sim["status"], sim["content_type"]) == (real["status"], real["content_type"])
    assert shape(sim["body"]) == shape(real["body"]), "keys/types differ"
    assert sim["body"]["usage"] == real["body"]["usage"], "usage differs"
    assert sim["n"] == real["n"]
    assert sim["body"]["system_fingerprint"].rsplit("-", 1)[0] == real["body"]["system_fingerprint"].rsplit("-", 1)[0]


@pytest.mark.vllm
@pytest.mark.parametrize("scenario", [sc_completion_stream, sc_chat_stream], ids=["completion", "chat"])
def test_same_stream(both: dict[str, Server], observe: Any, scenario: Any) -> None:
    sim, real = (observe(scenario, both[k]) for k in ("sim", "vllm"))
    keys = ("status", "content_type", "ends_with_done", "n")
    assert [sim[k] for k in keys] == [real[k] for k in keys]
    s_ev, r_ev = sim["events"], real["events"]
    assert [shape(e) for e in s_ev] == [shape(e) for e in r_ev], "chunk sequence keys/types differ"
    assert s_ev[-2]["usage"] == r_ev[-2]["usage"]
    if "plain_events" in sim:
        assert [shape(e) for e in sim["plain_events"]] == [shape(e) for e in real["plain_events"]]


@pytest.mark.vllm
def test_same_chat_created_cache_tokens(both: dict[str, Server], observe: Any) -> None:
    sim, real = (observe(sc_chat_cache_creation, both[k]) for k in ("sim", "vllm"))
    assert sim == real


@pytest.mark.vllm
@pytest.mark.parametrize("scenario", [sc_cached_tokens, sc_clamped], ids=["cached_tokens", "clamped"])
def test_same_usage(both: dict[str, Server], observe: Any, scenario: Any) -> None:
    sim, real = (observe(scenario, both[k]) for k in ("sim", "vllm"))
    assert sim == real


@pytest.mark.vllm
def test_same_tokenize_detokenize(both: dict[str, Server], observe: Any) -> None:
    sim, real = (observe(sc_tokenize, both[k]) for k in ("sim", "vllm"))
    assert sim["tokenize"] == real["tokenize"]
    assert sim["detokenize"] == real["detokenize"]


@pytest.mark.vllm
def test_same_metrics_of_interest(both: dict[str, Server], observe: Any) -> None:
    sim, real = (observe(sc_metrics, both[k])["metrics"] for k in ("sim", "vllm"))
    for n in METRICS_OF_INTEREST:
        sample = n if n in real.names() else f"{n}_count"
        assert has_metric(sim, n) and has_metric(real, n), n
        assert sim.label_names(sample) == real.label_names(sample), n
        assert sim.type_of(n) == real.type_of(n), n
    # Every vllm: family both export has the same type and label names.
    shared = {f for f in sim.types.keys() & real.types.keys() if f.startswith("vllm:")}
    assert len(shared) > 20
    for f in sorted(shared):
        assert sim.types[f] == real.types[f], f
        for sample in {n for n in real.names() if real.family(n) == f}:
            assert sim.label_names(sample) == real.label_names(sample), sample


@pytest.mark.vllm
def test_same_metric_families_vllm_has(both: dict[str, Server], observe: Any) -> None:
    sim, real = (observe(sc_metrics, both[k])["metrics"] for k in ("sim", "vllm"))
    missing = sorted(f for f in real.types if f.startswith("vllm:") and f not in sim.types)
    assert not missing, f"vLLM families the sim does not export: {missing}"


@pytest.mark.vllm
def test_same_metric_families_sim_has(both: dict[str, Server], observe: Any) -> None:
    sim, real = (observe(sc_metrics, both[k])["metrics"] for k in ("sim", "vllm"))
    extra = sorted(f for f in sim.types if f.startswith("vllm:") and f not in real.types)
    assert not extra, f"families the sim exports and vLLM does not: {extra}"


@pytest.mark.vllm
def test_same_prefix_cache_counter_moves(both: dict[str, Server], observe: Any) -> None:
    sim, real = (observe(sc_metrics, both[k]) for k in ("sim", "vllm"))
    assert sim["usages"] == real["usages"]
    assert sim["deltas"] == real["deltas"]
    assert (sim["running"], sim["waiting"]) == (real["running"], real["waiting"])


@pytest.mark.vllm
def test_same_kv_events(both: dict[str, Server], observe: Any) -> None:
    sim, real = (observe(sc_kv_events, both[k]) for k in ("sim", "vllm"))
    assert sim["prompts"] == real["prompts"], "same prompts, same tokenizer: same token ids and cached tokens"

    def hashes(o: dict[str, Any]) -> list[list[int]]:
        return [e["block_hashes"] for b in o["batches"] for e in b["decoded"]]

    assert {h for x in hashes(sim) for h in x} == {h for x in hashes(real) for h in x}, "stored hash sets differ"
    assert hashes(sim) == hashes(real), "per-event hash lists differ"
    # The raw payloads (msgpack, map form) are equal but for the timestamp; so are batch boundaries and seqs.
    strip = [{k: b[k] for k in ("topic", "seq", "dp_rank", "ts_type", "events")} for b in sim["batches"]]
    assert strip == [{k: b[k] for k in ("topic", "seq", "dp_rank", "ts_type", "events")} for b in real["batches"]]


@pytest.mark.vllm
@pytest.mark.parametrize("case_id", error_params(cross=True))
def test_same_error(both: dict[str, Server], observe: Any, case_id: str) -> None:
    sim, real = (observe(sc_error, both[k], case_id) for k in ("sim", "vllm"))
    assert sim["status"] == real["status"]
    assert sim["content_type"] == real["content_type"]
    assert shape(sim["body"]) == shape(real["body"])
    assert sim["body"] == real["body"], "same error body (message included)"


@pytest.mark.vllm
def test_same_stream_engine_errors(both: dict[str, Server], observe: Any) -> None:
    sim, real = (observe(sc_stream_engine_errors, both[k]) for k in ("sim", "vllm"))
    assert sim == real


@pytest.mark.vllm
def test_same_http_surface(both: dict[str, Server], observe: Any) -> None:
    sim, real = (observe(sc_http_surface, both[k]) for k in ("sim", "vllm"))
    for name in ("completion", "models"):  # generated text, ids and timestamps differ by nature
        assert sim[name]["headers"] == real[name]["headers"]
        sim[name]["body"] = real[name]["body"] = None
    assert sim == real


@pytest.mark.vllm
def test_same_http_metrics(both: dict[str, Server], observe: Any) -> None:
    sim, real = (observe(sc_http_metrics, both[k]) for k in ("sim", "vllm"))
    assert sim["moves"] == real["moves"]


@pytest.mark.vllm
def test_same_metric_families_all(both: dict[str, Server], observe: Any) -> None:
    """Every family, vLLM's own and the process/platform/GC/HTTP ones, with the same type and label names."""
    sim, real = (observe(sc_http_metrics, both[k])["metrics"] for k in ("sim", "vllm"))
    assert sorted(sim.types) == sorted(real.types)
    for f in sorted(real.types):
        assert sim.types[f] == real.types[f], f
        for sample in {n for n in real.names() if real.family(n) == f}:
            assert sim.label_names(sample) == real.label_names(sample), sample


@pytest.mark.vllm
def test_same_logprobs(both: dict[str, Server], observe: Any) -> None:
    sim, real = (observe(sc_logprobs, both[k]) for k in ("sim", "vllm"))
    for name, _, _ in LOGPROB_REQUESTS:
        assert logprob_view(sim[name]) == logprob_view(real[name]), name
