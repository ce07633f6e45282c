"""llmd.tokens: the shared tokenizer equals transformers, and the incremental prompt cache always equals tokenizing and
hashing whole prompts, with the tiny model's ByteLevel BPE and with other tokenizer styles built offline (Llama-3-like
regex split, SentencePiece-like Metaspace Unigram, WordPiece, BPE with no pre-tokenizer)."""

from __future__ import annotations

import inspect
import json
import os.path
import random
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmd.kv.hashing import BlockHasher
from llmd.tokens import ChatMessageError, PromptCache, Tokenizer, normalize_messages
from llmd.tokens.incremental import common_prefix_len

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# A template whose generation prompt is not how it renders past assistant turns: the next turn's text does not
# extend this turn's, it diverges at the "<think>" line.
THINKING = CHATML.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'")


def _corpus() -> list[str]:
    import difflib
    import shlex
    import textwrap

    texts = [inspect.getsource(m) for m in (difflib, shlex, textwrap)]
    texts.append("Ünïcödé façade naïve café, 中文字符 テキスト, emoji 😀🚀, ﬁ ½ Ａ 123456789 1,000.50\n" * 20)
    return texts


def _write_model(out: Path, tok: Any, *, bos: str | None, eos: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"chat_template": CHATML, "eos_token": eos, "clean_up_tokenization_spaces": False}
    if bos:
        config["bos_token"] = bos
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def _llama3_style(out: Path) -> Path:
    """Llama-3-like: a regex Split (3-digit groups, newline runs) then ByteLevel without its own regex; BOS added by
    a template after a trimming ByteLevel processor; special tokens that strip whitespace around them."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors, trainers
    from tokenizers import Tokenizer as HFTok

    pattern = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
        r"\s+(?!\S)|\s+"
    )
    tok = HFTok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=900, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens(
        [
            AddedToken("<|eot|>", lstrip=True, rstrip=True, special=True),
            AddedToken("<tool>", single_word=True),
            AddedToken("<|reserved_special_token_12|>", special=True),
        ]
    )
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=True),
            processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]),
        ]
    )
    return _write_model(out, tok, bos="<|begin_of_text|>", eos="<|im_end|>")


def _metaspace_style(out: Path) -> Path:
    """SentencePiece-like: NFKC, Metaspace splitting (prepended only to the first section), Unigram, BOS."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = HFTok(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.UnigramTrainer(vocab_size=700, special_tokens=specials, unk_token="<unk>")
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    return _write_model(out, tok, bos="<s>", eos="</s>")


def _wordpiece_style(out: Path) -> Path:
    """BERT-like: lowercasing, accent-stripping normalizer, whitespace+punctuation words, WordPiece, [CLS] .. [SEP]."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = HFTok(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.WordPieceTrainer(vocab_size=800, special_tokens=specials)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return _write_model(out, tok, bos=None, eos="[SEP]")


def _unsplit_style(out: Path) -> Path:
    """Llama-2-like: no pre-tokenizer, so a prompt is one word; the cache cannot show a safe point and goes whole."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, normalizers, trainers

    tok = HFTok(models.BPE(byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    alphabet = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=specials + alphabet)
    tok.train_from_iterator([line for t in _corpus() for line in t.splitlines()], trainer=trainer)
    return _write_model(out, tok, bos="<s>", eos="</s>")


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


_STYLES = {"llama3": _llama3_style, "metaspace": _metaspace_style, "wordpiece": _wordpiece_style}


@pytest.fixture(scope="module")
def style_toks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    root = tmp_path_factory.mktemp("styles")
    return {name: Tokenizer(make(root / name)) for name, make in _STYLES.items()}


# ---- the tokenizer equals transformers -------------------------------------------------------------------------------

TEXTS = [
    "hello world",
    "  leading and trailing  ",
    "def f(x):\n\treturn x ** 2  # square\n\n\n",
    "ünïcödé 🎉 中文 ﬁ ½",
    "<|im_start|>user\nhi<|im_end|>\n<|im_",
    "1234567890 3.14159 -42",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "hello there"}],
    [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": [{"type": "text", "text": "def f(x):"}, {"type": "text", "text": "  return 2*x"}]},
        {"role": "assistant", "content": "It doubles x.", "name": "bot"},
        {"role": "user", "content": "ünïcödé 🎉 and tabs\tok?"},
    ],
]


