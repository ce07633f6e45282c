"""The router forwards a text completion's prompt as the token ids it computed for prefix routing, so the engine does
not tokenize it again: the engine gets exactly its own tokenization and answers as it does to the text; where ids
cannot stand in for the text (chat, batches, echo, truncation) or the spec turns it off, the body goes untouched.
Both P/D hops carrying the ids: tests/test_router_hops.py."""

from __future__ import annotations

from array import array
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from routerutil import Recording, Servers, engine, pod_of, post, rconfig, run, words

from llmd.router.proxy import Router
from llmd.router.request import with_token_ids
from llmd.tokens import Tokenizer


def test_with_token_ids_replaces_only_a_single_text_completion_prompt() -> None:
    ids = array("i", [5, 6, 7])
    body = {"model": "m", "prompt": "a b c", "max_tokens": 3}
    out = with_token_ids("completion", body, ids)
    assert out == {"model": "m", "prompt": [5, 6, 7], "max_tokens": 3}
    assert list(out) == list(body)  # the prompt keeps its place
    assert body["prompt"] == "a b c"  # the client's body is not changed
    assert with_token_ids("completion", body, [5, 6, 7]) == out
    assert with_token_ids("completion", body, None) is None
    assert with_token_ids("chat", {"messages": [{"role": "user", "content": "a"}]}, ids) is None
    assert with_token_ids("completion", {**body, "prompt": ["a b c", "d"]}, ids) is None
    assert with_token_ids("completion", {**body, "prompt": [1, 2]}, ids) is None
    assert with_token_ids("completion", {**body, "echo": True}, ids) is None
    assert with_token_ids("completion", {**body, "truncate_prompt_tokens": 2}, ids) is None
    assert with_token_ids("completion", {**body, "echo": False, "truncate_prompt_tokens": None}, ids) is not None


def _completion(prompt: Any, **kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0, "seed": 3, **kw}


def test_the_engine_gets_its_own_tokenization_and_answers_as_to_the_text(model_dir: Path) -> None:
    tok = Tokenizer(model_dir)

    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            eng = await sv.start(engine(model_dir, "e0"), Recording)
            direct = await sv.start(engine(model_dir, "direct"), Recording)
            assert isinstance(eng, Recording) and isinstance(direct, Recording)
            async with Router(rconfig(model_dir), [pod_of(eng)]) as router:
                for i, extra in enumerate(({}, {"add_special_tokens": False}, {"stream": False, "logprobs": 2})):
                    text = words(i, 120) + " tail"  # a second turn grows the first: the incremental tokenizer
                    for j, prompt in enumerate((text, text + " more words here")):
                        # The engine draws its output from its seed and the request id: the same for both.
                        rid = {"X-Request-Id": f"req-{i}-{j}"}
                        req = _completion(prompt, **extra)
                        st, r, _ = await post(http, router.url + "/v1/completions", req, headers=rid)
                        assert st == 200, r
                        sent, _ = eng.seen[-1]
                        special = extra.get("add_special_tokens", True)
                        assert sent["prompt"] == tok.encode(prompt, add_special_tokens=special)
                        assert sent == {**req, "prompt": sent["prompt"]}
                        st, d, _ = await post(http, direct.url + "/v1/completions", req, headers=rid)
                        assert st == 200, d
                        assert direct.seen[-1][0]["prompt"] == prompt
                        assert r["choices"][0]["text"] == d["choices"][0]["text"]
                        assert r["choices"][0].get("logprobs") == d["choices"][0].get("logprobs")
                        assert r["usage"] == d["usage"]

    run(body)


@pytest.mark.parametrize(
    ("path", "req", "forward"),
    [
        ("/v1/completions", _completion(words(1, 80), echo=True), True),
        ("/v1/completions", _completion(words(1, 80), truncate_prompt_tokens=40), True),
        ("/v1/completions", _completion([words(1, 80), words(2, 80)]), True),
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, True),
        ("/v1/completions", _completion(words(1, 80)), False),
    ],
    ids=["echo", "truncate", "batch", "chat", "forward-off"],
)
def test_the_body_goes_untouched_where_ids_cannot_stand_in(
    model_dir: Path, path: str, req: dict[str, Any], forward: bool
) -> None:
    async def body() -> None:
        async with Servers() as sv, aiohttp.ClientSession() as http:
            eng = await sv.start(engine(model_dir, "e0"), Recording)
            assert isinstance(eng, Recording)
            async with Router(rconfig(model_dir, forward_tokens=forward), [pod_of(eng)]) as router:
                st, r, _ = await post(http, router.url + path, req)
                assert st == 200, r
                assert eng.seen[-1][0] == req

    run(body)
