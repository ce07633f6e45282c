"""Tokens and block hashes of agentic prompts, one turn at a time: only the part of a prompt that changed is tokenized.

An agent resends its whole, growing context every turn (median 195K tokens, +632 a turn). `PromptCache` remembers
recent prompts with their token ids, the tokens' character spans and pre-tokenizer words, and their block hashes. For a
new prompt it finds the remembered prompt sharing the longest text prefix, re-tokenizes from a safe point a few words
before the two diverge, and hashes only the blocks after the last reused one. The result always equals tokenizing and
hashing the whole prompt: where no safe point can be shown, it tokenizes the whole prompt (a counted fallback).

Why the splice is exact. Tokenizers cut text into pieces (added tokens first, then the pre-tokenizer's words) and
encode each piece alone. The new text is tokenized from a word start a few words before the divergence, less a margin;
the cut p is the first word start, past that window's first word, where both tokenizations start a word and agree
token for token (id and start) up to the next word start, which both share. The old tokens before p and the new ones
from p make the result: agreeing on a whole word puts the two pre-tokenizer scans in step at p (a rule that looks far
ahead, as whitespace-run rules do, would have merged that word into a longer piece in the new scan), and the margin,
twice the longest added token, keeps the reused part clear of an added token that the new text completes. Tokenizers
without a pre-tokenizer (SentencePiece BPE as Llama 2 ships it) have no word starts: their prompts always go whole.
"""

from __future__ import annotations

import bisect
import dataclasses
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import count, islice
from typing import Any, Literal

import tokenizers
import xxhash

from llmd.kv.hashing import BlockHasher, event_hash
from llmd.tokens.chat import normalize_messages
from llmd.tokens.tokenizer import Tokenizer

# Prompts are found by fingerprints of short text windows ending at these character offsets (1 KiB, 2 KiB, ...):
# the deepest one a prompt shares with a remembered one names the candidates, whatever session sent them.
_ANCHOR_MIN = 1024
_ANCHOR_WINDOW = 128
# Words to back off before the divergence, tried in turn before giving up on the splice.
_BACKOFF_WORDS = (4, 32, 256)
# A new prompt continues a remembered one (and takes its place) when it keeps all of it but at most this many final
# characters (a chat template's generation prompt, re-rendered); otherwise it is a sibling (another session with
# the same system prompt, a sub-agent) and is remembered beside it. Between prompts of named sessions the names
# decide: a prompt takes the place of its own session's that it shares at least half with (the agent rewrote a tail).
_REWRITE_SLACK = 64
_SAME_SESSION_FRACTION = 0.5
# Prompts shorter than the first anchor are remembered whole, found only by their whole text (a retried request, a
# burst of sub-agents sent the same task, a benchmark's or an eval's prompt set), in this share of max_tokens.
_SHORT_SHARE = 8


@dataclass(frozen=True, slots=True)
class Encoded:
    """One prompt's tokens and block hashes.

    token_ids: array('i'), shared with the cache: read it, do not modify it. block_hashes: the 64-bit hashes of every
    full block (vLLM's KV-event form). reused_tokens: leading tokens taken from a remembered prompt without
    tokenizing them again; reused_blocks: leading block hashes taken likewise. session: the session id given, else the
    prompt's lineage (the same for every turn of one conversation): a fingerprint for requests that name no session.
    """

    token_ids: array
    block_hashes: list[int]
    num_tokens: int
    reused_tokens: int
    reused_blocks: int
    mode: Literal["incremental", "full"]
    session: str


class _Entry:
    """A remembered prompt. Its arrays hold, per token of the tokenizer's model (no post-processor tokens), the id, the
    character where the token starts and its pre-tokenizer word (increasing). `ids` is shared with Encoded results and
    never changed in place; `starts` and `words` are the entry's own."""

    __slots__ = (
        "anchors",
        "eid",
        "event_hashes",
        "hash_key",
        "hashes",
        "ids",
        "named",
        "session",
        "starts",
        "text",
        "words",
    )

    def __init__(self, eid: int, session: str, text: str, ids: array, starts: array, words: array) -> None:
        self.eid = eid
        self.session = session  # the client's session id (named) or the lineage's fingerprint
        self.named = False
        self.text = text
        self.ids = ids
        self.starts = starts
        self.words = words
        self.anchors: list[tuple[int, int]] = []
        self.hash_key: tuple[Any, ...] | None = None
        self.hashes: list[bytes] = []
        self.event_hashes: list[int] = []