def test_tokenizer_equals_transformers(model_dir: Path, tok: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    for text in TEXTS:
        for special in (True, False):
            assert tok.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)
        ids, offsets = tok.encode_with_offsets(text)
        want = hf(text, return_offsets_mapping=True)
        assert ids == want["input_ids"] and offsets == [tuple(o) for o in want["offset_mapping"]]
        assert tok.decode(ids) == hf.decode(ids)
    for conv in CONVERSATIONS:
        messages = normalize_messages(conv)
        for gen in (True, False):
            want = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen, return_dict=False)
            assert tok.chat_token_ids(messages, add_generation_prompt=gen) == list(want)
    assert tok.eos_token_id == hf.eos_token_id


def test_sim_engine_uses_the_shared_code(tok: Tokenizer) -> None:
    from llmd.engines.sim import tokenizer
    from llmd.engines.sim.openai.errors import APIError
    from llmd.engines.sim.openai.messages import conversation

    assert tokenizer.SimTokenizer is Tokenizer
    with pytest.raises(APIError) as err:
        conversation([{"role": "assistant", "tool_calls": [{"type": "x", "function": {}}]}])
    assert err.value.code == 400 and err.value.param == "tool_calls"
    with pytest.raises(ChatMessageError):
        normalize_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_normalize_messages_is_vllms_and_idempotent() -> None:
    messages = [
        {"role": "system", "content": "x-anthropic-billing-header: abc\nYou are helpful."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}], "name": "u"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
        },
        {"role": "tool", "tool_call_id": "1", "content": "42"},
    ]
    out = normalize_messages(messages)
    assert out[0] == {"role": "system", "content": "You are helpful."}
    assert out[1] == {"role": "user", "content": "a\nb"}
    assert out[2]["content"] == "" and out[2]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert out[3] == {"role": "tool", "content": "42", "tool_call_id": "1"}
    assert normalize_messages(out) == out


# ---- incremental == whole: property tests ----------------------------------------------------------------------------

# Every prompt starts with this (as agents' prompts start with a system prompt): it also puts prompts past the first
# lookup anchor (1 KiB), so the cache engages even on short generated texts.
PREFIX = "You are a coding agent. Follow the instructions.\n" + inspect.getsource(os.path)[:1100] + "\n"

_CHARS = (
    "abcdefxyzABCXYZ0123456789 \t\n\r.,;:'\"!?-_=+*/\\()[]{}<>|#@$%^&~`"
    "éüßøñÅ中文字テ😀🚀\u0301\u00a0\u3000ﬁ½Ａ\x0b\x0c\x85"
)
_SNIPPETS = [
    "<|im_start|>",
    "<|im_end|>",
    "<|im_",
    "start|>",
    "<|",
    "|>",
    "<|eot|>",
    "<tool>",
    "<|reserved_special_token_12|>",
    "<|reserved_special_",
    "_token_12",
    "token_12|>",
    "<s>",
    "</s>",
    "[CLS]",
    "def ",
    "return ",
    "self.",
    "    ",
    "\n\n",
    " \n ",
    "'s",
    "'ll ",
    "1234",
    "ing",
    "tion",
    "http://x.y/z?q=1",
]
_RUNS = st.builds(
    lambda c, n: c * n,
    st.sampled_from([" ", "\n", "\t", "\r\n", " \n", "\u00a0", "-", "=", "a", "7", "😀", "é", "ab "]),
    st.integers(1, 90),
)
_ATOM = st.one_of(st.text(alphabet=_CHARS, min_size=1, max_size=10), st.sampled_from(_SNIPPETS), _RUNS)
_CHUNK = st.lists(_ATOM, min_size=0, max_size=25).map("".join)
# A turn: optionally cut the previous prompt (a rewrite of its tail, or a branch), then append; the cut falls between
# the first lookup anchor and the end, at a fraction of that span.
_TURN = st.tuples(st.one_of(st.none(), st.floats(0.0, 1.0)), _CHUNK, st.sampled_from([None, None, "salt-a", "salt-b"]))
_TURNS = st.lists(_TURN, min_size=1, max_size=5)


