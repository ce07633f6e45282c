"""One request inside the simulated engine: its tokens, block hashes, KV blocks and lifecycle, as vLLM's v1 Request.

The simulated model never emits EOS (or any stop token) by itself: it generates exactly `max_tokens` tokens, or fewer
when the sequence reaches `max_model_len`, so every natural finish is "length". `eos_token_id` is kept only so the
server can echo it; "stop" is a valid finish reason for callers that stop a request on their own terms.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llmd.kv.hashing import BlockHasher


class RequestStatus(enum.IntEnum):
    """vLLM's RequestStatus subset; anything after PREEMPTED is finished (same ordering trick as vLLM)."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


class FinishReason(enum.StrEnum):
    """OpenAI finish_reason strings, as vLLM maps its finished statuses."""

    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"
    ERROR = "error"


FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class TokenSampler:
    """Draws token ids uniformly from [0, vocab_size) minus the special ids: the model's 'text'."""

    __slots__ = ("n", "specials")

    def __init__(self, vocab_size: int, special_token_ids: Sequence[int] = ()) -> None:
        self.specials = sorted({t for t in special_token_ids if 0 <= t < vocab_size})
        self.n = vocab_size - len(self.specials)
        if self.n <= 0:
            raise ValueError("vocab_size leaves no ordinary tokens once the special token ids are removed")

    def draw(self, rng: random.Random) -> int:
        t = int(rng.random() * self.n)
        # Shift past every special id at or below t: maps [0, n) onto the vocab without the specials.
        for s in self.specials:
            if t >= s:
                t += 1
            else:
                break
        return t