class PromptCache:
    """Incremental tokenization and block hashing of growing prompts.

    hasher: the engines' block hasher (None: tokens only). max_tokens: how many tokens the remembered prompts may hold
    together; past it the least recently used go (about 12 bytes a token plus the text and the block hashes).
    max_candidates: remembered prompts compared with a new one at most. margin_chars: how far before the divergence the
    reused tokens must end (default: twice the longest added token, at least 32). Not thread-safe: one cache per event
    loop. Prompts shorter than 1 KiB are tokenized whole and remembered whole: the same text again costs a lookup.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        hasher: BlockHasher | None = None,
        *,
        max_tokens: int = 16_000_000,
        max_candidates: int = 4,
        margin_chars: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.hasher = hasher
        self.max_tokens = max_tokens
        self.max_candidates = max_candidates
        # The model's own encoding with no post-processor: the character spans stay untrimmed, and the special tokens a
        # post-processor adds (BOS, ...) are put around the ids here, so they never sit inside a spliced sequence.
        raw = tokenizers.Tokenizer.from_str(tokenizer.backend.to_str())
        raw.post_processor = None
        raw.no_truncation()
        raw.no_padding()
        self._raw = raw
        longest = max((len(t.content) for t in tokenizer.backend.get_added_tokens_decoder().values()), default=0)
        self.margin = margin_chars if margin_chars is not None else max(32, 2 * longest)
        self._affixes: dict[bool, tuple[list[int], list[int]] | None] = {False: ([], []), True: self._probe_affixes()}
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._index: dict[tuple[int, int], dict[int, None]] = {}  # anchor (offset, fingerprint) -> entry ids
        self._ids = count()
        self.tokens = 0
        # Short prompts by (text, special, salt, lora), least recently used first, holding `_short_tokens` tokens.
        self._short: OrderedDict[tuple[Any, ...], Encoded] = OrderedDict()
        self._short_tokens = 0
        self.counts = {"incremental": 0, "full": 0, "fallbacks": 0, "evictions": 0, "repeats": 0}

    def _probe_affixes(self) -> tuple[list[int], list[int]] | None:
        """The tokens the post-processor puts before and after a text, or None when that is not a fixed affix."""
        found = set()
        for probe in ("a", "Hello, world!\n  x = 1"):
            body = self._raw.encode(probe, add_special_tokens=False).ids
            full = self.tokenizer.encode(probe, add_special_tokens=True)
            for i in range(len(full) - len(body) + 1):
                if full[i : i + len(body)] == body:
                    found.add((tuple(full[:i]), tuple(full[i + len(body) :])))
                    break
            else:
                return None
        if len(found) != 1:
            return None
        pre, post = found.pop()
        return list(pre), list(post)

    # ---- the public call -------------------------------------------------------------------------------------------

    def encode(
        self,
        prompt: str | Sequence[Mapping[str, Any]],
        *,
        add_special_tokens: bool | None = None,
        cache_salt: str | None = None,
        lora: tuple[str, str] | None = None,
        session: str | None = None,
        **chat_kwargs: Any,
    ) -> Encoded:
        """A completion prompt (text) or a chat conversation (OpenAI messages as the client sent them) -> its tokens
        and block hashes, as the engine computes them.

        Chat messages are normalized and rendered as vLLM does (`chat_kwargs` go to `Tokenizer.render_chat`:
        add_generation_prompt, continue_final_message, tools, documents, chat_template, template variables).
        add_special_tokens defaults as in vLLM's requests: True for text, False for chat. Raises ValueError
        (ChatMessageError, ChatTemplateError) for a conversation the engine would refuse.

        The remembered prompt to start from is found by content, whatever session sent it; `session` (a client's
        session id, if it sent one) only helps decide which remembered prompt the new one replaces.
        """
        if isinstance(prompt, str):
            if chat_kwargs:
                raise TypeError(f"chat options given for a text prompt: {', '.join(chat_kwargs)}")
            text = prompt
            special = True if add_special_tokens is None else add_special_tokens
        else:
            text = self.tokenizer.render_chat(normalize_messages(prompt), **chat_kwargs)
            special = False if add_special_tokens is None else add_special_tokens
        affixes = self._affixes[special]
        if affixes is None:
            return self._uncached(text, special, cache_salt, lora, session)
        if len(text) < _ANCHOR_MIN:
            return self._encode_short(text, special, cache_salt, lora, session, affixes)
        base, common = self._lookup(text, session)
        # A prompt that continues a remembered one takes its place (its arrays are then updated in place).
        replace = False
        if base is not None:
            if session is not None and base.named:
                replace = base.session == session and common >= _SAME_SESSION_FRACTION * len(base.text)
            else:
                replace = len(base.text) - common <= _REWRITE_SLACK
        spliced = None
        if base is not None:
            spliced = self._splice(base, text, common, replace)
            if spliced is None:
                self.counts["fallbacks"] += 1
        if spliced is None:
            enc = self._raw.encode(text, add_special_tokens=False)
            ids, k = array("i", enc.ids), 0
            starts, words = _starts(enc.offsets, 0), _words(enc.word_ids)
            self.counts["full"] += 1
        else:
            ids, starts, words, k = spliced
            self.counts["incremental"] += 1
        pre, post = affixes
        final = ids
        if pre or post:
            final = array("i", pre)
            final.extend(ids)
            final.extend(post)
        hash_key = (special, cache_salt, lora)
        reuse, hashes, event_hashes = self._hash(base if k else None, len(pre) + k, final, hash_key)
        entry = self._remember(base if replace else None, common, text, ids, starts, words, session)
        entry.hash_key, entry.hashes, entry.event_hashes = hash_key, hashes, event_hashes
        lineage = entry.session
        self._evict()
        mode: Literal["incremental", "full"] = "incremental" if k else "full"
        return Encoded(final, event_hashes, len(final), len(pre) + k if k else 0, reuse, mode, lineage)

    def _encode_short(
        self,
        text: str,
        special: bool,
        cache_salt: str | None,
        lora: tuple[str, str] | None,
        session: str | None,
        affixes: tuple[list[int], list[int]],
    ) -> Encoded:
        """A prompt too short to splice: the remembered result for the same text and context, else tokenized whole.
        No spans or words are read out of the encoding: they would serve only a splice, and reading them costs half
        as much again as tokenizing a short prompt."""
        key = (text, special, cache_salt, lora)
        got = self._short.get(key)
        if got is not None:
            self._short.move_to_end(key)
            self.counts["repeats"] += 1
            return got if session is None or session == got.session else dataclasses.replace(got, session=session)
        pre, post = affixes
        final = array("i", pre)
        final.extend(self._raw.encode(text, add_special_tokens=False).ids)
        final.extend(post)
        event_hashes = self.hasher.event_hashes(final, cache_salt=cache_salt, lora=lora) if self.hasher else []
        self.counts["full"] += 1
        lineage = _lineage(text)
        # Remembered as an exact repeat would be served: everything reused, under the text's own lineage.
        n = len(final)
        self._short[key] = Encoded(final, event_hashes, n, n, len(event_hashes), "incremental", lineage)
        self._short_tokens += len(final)
        while self._short_tokens > self.max_tokens // _SHORT_SHARE and self._short:
            _, old = self._short.popitem(last=False)
            self._short_tokens -= old.num_tokens
            self.counts["evictions"] += 1
        return Encoded(final, event_hashes, n, 0, 0, "full", session or lineage)

    def _hash(
        self, base: _Entry | None, same: int, final: array, hash_key: tuple[Any, ...]
    ) -> tuple[int, list[bytes], list[int]]:
        """Block hashes of `final`, reusing `base`'s for the blocks inside its first `same` tokens (same context)."""
        if self.hasher is None:
            return 0, [], []
        reuse = 0
        if base is not None and base.hash_key == hash_key:
            reuse = min(same // self.hasher.block_size, len(base.hashes))
        _, salt, lora = hash_key
        hashes = self.hasher.hash_tokens(final, base.hashes[:reuse] if reuse else (), cache_salt=salt, lora=lora)
        event_hashes = (base.event_hashes[:reuse] if reuse else []) + [event_hash(h) for h in hashes[reuse:]]
        return reuse, hashes, event_hashes

    def _uncached(
        self, text: str, special: bool, cache_salt: str | None, lora: tuple[str, str] | None, session: str | None
    ) -> Encoded:
        # A post-processor that does more than put fixed tokens around the text: tokenize whole, remember nothing.
        final = array("i", self.tokenizer.encode(text, add_special_tokens=special))
        hashes = self.hasher.event_hashes(final, cache_salt=cache_salt, lora=lora) if self.hasher else []
        self.counts["full"] += 1
        return Encoded(final, hashes, len(final), 0, 0, "full", session or _lineage(text))

    def stats(self) -> dict[str, int]:
        return {
            "entries": len(self._entries),
            "tokens": self.tokens,
            "short_entries": len(self._short),
            "short_tokens": self._short_tokens,
            **self.counts,
        }

    # ---- finding the remembered prompt -----------------------------------------------------------------------------

    def _lookup(self, text: str, session: str | None) -> tuple[_Entry | None, int]:
        """The remembered prompt sharing the longest prefix with `text` (on a tie, `session`'s), and that length.

        Anchors are tried deepest first; a candidate sharing at least the anchor's length is the best there is (any
        prompt sharing more would sit in that anchor's bucket too), otherwise shallower anchors are tried as well.
        """
        best, best_len = None, -1
        a = _ANCHOR_MIN
        while a * 2 <= len(text):
            a *= 2
        while a >= _ANCHOR_MIN and a <= len(text):
            bucket = self._index.get((a, hash(text[a - _ANCHOR_WINDOW : a])))
            if bucket:
                for eid in islice(reversed(bucket), self.max_candidates):
                    entry = self._entries[eid]
                    n = common_prefix_len(entry.text, text)
                    if n > best_len or (n == best_len and session is not None and entry.session == session):
                        best, best_len = entry, n
                if best_len >= a:
                    break
            a //= 2
        return best, max(best_len, 0)

    # ---- the splice ------------------------------------------------------------------------------------------------

    def _splice(self, base: _Entry, text: str, common: int, in_place: bool) -> tuple[array, array, array, int] | None:
        """Tokens of `text`: `base`'s up to a safe word start, then a window tokenized anew; None if no safe word start
        shows up within the back-off limits (the caller tokenizes the whole text)."""
        ids, starts, words = base.ids, base.starts, base.words
        if common == len(base.text) == len(text):
            return ids, starts, words, len(ids)
        limit = common - self.margin
        # Old tokens [0, kl) lie before the limit: their text is the same in both prompts, with margin to spare.
        kl = bisect.bisect_right(starts, limit) - 1 if limit > 0 else 0
        if kl <= 0:
            return None
        for backoff in _BACKOFF_WORDS:
            target = words[kl - 1] - backoff
            if target <= words[0]:
                return None
            ws_tok = bisect.bisect_left(words, target)
            ws = starts[ws_tok]
            enc = self._raw.encode(text[ws:], add_special_tokens=False)
            r_ids, r_words = enc.ids, enc.word_ids
            r_starts = [s + ws for s, _ in enc.offsets]
            rl = bisect.bisect_right(r_starts, limit) - 1
            for r in range(1, rl):  # from the window's second word on: its first may differ (prefix space, ...)
                if r_words[r] == r_words[r - 1]:
                    continue
                p = r_starts[r]
                i = bisect.bisect_left(starts, p, ws_tok, kl)
                if i < kl and _in_step(ids, starts, words, i, kl, r_ids, r_starts, r_words, r, rl):
                    return self._join(base, i, r_ids[r:], r_starts[r:], r_words[r:], in_place)
        return None

    @staticmethod
    def _join(
        base: _Entry, k: int, ids: list[int], starts: list[int], words: list[int | None], in_place: bool
    ) -> tuple[array, array, array, int]:
        new_ids = base.ids[:k]
        new_ids.extend(ids)
        new_starts, new_words = base.starts, base.words
        if in_place:
            del new_starts[k:], new_words[k:]
        else:
            new_starts, new_words = new_starts[:k], new_words[:k]
        new_starts.extend(starts)
        new_words.extend(_words(words, new_words[k - 1] + 1))
        return new_ids, new_starts, new_words, k

    # ---- memory ----------------------------------------------------------------------------------------------------

    def _remember(
        self, base: _Entry | None, common: int, text: str, ids: array, starts: array, words: array, session: str | None
    ) -> _Entry:
        """Store the new prompt: in place of `base` (the prompt it continues), or else as a new lineage."""
        if base is not None:
            entry = base
            self.tokens -= len(entry.ids)
            keep = [(a, h) for a, h in entry.anchors if a <= common]
            for a, h in entry.anchors[len(keep) :]:
                self._unindex(a, h, entry.eid)
            entry.text, entry.ids, entry.starts, entry.words, entry.anchors = text, ids, starts, words, keep
        else:
            entry = _Entry(next(self._ids), _lineage(text), text, ids, starts, words)
        if session is not None:
            entry.session, entry.named = session, True
        a = entry.anchors[-1][0] * 2 if entry.anchors else _ANCHOR_MIN
        while a <= len(text):
            entry.anchors.append((a, hash(text[a - _ANCHOR_WINDOW : a])))
            a *= 2
        for key in entry.anchors:
            bucket = self._index.setdefault(key, {})
            bucket.pop(entry.eid, None)
            bucket[entry.eid] = None  # most recent last
        self._entries[entry.eid] = entry
        self._entries.move_to_end(entry.eid)
        self.tokens += len(ids)
        return entry

    def _unindex(self, a: int, h: int, eid: int) -> None:
        bucket = self._index.get((a, h))
        if bucket is not None:
            bucket.pop(eid, None)
            if not bucket:
                del self._index[(a, h)]

    def _evict(self) -> None:
        while self.tokens > self.max_tokens and self._entries:
            _, entry = self._entries.popitem(last=False)
            for a, h in entry.anchors:
                self._unindex(a, h, entry.eid)
            self.tokens -= len(entry.ids)
            self.counts["evictions"] += 1


def common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix of two strings, compared in C (a whole-string check, then bisection)."""
    n = min(len(a), len(b))
    if (b.startswith(a) if len(a) <= len(b) else a.startswith(b)) or n == 0:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a.startswith(b[lo:mid], lo):
            lo = mid
        else:
            hi = mid
    return lo


def _in_step(
    ids: array,
    starts: array,
    words: array,
    i: int,
    kl: int,
    r_ids: list[int],
    r_starts: list[int],
    r_words: list[int | None],
    r: int,
    rl: int,
) -> bool:
    """Whether old token i and window token r both start a word and agree (id and start) on every token of that word,
    up to the next word start, which both must share."""
    if i > 0 and words[i] == words[i - 1]:
        return False
    while i < kl and r < rl:
        if ids[i] != r_ids[r] or starts[i] != r_starts[r]:
            return False
        i += 1
        r += 1
        if i < kl and r < rl:
            t_new, r_new = words[i] != words[i - 1], r_words[r] != r_words[r - 1]
            if t_new or r_new:
                return t_new and r_new
    return False


def _lineage(text: str) -> str:
    return f"{xxhash.xxh3_64_intdigest(text.encode('utf-8', 'surrogatepass')):016x}"


def _starts(offsets: list[tuple[int, int]], shift: int) -> array:
    return array("i", [st + shift for st, _ in offsets])


def _words(word_ids: list[int | None], first: int = 0) -> array:
    """Word indices shifted to start at `first`; a token without a word (None) is a word of its own."""
    if word_ids and None not in word_ids:
        shift = first - word_ids[0]
        return array("i", word_ids if shift == 0 else [w + shift for w in word_ids])  # type: ignore[operator]
    out = array("i", [0]) * len(word_ids)
    w, prev = first - 1, object()
    for i, x in enumerate(word_ids):
        if x is None or x != prev:
            w += 1
        prev = x
        out[i] = w
    return out