def _check_turns(tok: Tokenizer, base: str, turns: list, special: bool, block_size: int = 4) -> PromptCache:
    hasher = BlockHasher(block_size)
    cache = PromptCache(tok, hasher)
    text = PREFIX + base
    for cut, suffix, salt in [(None, "", None), *turns]:
        if cut is not None:
            text = text[: 1040 + int((len(text) - 1040) * cut)]
        text += suffix
        got = cache.encode(text, add_special_tokens=special, cache_salt=salt)
        want = tok.encode(text, add_special_tokens=special)
        assert got.token_ids.tolist() == want, (got.mode, text)
        assert got.num_tokens == len(want)
        assert got.block_hashes == hasher.event_hashes(want, cache_salt=salt)
        assert got.reused_blocks * block_size <= got.reused_tokens <= got.num_tokens
    return cache


_PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_PROPERTY
@given(base=_CHUNK, turns=_TURNS, special=st.booleans())
def test_incremental_equals_whole_bytelevel(tok: Tokenizer, base: str, turns: list, special: bool) -> None:
    _check_turns(tok, base, turns, special)


@pytest.mark.parametrize("style", sorted(_STYLES))
def test_incremental_equals_whole_other_styles(style_toks: dict[str, Tokenizer], style: str) -> None:
    stok = style_toks[style]

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(base=_CHUNK, turns=_TURNS, special=st.booleans())
    def check(base: str, turns: list, special: bool) -> None:
        _check_turns(stok, base, turns, special)

    check()


def test_added_token_completed_across_turns(tok: Tokenizer, style_toks: dict[str, Tokenizer]) -> None:
    """A turn that ends inside an added token's text and the next that completes it: every cut of every added token,
    after several kinds of text. The old tokens of that text are not an added token; the new ones are."""
    contexts = ["abc def ghi jkl mno pqr ", "x", "a_b_c_d_e_f_g_h", "1 2 3 4 5 6 7 8 ", "\n\n    "]
    for t in [tok, *style_toks.values()]:
        hasher = BlockHasher(4)
        for token in t.backend.get_added_tokens_decoder().values():
            for context in contexts:
                for cut in range(1, len(token.content)):
                    cache = PromptCache(t, hasher)
                    old = PREFIX + context + token.content[:cut]
                    new = old + token.content[cut:] + " after"
                    cache.encode(old)
                    got = cache.encode(new)
                    assert got.token_ids.tolist() == t.encode(new), (token.content, context, cut)
                    assert got.block_hashes == hasher.event_hashes(got.token_ids)