@dataclass(slots=True, eq=False, init=False)
class SimRequest:
    """A generation request. The caller fills the first block of fields; the engine owns the rest.

    `output_script` replays given output token ids instead of random ones (trace replay, golden tests); past its end
    the random tokens resume. `prompt_block_hashes`, when given, are the prompt's full-block hashes as this engine's
    hasher computes them (the cluster simulator extends a session's hashes turn by turn instead of rehashing a 195K
    token context per request); `prompt_token_ids` may then be any sequence that slices to lists (llmd.sim.tokens).

    __init__ is written out, with the signature the dataclass would generate: mypyc compiles it (not a generated one),
    and a simulation makes one of these per request and hop.
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    max_tokens: int
    arrival_time: float
    cache_salt: str | None
    eos_token_id: int | None
    kv_transfer_params: dict[str, Any] | None
    output_script: Sequence[int] | None
    skip_reading_prefix_cache: bool  # vLLM: requests that want prompt logprobs compute every token
    prompt_block_hashes: Sequence[bytes] | None

    # --- engine-owned state -------------------------------------------------------------------------------------
    status: RequestStatus
    num_tokens: int  # prompt + output, kept current (read several times per step)
    num_computed_tokens: int
    output_token_ids: list[int]
    # Chained full-block hashes over prompt + output, extended as tokens are appended (vLLM's request block hasher).
    block_hashes: list[bytes]
    # Prefix-cache hit tokens at first scheduling (local + CPU tier + pulled); -1 until then, as vLLM reports.
    num_cached_tokens: int
    # Local + external hit tokens at first scheduling (vLLM's PrefillStats.num_cached_tokens, never overridden by the
    # prefill side's remote_prefill_cached_tokens): what the prefix cache held before this request wrote to it.
    num_prefill_cached_tokens: int
    num_preemptions: int
    finish_reason: FinishReason | None
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    # KV blocks, in sequence order, and how many leading ones are already in the prefix cache (vLLM keeps both in
    # its single-type manager; here they live on the request to save a dict lookup per step).
    block_ids: list[int]
    num_cached_blocks: int
    # P/D and P2P: a pull still to be done at first admission (vLLM flips do_remote_prefill off once it is handled).
    pull_pending: bool
    # Tokens of this request's prompt that will arrive by pull, and the local hit they continue (for finish_pull).
    pull_tokens: int
    pull_local_tokens: int
    rng: random.Random | None = field(repr=False)
    # The seed `rng` is made from on first use: most requests replay an output script and never draw, and seeding a
    # Random from a string (a SHA-512) was ~1% of a 544-GPU simulation.
    rng_seed: str = field(repr=False)
    hasher: BlockHasher | None = field(repr=False)
    # `output_script` as a list, made on the first draw: a script of runs (llmd.sim.tokens) costs a numpy call per
    # slice, and a decode reads it every step.
    script_tokens: list[int] | None = field(repr=False)

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        arrival_time: float = 0.0,
        cache_salt: str | None = None,
        eos_token_id: int | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        output_script: Sequence[int] | None = None,
        skip_reading_prefix_cache: bool = False,
        prompt_block_hashes: Sequence[bytes] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.max_tokens = max_tokens
        self.arrival_time = arrival_time
        self.cache_salt = cache_salt
        self.eos_token_id = eos_token_id
        self.kv_transfer_params = kv_transfer_params
        self.output_script = output_script
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        self.prompt_block_hashes = prompt_block_hashes
        self.status = RequestStatus.WAITING
        self.num_tokens = 0
        self.num_computed_tokens = 0
        self.output_token_ids = []
        self.block_hashes = []
        self.num_cached_tokens = -1
        self.num_prefill_cached_tokens = 0
        self.num_preemptions = 0
        self.finish_reason = None
        self.first_scheduled_time = None
        self.first_token_time = None
        self.finished_time = None
        self.block_ids = []
        self.num_cached_blocks = 0
        self.pull_pending = False
        self.pull_tokens = 0
        self.pull_local_tokens = 0
        self.rng = None
        self.rng_seed = ""
        self.hasher = None
        self.script_tokens = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of prompt + output, without materialising the concatenation."""
        p = self.prompt_token_ids
        n = len(p)
        if end <= n:
            return p[start:end]  # type: ignore[return-value]  # a list, or llmd.sim.tokens' runs, which slice to one
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return p[start:] + self.output_token_ids[: end - n]  # type: ignore[operator]

    def init_engine_state(self, hasher: BlockHasher, rng: random.Random | str) -> None:
        """`rng`: the request's sampler, or the seed to make it from when it first draws."""
        self.num_tokens = len(self.prompt_token_ids) + len(self.output_token_ids)
        self.hasher = hasher
        if isinstance(rng, str):
            self.rng, self.rng_seed = None, rng
        else:
            self.rng = rng
        given = self.prompt_block_hashes
        if given is not None and len(given) == len(self.prompt_token_ids) // hasher.block_size:
            self.block_hashes = list(given)
        else:
            self.block_hashes = hasher.hash_tokens(self.prompt_token_ids, cache_salt=self.cache_salt)

    def append_output(self, token_ids: list[int]) -> None:
        """Appends sampled tokens and hashes every block they complete (per block, not per token)."""
        self.output_token_ids.extend(token_ids)
        # Only append_output adds tokens: counting them saves a len() of the prompt (a Python call for token runs).
        self.num_tokens = n = self.num_tokens + len(token_ids)
        hasher = self.hasher
        assert hasher is not None  # init_engine_state has run: the request is in an engine
        hashes = self.block_hashes
        bs = hasher.block_size
        n_full = n // bs
        i = len(hashes)
        if i >= n_full:
            return
        if i == 0 and self.cache_salt:
            hashes.append(hasher.hash_block(None, self.tokens(0, bs), (("cache_salt", self.cache_salt),)))
            i = 1
        if i < n_full:  # plain blocks, chained in one call (the hasher's C pickle where built)
            hashes += hasher.chain(hashes[-1] if hashes else None, self.tokens(i * bs, n_full * bs), 0, n_full - i)

    def draw_tokens(self, n: int, sampler: TokenSampler) -> list[int]:
        script = self.script_tokens
        if script is None:
            given = self.output_script
            if given is None:
                draw = sampler.draw
                rng = self._rng()
                return [draw(rng)] if n == 1 else [draw(rng) for _ in range(n)]
            # Only the first max_tokens can ever be read. A slice of token runs is a list already: no second copy.
            if type(given) is not list:
                given = given[: self.max_tokens]
                if type(given) is not list:
                    given = list(given)
            script = self.script_tokens = given
        k = len(self.output_token_ids)
        out = script[k : k + n]
        while len(out) < n:
            out.append(sampler.draw(self._rng()))
        return out

    def _rng(self) -> random.Random:
        rng = self.rng
        if rng is None:
            rng = self.rng = random.Random(self.rng_seed)
        return rng
