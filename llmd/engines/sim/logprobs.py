"""Synthetic logprobs in vLLM 0.32's shapes: per position the sampled (or prompt) token first, then the top-k.

The simulated model has no logits, so the numbers are made up, but deterministically (a position's values depend only
on the token, the one before it and the position) and plausibly: a peaked distribution whose top-k is sorted
descending, probabilities summing to at most 1, the sampled token at rank 1 under greedy sampling and drawn from the
same distribution otherwise. Token strings are rendered as vLLM renders them (vllm/v1/engine/logprobs.py): each id
decoded alone, a trailing U+FFFD repaired from the preceding sampled tokens, SentencePiece leading spaces restored.

A position is a list of (token_id, logprob, rank, decoded) in vLLM's dict order: the sampled token first, then ranks
1..k, a token listed twice kept once, at its first place, with the later entry's values (a Python dict insert).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

Entry = tuple[int, float, int, str]  # token id, logprob, rank, decoded token
Position = list[Entry]

LOGPROB_FLOOR = -9999.0  # vLLM clamps -inf to this in every response


class _Tokenizer(Protocol):
    vocab_size: int
    model_dir: Path

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...
    def id_to_token(self, token_id: int) -> str | None: ...


def _leading_space_marker(model_dir: Path) -> str | None:
    """The Metaspace replacement character of the tokenizer's pre-tokenizer, if any (detokenizer_utils)."""
    try:
        config = json.loads((Path(model_dir) / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return None
    pre = config.get("pre_tokenizer") or {}
    if pre.get("type") == "Metaspace":
        return pre.get("replacement", "\u2581")
    if pre.get("type") == "Sequence":
        for sub in pre.get("pretokenizers", []):
            if sub.get("type") == "Metaspace":
                return sub.get("replacement", "\u2581")
    return None


class LogprobSynth:
    """Makes the logprobs of one server's requests."""

    def __init__(self, tokenizer: _Tokenizer, special_token_ids: Sequence[int] = ()) -> None:
        self.tok = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.specials = frozenset(special_token_ids)
        self._marker: str | bool | None = False  # False: not read yet

    # ---- token strings ---------------------------------------------------------------------------------------------
    @property
    def marker(self) -> str | None:
        if self._marker is False:
            self._marker = _leading_space_marker(self.tok.model_dir)
        return self._marker  # type: ignore[return-value]

    def _decode_one(self, token_id: int) -> str:
        text = self.tok.decode([token_id]) or ""
        marker = self.marker
        if marker is not None:
            raw = self.tok.id_to_token(token_id) or ""
            n = len(raw) - len(raw.lstrip(marker))
            missing = n - (len(text) - len(text.lstrip(" ")))
            if n and missing > 0:
                text = " " * missing + text
        return text

    def decode(self, token_id: int, context: Sequence[int]) -> str:
        """vLLM's convert_ids_list_to_tokens + _verify_tokens for one id after the sampled `context` ids."""
        text = self._decode_one(token_id)
        if not text.endswith("\ufffd"):
            return text
        # A byte-fallback fragment: decode it with up to 4 preceding sampled tokens (_correct_decoded_token).
        decode = self.tok.decode
        for num_ctx in range(1, min(len(context), 4) + 1):
            ctx = list(context[-num_ctx:])
            full = decode([*ctx, token_id])
            if full.endswith("\ufffd"):
                continue
            clean_end = len(ctx)
            for j in range(len(ctx) - 1, -1, -1):
                if decode([ctx[j]]).endswith("\ufffd"):
                    clean_end = j
                else:
                    break
            prefix = decode(ctx[:clean_end]) if clean_end > 0 else ""
            if full.startswith(prefix):
                return full[len(prefix) :]
            common = 0
            for a, b in zip(prefix, full, strict=False):
                if a != b:
                    break
                common += 1
            return full[common:]
        return ""

    # ---- numbers ---------------------------------------------------------------------------------------------------
    def position(
        self, token_id: int, prev_id: int, index: int, num: int, context: Sequence[int], *, greedy: bool
    ) -> Position:
        """One position's entries: `token_id` (sampled or prompt token) with its rank, then the top `num` (-1: the
        whole vocabulary, which vLLM allows only when max_logprobs does)."""
        rng = random.Random((token_id * 1_000_003 + prev_id * 8_191 + index) & 0xFFFFFFFFFFFF)
        k = self.vocab_size if num == -1 else num
        depth = max(k, 4)
        # A peaked distribution: the top token holds 30-97 % of the mass, each next one a share of what is left.
        probs = [0.3 + 0.67 * rng.random() ** 0.7]
        rest = 1.0 - probs[0]
        for _ in range(1, min(depth, 64)):
            p = min(rest * (0.15 + 0.45 * rng.random()), probs[-1] * 0.98)
            probs.append(p)
            rest -= p
        while len(probs) < depth:  # a long flat tail (top_logprobs near the vocabulary size)
            p = min(rest * 0.5, probs[-1] * 0.98)
            probs.append(p)
            rest -= p
        if greedy:
            rank = 1
        else:
            u, rank, acc = rng.random(), 0, 0.0
            for i, p in enumerate(probs):
                acc += p
                if u < acc:
                    rank = i + 1
                    break
            if rank == 0:
                rank = depth + 1 + int(rng.random() * 50)
        own_p = probs[rank - 1] if rank <= depth else min(rest * 0.3, probs[-1] * 0.9)
        own = (token_id, _logprob(own_p), rank, self.decode(token_id, context))
        if k == 0:
            return [own]
        # The other ranks' tokens: distinct ordinary ids, drawn deterministically.
        out: dict[int, Entry] = {token_id: own}
        used = {token_id}
        vocab = self.vocab_size
        specials = self.specials
        for r in range(1, min(k, vocab) + 1):
            if r == rank:
                out[token_id] = own
                continue
            tid = rng.randrange(vocab)
            tries = 0
            while (tid in used or tid in specials) and tries < 64:
                tid = rng.randrange(vocab)
                tries += 1
            used.add(tid)
            p = probs[r - 1] if r <= depth else probs[-1]
            out[tid] = (tid, _logprob(p), r, self.decode(tid, context))
        return list(out.values())

    def sample_positions(
        self, output_ids: Sequence[int], start: int, prev: int, num: int, context: list[int], *, greedy: bool
    ) -> list[Position]:
        """Positions of newly sampled `output_ids`, the first at output index `start` after token `prev`;
        `context` (the request's sampled ids so far) is extended as vLLM's is."""
        out = []
        for i, tid in enumerate(output_ids):
            out.append(self.position(tid, prev, start + i, num, context[-4:], greedy=greedy))
            context.append(tid)
            prev = tid
        return out

    def prompt_positions(self, prompt_ids: Sequence[int], num: int) -> list[Position | None]:
        """vLLM's prompt_logprobs: None for the first token, then each prompt token against the top `num`."""
        out: list[Position | None] = [None]
        for i in range(1, len(prompt_ids)):
            ctx = prompt_ids[max(0, i - 4) : i]
            out.append(self.position(prompt_ids[i], prompt_ids[i - 1], -i, num, ctx, greedy=False))
        return out


def _logprob(p: float) -> float:
    return max(math.log(p), LOGPROB_FLOOR) if p > 0 else LOGPROB_FLOOR


def token_text(entry: Entry, as_token_id: bool) -> str:
    return f"token_id:{entry[0]}" if as_token_id else entry[3]


# ---- response shapes -------------------------------------------------------------------------------------------------


def completion_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[Position | None],
    num: int,
    decode: Any,
    *,
    initial_offset: int = 0,
    as_token_id: bool = False,
) -> dict[str, Any]:
    """CompletionLogProbs (vLLM's _create_completion_logprobs): `decode(id)` renders positions without logprobs."""
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top: list[dict[str, float] | None] = []
    last_len = 0
    for tid, pos in zip(token_ids, positions, strict=True):
        if pos is None:
            tok = f"token_id:{tid}" if as_token_id else decode(tid)
            tokens.append(tok)
            token_logprobs.append(None)
            top.append(None)
        else:
            own = next(e for e in pos if e[0] == tid)
            tok = token_text(own, as_token_id)
            tokens.append(tok)
            token_logprobs.append(max(own[1], LOGPROB_FLOOR))
            # The sampled token and the top `num`: vLLM keeps entries i <= num of the position's dict.
            shown = pos if num == -1 else pos[: num + 1]
            top.append({token_text(e, as_token_id): max(e[1], LOGPROB_FLOOR) for e in shown})
        text_offset.append(initial_offset if not text_offset else text_offset[-1] + last_len)
        last_len = len(tok)
    return {"text_offset": text_offset, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top}


def chat_logprobs(
    token_ids: Sequence[int], positions: Sequence[Position], top_logprobs: int, *, as_token_id: bool = False
) -> dict[str, Any]:
    """ChatCompletionLogProbs (vLLM's _create_chat_logprobs)."""
    content = []
    for tid, pos in zip(token_ids, positions, strict=True):
        own = next(e for e in pos if e[0] == tid)
        tops = []
        for e in pos if top_logprobs == -1 else pos[:top_logprobs]:
            t = token_text(e, as_token_id)
            tops.append({"token": t, "logprob": max(e[1], LOGPROB_FLOOR), "bytes": list(t.encode("utf-8", "replace"))})
        content.append(
            {
                "token": token_text(own, as_token_id),
                "logprob": max(own[1], LOGPROB_FLOOR),
                "bytes": list(own[3].encode("utf-8", "replace")),
                "top_logprobs": tops,
            }
        )
    return {"content": content}


def prompt_logprobs_json(positions: Sequence[Position | None]) -> list[dict[str, Any] | None]:
    """RequestOutput.prompt_logprobs as vLLM serializes it: {token id: {logprob, rank, decoded_token}} per position."""
    return [
        None
        if pos is None
        else {str(e[0]): {"logprob": max(e[1], LOGPROB_FLOOR), "rank": e[2], "decoded_token": e[3]} for e in pos}
        for pos in positions
    ]