def test_incremental_is_used_and_exact_over_long_random_sessions(
    tok: Tokenizer, style_toks: dict[str, Tokenizer]
) -> None:
    """Many sessions in one shared cache: growth, rewrites, branches and repeats, checked turn by turn."""
    import difflib

    source = inspect.getsource(difflib)
    for name, t in [("bytelevel", tok), *style_toks.items()]:
        rng = random.Random(7)
        hasher = BlockHasher(16)
        cache = PromptCache(t, hasher)
        sessions = [PREFIX + source[i * 500 : i * 500 + 2000] for i in range(4)]
        for _ in range(120):
            s = rng.randrange(len(sessions))
            text = sessions[s]
            op = rng.random()
            at = rng.randrange(len(source) - 2500)
            if op < 0.7:
                text += source[at : at + rng.randrange(1, 2500)]
            elif op < 0.85:
                text = text[: rng.randrange(len(text) // 2, len(text))] + source[at : at + rng.randrange(1, 300)]
            elif op < 0.95:
                text += rng.choice(_SNIPPETS) * rng.randrange(1, 40)
            sessions[s] = text
            got = cache.encode(text, cache_salt="s" if s == 0 else None)
            want = t.encode(text)
            assert got.token_ids.tolist() == want, name
            assert got.block_hashes == hasher.event_hashes(want, cache_salt="s" if s == 0 else None), name
        counts = cache.stats()
        assert counts["incremental"] >= 100 and counts["fallbacks"] <= 3, (name, counts)


def test_chat_growth_equals_whole(tok: Tokenizer, style_toks: dict[str, Tokenizer]) -> None:
    """A conversation growing by messages (tool calls, tool results), rendered with a generation prompt each turn;
    with the thinking template the next rendering diverges from the last one before its end."""
    rng = random.Random(3)
    for t in [tok, *style_toks.values()]:
        for template in (CHATML, THINKING):
            hasher = BlockHasher(8)
            cache = PromptCache(t, hasher)
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": PREFIX},
                {"role": "user", "content": "Fix the bug in os.path.join for empty parts."},
            ]
            for turn in range(12):
                got = cache.encode(messages, chat_template=template)
                text = t.render_chat(normalize_messages(messages), chat_template=template)
                want = t.encode(text, add_special_tokens=False)
                assert got.token_ids.tolist() == want
                assert got.block_hashes == hasher.event_hashes(want)
                if turn:
                    assert got.mode == "incremental" and got.reused_tokens > len(want) // 2
                call = {"id": f"c{turn}", "type": "function", "function": {"name": "sh", "arguments": '{"cmd": "ls"}'}}
                messages.append({"role": "assistant", "content": f"Step {turn}: let me look.", "tool_calls": [call]})
                out = inspect.getsource(os.path)[rng.randrange(3000) :][: rng.randrange(50, 800)]
                messages.append({"role": "tool", "tool_call_id": f"c{turn}", "content": out})


def test_same_prompt_again_reuses_everything(tok: Tokenizer) -> None:
    cache = PromptCache(tok, BlockHasher(16))
    text = PREFIX + "some work\n" * 50
    first = cache.encode(text)
    again = cache.encode(text)
    assert first.mode == "full" and again.mode == "incremental"
    assert again.reused_tokens == again.num_tokens and again.reused_blocks == len(again.block_hashes)
    assert again.token_ids.tolist() == first.token_ids.tolist() and again.block_hashes == first.block_hashes


def test_short_prompts_are_remembered_whole(style_toks: dict[str, Tokenizer]) -> None:
    """A prompt under the first anchor is found again by its whole text and context only: the same text gives the
    same tokens and hashes without tokenizing, another salt or special-token choice is its own entry, the memo stays
    within its share of the budget, and a client's session id names the result either way."""
    t = style_toks["llama3"]  # adds a BOS token
    hasher = BlockHasher(4)
    cache = PromptCache(t, hasher, max_tokens=8 * 200)
    text = "You are a careful assistant. Summarize the file below in three lines."
    first = cache.encode(text)
    again = cache.encode(text)
    assert first.mode == "full" and again.mode == "incremental" and cache.stats()["repeats"] == 1
    assert again.token_ids.tolist() == first.token_ids.tolist() == t.encode(text)
    assert again.block_hashes == first.block_hashes == hasher.event_hashes(t.encode(text))
    assert again.reused_tokens == again.num_tokens and again.reused_blocks == len(again.block_hashes)
    assert again.session == first.session and cache.encode(text, session="s1").session == "s1"
    assert cache.encode(text).session == first.session
    salted = cache.encode(text, cache_salt="a")
    assert salted.mode == "full" and salted.block_hashes == hasher.event_hashes(t.encode(text), cache_salt="a")
    plain = cache.encode(text, add_special_tokens=False)
    assert plain.mode == "full" and plain.token_ids.tolist() == t.encode(text)[1:]
    assert cache.stats()["short_entries"] == 3 and cache.stats()["evictions"] == 0
    for i in range(20):
        cache.encode(f"{text} Variant {i}.")
        assert cache.stats()["short_tokens"] <= 200
    assert cache.encode(text).mode == "full"  # evicted, least recently used first


def test_cache_salt_and_special_tokens_rehash(style_toks: dict[str, Tokenizer]) -> None:
    t = style_toks["llama3"]  # adds a BOS token
    hasher = BlockHasher(4)
    cache = PromptCache(t, hasher)
    text = PREFIX + "first turn\n"
    cache.encode(text, cache_salt="a")
    grown = cache.encode(text + "second turn\n", cache_salt="a")
    assert grown.mode == "incremental" and grown.reused_blocks > 0
    resalted = cache.encode(text + "second turn\n", cache_salt="b")
    want = t.encode(text + "second turn\n")
    # The tokens are reused, the hashes are not: the salt enters block 0 and so every block after it.
    assert resalted.mode == "incremental" and resalted.reused_blocks == 0
    assert resalted.block_hashes == hasher.event_hashes(want, cache_salt="b")
    plain = cache.encode(text + "second turn\n", add_special_tokens=False)
    assert plain.token_ids.tolist() == want[1:] and plain.reused_blocks == 0
    assert plain.block_hashes == hasher.event_hashes(want[1:])


def test_no_safe_point_falls_back_and_counts(tok: Tokenizer, tmp_path: Path) -> None:
    # One giant word: no word start to splice at.
    cache = PromptCache(tok, BlockHasher(16))
    word = "x" * 3000
    cache.encode(word)
    got = cache.encode(word + "yz")
    assert got.mode == "full" and got.token_ids.tolist() == tok.encode(word + "yz")
    assert cache.stats()["fallbacks"] == 1
    # A tokenizer with no pre-tokenizer makes every prompt one word: always whole, always right.
    t = Tokenizer(_unsplit_style(tmp_path / "unsplit"))
    hasher = BlockHasher(8)
    cache = PromptCache(t, hasher)
    text = PREFIX
    for i in range(3):
        text += f"turn {i}: more text\n"
        got = cache.encode(text)
        assert got.mode == "full" and got.token_ids.tolist() == t.encode(text)
        assert got.block_hashes == hasher.event_hashes(t.encode(text))
    assert cache.stats()["fallbacks"] == 2


def test_lru_bound_and_evictions(tok: Tokenizer) -> None:
    cache = PromptCache(tok, BlockHasher(16), max_tokens=3000)
    texts = [PREFIX + f"session {i}\n" + "word " * 300 for i in range(5)]
    first = cache.encode(texts[0])
    for text in texts[1:]:
        cache.encode(text)
        assert cache.tokens <= 3000
    stats = cache.stats()
    assert stats["evictions"] >= 2 and stats["entries"] == len(cache._entries)
    # The most recent session continues where it was; the oldest was evicted: it reuses only what it shares with
    # the sessions still remembered (the common prefix), under a new lineage.
    newest = cache.encode(texts[-1] + "more\n")
    assert newest.mode == "incremental" and newest.reused_tokens > 0.9 * newest.num_tokens
    oldest = cache.encode(texts[0] + "more\n")
    assert oldest.token_ids.tolist() == tok.encode(texts[0] + "more\n")
    assert 0 < oldest.reused_tokens <= len(tok.encode(PREFIX + "session ")) and oldest.session != first.session


def test_sessions_are_found_by_content(tok: Tokenizer) -> None:
    """Sessions sharing a long system prompt stay apart; each turn finds its own session's last prompt, and a
    sub-agent (same system prompt, its own task) gets a lineage of its own without displacing its parent's."""
    system = PREFIX * 12  # ~14K characters shared by every session
    cache = PromptCache(tok, BlockHasher(16))
    a = system + "Task A: refactor the parser so that it reports every error with its line and column.\n"
    b = system + "Task B: write the documentation of the public API, with one example for each function.\n"
    ea, eb = cache.encode(a), cache.encode(b)
    assert ea.session != eb.session and eb.mode == "incremental"
    for i in range(3):
        a += f"A turn {i}: " + "parse tokens carefully. " * 40 + "\n"
        b += f"B turn {i}: " + "document each function. " * 40 + "\n"
        got_a, got_b = cache.encode(a), cache.encode(b)
        assert (got_a.session, got_b.session) == (ea.session, eb.session)
        assert got_a.mode == got_b.mode == "incremental"
        assert got_a.reused_tokens > 0.9 * got_a.num_tokens
    sub = cache.encode(system + "Sub-agent: list the files of the repository and summarize what each one is for.\n")
    assert sub.session not in (ea.session, eb.session)
    a += "A again\n"
    got = cache.encode(a)
    assert got.session == ea.session and got.reused_tokens > 0.9 * got.num_tokens
    assert cache.stats()["entries"] == 3


def test_named_sessions(tok: Tokenizer) -> None:
    """Short tasks differ by less than a template's re-rendered tail, so by content alone two such sessions would
    share one entry (correct, cheap, one fingerprint); a client's session ids keep them apart, and let a session
    replace its own entry even when the agent rewrote a long tail."""
    system = PREFIX * 4
    cache = PromptCache(tok, BlockHasher(16))
    a, b = system + "Task A.\n", system + "Task B.\n"
    assert cache.encode(a, session="A").session == "A"
    assert cache.encode(b, session="B").session == "B"
    assert cache.stats()["entries"] == 2
    rewritten = a[:-2000] + "compacted\n" * 20
    got = cache.encode(rewritten, session="A")
    assert got.session == "A" and got.token_ids.tolist() == tok.encode(rewritten)
    assert cache.stats()["entries"] == 2


@settings(max_examples=300, deadline=None)
@given(a=st.text(alphabet="ab😀", max_size=40), b=st.text(alphabet="ab😀", max_size=40), shared=st.text(max_size=40))
def test_common_prefix_len(a: str, b: str, shared: str) -> None:
    x, y = shared + a, shared + b
    want = next((i for i, (c, d) in enumerate(zip(x, y, strict=False)) if c != d), min(len(x), len(y)))
    assert common_prefix_len(x, y) == want


# ---- speed -----------------------------------------------------------------------------------------------------------


def _agent_text(tok: Tokenizer, n_tokens: int) -> tuple[str, list[tuple[int, int]]]:
    """Realistic agent context: Python source (what coding agents read), long enough for n_tokens tokens."""
    import argparse
    import ast
    import asyncio.base_events
    import dataclasses
    import decimal
    import email.message
    import enum
    import functools
    import http.client
    import logging
    import pydoc
    import subprocess
    import tarfile
    import threading
    import typing
    import unittest.case
    import zipfile

    mods = [asyncio.base_events, typing, dataclasses, http.client, logging, unittest.case, argparse, email.message]
    mods += [ast, pydoc, tarfile, zipfile, subprocess, threading, enum, functools, decimal]
    source = "".join(inspect.getsource(m) for m in mods)
    ids, offsets = tok.encode_with_offsets(source)
    assert len(ids) > n_tokens + 40 * 700, "not enough source text"
    return source, offsets


def test_speed_195k_token_turn_growing_by_632(tok: Tokenizer, capsys: pytest.CaptureFixture[str]) -> None:
    """The router's hot path: a 195K-token prompt extending its session's last one by 632 tokens."""
    source, offsets = _agent_text(tok, 195_000)
    hasher = BlockHasher(64)
    cache = PromptCache(tok, hasher)
    pos = 195_000
    text = source[: offsets[pos][0]]
    t0 = time.perf_counter()
    first = cache.encode(text)
    full_s = time.perf_counter() - t0
    assert first.mode == "full" and first.num_tokens == pos
    t0 = time.perf_counter()
    plain = hasher.event_hashes(tok.encode(text))
    plain_s = time.perf_counter() - t0
    assert plain == first.block_hashes
    times = []
    for _ in range(30):
        pos += 632
        text = source[: offsets[pos][0]]
        t0 = time.perf_counter()
        got = cache.encode(text)
        times.append(time.perf_counter() - t0)
        assert got.mode == "incremental" and got.num_tokens == pos
    assert got.token_ids.tolist() == tok.encode(text) and got.block_hashes == hasher.event_hashes(got.token_ids)
    inc_s = statistics.median(times)
    # Chat: the same growth as a conversation (rendering is part of the router's work too).
    cut, end = offsets[3000][0], offsets[195_000][0]
    messages = [{"role": "system", "content": source[:cut]}]
    while cut < end:
        messages.append({"role": "user" if len(messages) % 2 else "assistant", "content": source[cut : cut + 4000]})
        cut += 4000
    chat_cache = PromptCache(tok, hasher)
    chat_cache.encode(messages)
    chat_times = []
    for i in range(10):
        messages.append({"role": "user" if i % 2 else "assistant", "content": source[cut : cut + 1700]})
        cut += 1700
        t0 = time.perf_counter()
        got = chat_cache.encode(messages)
        chat_times.append(time.perf_counter() - t0)
        assert got.mode == "incremental"
    chat_s = statistics.median(chat_times)
    with capsys.disabled():
        print(
            f"\n[tokens] 195K-token prompt: full tokenize+hash {full_s * 1e3:.1f} ms via the cache "
            f"({plain_s * 1e3:.1f} ms plain); +632 tokens incremental median {inc_s * 1e3:.3f} ms "
            f"(min {min(times) * 1e3:.3f}, max {max(times) * 1e3:.3f}); speed-up {full_s / inc_s:.0f}x; "
            f"chat ({len(messages)} messages) +1 message median {chat_s * 1e3:.3f} ms"
        )
    assert full_s / inc_s >= 50
    assert inc_s < 0.005  # target 2 ms on a quiet machine; loose here for shared CI machines
