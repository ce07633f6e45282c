"""The router-side prefix cache of the approximate scorer: what text the router sent where, with no engine state.

Prompt text is cut into fixed-size character chunks whose hashes are chained (each seeds the next), so a chunk hash
names the whole text before it, like an engine block hash. Each endpoint gets an LRU of the chunk chains routed to
it, sized to what its KV cache can hold. llm-d sizes that LRU to the GPU tier only and so forgets prefixes the engine
still holds in CPU DRAM; here the LRU has two tiers, GPU then CPU, mirroring the engine's offload, and a hit in the
CPU part is weighted by the CPU tier weight.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import xxhash

from llmd.router.scheduling.state import Holder

_xxh3_64 = xxhash.xxh3_64_intdigest


def text_chunk_hashes(text: str, chunk_chars: int = 256) -> list[int]:
    """Chained 64-bit hashes of the full `chunk_chars`-character chunks of `text` (a trailing partial chunk is left
    out: it changes as the conversation grows, like a partial KV block). Deterministic across processes (xxh3, not
    Python's salted `hash`)."""
    if chunk_chars < 1:
        raise ValueError(f"chunk_chars must be >= 1, got {chunk_chars}")
    out: list[int] = []
    h = 0
    for i in range(0, len(text) - chunk_chars + 1, chunk_chars):
        h = _xxh3_64(text[i : i + chunk_chars].encode("utf-8", "surrogatepass"), h)
        out.append(h)
    return out


def _held_prefix(chain: Sequence[int], tier: OrderedDict[int, None], start: int = 0, hint: int = 0) -> int:
    """Length of the leading part of `chain[start:]` held in `tier`, in O(log n) probes; two when it is `hint` long.

    Binary search is valid because membership is prefix-closed: chains are inserted tail first (see `_TwoTierLRU`),
    so a chunk is always more recent than every chunk after it in any chain, and the LRU drops tails first.
    """
    n = len(chain) - start
    if n <= 0 or chain[start] not in tier:
        return 0
    lo, hi = 1, n  # chain[start:start + lo] is held; the held prefix is at most hi long
    if 0 < hint < n:
        if chain[start + hint - 1] in tier:
            if chain[start + hint] not in tier:
                return hint
            lo = hint + 1
        else:
            hi = hint - 1
    if chain[start + hi - 1] in tier:  # the common agentic case: the whole previous turn is still there
        return hi
    hi -= 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if chain[start + mid - 1] in tier:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _TwoTierLRU:
    """An LRU split into a recent GPU part and an older CPU part: GPU overflow moves to CPU, CPU overflow is dropped,
    and a chain routed again comes back to GPU, as the engine's offloading connector does with blocks."""

    __slots__ = ("cpu", "cpu_cap", "gpu", "gpu_cap")

    def __init__(self, gpu_cap: int, cpu_cap: int) -> None:
        self.gpu: OrderedDict[int, None] = OrderedDict()
        self.cpu: OrderedDict[int, None] = OrderedDict()
        self.gpu_cap = gpu_cap
        self.cpu_cap = cpu_cap

    def resize(self, gpu_cap: int, cpu_cap: int) -> None:
        self.gpu_cap = gpu_cap
        self.cpu_cap = cpu_cap
        self._spill()

    def add(self, chain: Sequence[int]) -> None:
        # Tail first, so the head ends up most recent and is evicted last (vLLM frees a request's blocks the same way).
        gpu = self.gpu
        cpu_pop = self.cpu.pop
        move = gpu.move_to_end
        for h in reversed(chain):
            if h in gpu:
                move(h)
            else:
                cpu_pop(h, None)
                gpu[h] = None
        self._spill()

    def _spill(self) -> None:
        gpu, cpu = self.gpu, self.cpu
        excess = len(gpu) - self.gpu_cap
        if excess > 0:
            pop = gpu.popitem
            if self.cpu_cap > 0:
                for _ in range(excess):
                    cpu[pop(last=False)[0]] = None
            else:
                for _ in range(excess):
                    pop(last=False)
        excess = len(cpu) - self.cpu_cap
        if excess > 0:
            pop = cpu.popitem
            for _ in range(excess):
                pop(last=False)

    def match(self, chain: Sequence[int], hint: tuple[int, int] = (0, 0)) -> tuple[int, int]:
        """(chunks held in any tier, of which in GPU), both leading prefixes of `chain`; `hint`, a likely answer
        (another endpoint's), makes it two probes a tier when it is the answer."""
        g = _held_prefix(chain, self.gpu, 0, hint[1])
        if g == len(chain) or not self.cpu:
            return g, g
        # GPU holds the most recent chunks, so past the GPU prefix the chain can only continue in CPU.
        c = _held_prefix(chain, self.cpu, g, hint[0] - hint[1])
        return g + c, g


class ApproxPrefixCache:
    """Per-endpoint two-tier LRUs of chunk chains, keyed by KVIndex holder.

    Capacity in chunks = KV blocks * block_size tokens * chars_per_token / chunk_chars (1 chunk per 64-token block at
    the defaults). `cpu_tier=False` reproduces llm-d's sizing (GPU blocks only) for comparisons.
    """

    def __init__(
        self,
        chunk_chars: int = 256,
        chars_per_token: float = 4.0,
        default_gpu_blocks: int = 100_000,
        cpu_tier: bool = True,
    ) -> None:
        if chunk_chars < 1 or chars_per_token <= 0:
            raise ValueError("chunk_chars must be >= 1 and chars_per_token > 0")
        self.chunk_chars = chunk_chars
        self.chars_per_token = chars_per_token
        self.default_gpu_blocks = default_gpu_blocks
        self.cpu_tier = cpu_tier
        self._lrus: dict[Holder, _TwoTierLRU] = {}

    def tokens_per_chunk(self) -> float:
        return self.chunk_chars / self.chars_per_token

    def capacity_chunks(self, gpu_blocks: int, cpu_blocks: int, block_size: int) -> tuple[int, int]:
        """(GPU, CPU) capacity in chunks; an unknown (0) GPU capacity falls back to `default_gpu_blocks`."""
        per_block = block_size * self.chars_per_token / self.chunk_chars
        gpu = max(1, int((gpu_blocks or self.default_gpu_blocks) * per_block))
        cpu = int(cpu_blocks * per_block) if self.cpu_tier else 0
        return gpu, cpu

    def record(self, holder: Holder, chain: Sequence[int], gpu_blocks: int, cpu_blocks: int, block_size: int) -> None:
        """The router sent `chain` to `holder`, whose KV cache holds `gpu_blocks` (+ `cpu_blocks` in CPU DRAM)."""
        if not chain:
            return
        gpu_cap, cpu_cap = self.capacity_chunks(gpu_blocks, cpu_blocks, block_size)
        lru = self._lrus.get(holder)
        if lru is None:
            lru = self._lrus[holder] = _TwoTierLRU(gpu_cap, cpu_cap)
        elif (lru.gpu_cap, lru.cpu_cap) != (gpu_cap, cpu_cap):
            lru.resize(gpu_cap, cpu_cap)
        lru.add(chain)

    def match(self, holder: Holder, chain: Sequence[int]) -> tuple[int, int]:
        """(leading chunks of `chain` remembered for `holder` in any tier, of which in its GPU tier)."""
        lru = self._lrus.get(holder)
        return lru.match(chain) if lru is not None and chain else (0, 0)

    def matches(self, chain: Sequence[int]) -> dict[Holder, tuple[int, int]]:
        """Every holder with a non-empty match: (any, gpu) chunks."""
        if not chain:
            return {}
        first = chain[0]
        out: dict[Holder, tuple[int, int]] = {}
        # Most endpoints that hold anything hold the same leading chunks (the system prompt every agent sends):
        # the previous one's answer, tried first, spares each of them a search (most of an approximate decision's
        # time at 544 endpoints).
        hint = (0, 0)
        for holder, lru in self._lrus.items():
            if first in lru.gpu or first in lru.cpu:  # one probe rules out most endpoints
                out[holder] = hint = lru.match(chain, hint)
        return out

    def size(self, holder: Holder) -> tuple[int, int]:
        """(GPU, CPU) chunks remembered for `holder`."""
        lru = self._lrus.get(holder)
        return (len(lru.gpu), len(lru.cpu)) if lru is not None else (0, 0)

    def forget_pod(self, pod: str) -> None:
        for holder in [h for h in self._lrus if h[0] == pod]:
            del self._lrus[holder]
