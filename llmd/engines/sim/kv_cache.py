"""vLLM v1's KV block pool and prefix cache, small: ref-counted GPU blocks, a hash->block map, an LRU free queue, the
KV events vLLM publishes, and an optional write-through CPU tier (vLLM's native OffloadingConnector).

Semantics follow vllm/v1/core/block_pool.py, kv_cache_utils.py (FreeKVCacheBlockQueue), kv_cache_manager.py and
single_type_kv_cache_manager.py (FullAttentionManager) of vLLM 0.32:
- block 0 is vLLM's null block: never handed out, so `num_gpu_blocks` means what vLLM's "# GPU blocks" means and
  usage is `1 - free / (num_gpu_blocks - 1)`;
- blocks are cached (and BlockStored published) when they are *scheduled* full, not when computed, exactly as
  `allocate_slots` caches `min(computed + new, num_tokens)` tokens;
- a freed request's blocks go back in reverse order; hashed ones to the tail of the free queue (LRU), unhashed ones to
  its head (reused first); a prefix hit takes its blocks out of the free queue; eviction happens when a free block
  that still has a hash is handed out, one BlockRemoved per block;
- the same hash may be cached in several blocks (a block-aligned prompt recomputes its last block), as in vLLM.

The per-block state (GPU pool, CPU tier) lives in block_pool.py's stores, in C where built; this class holds what
vLLM's managers decide with them: hits, allocation, caching, events and the prefix-cache counters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmd.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, hash64

from .block_pool import make_cpu_tier, make_pool
from .request import SimRequest

GPU = "GPU"
CPU = "CPU"


class KVCacheManager:
    """GPU block pool + prefix cache (+ CPU tier), vLLM's KV events. The pool's per-block state is `self.pool`
    (block_pool.py: in C where built)."""

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        *,
        num_cpu_blocks: int = 0,
        kv_cache_spec_kind: str | None = "full_attention",
        cpu_events_self_describing: bool = False,
        drop_last_hit_block: bool = False,
        event_token_ids: bool = True,
        coalesce_events: bool = False,
    ) -> None:
        if num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be >= 2 (block 0 is the null block)")
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.spec_kind = kv_cache_spec_kind
        # vLLM drops the last hit block under EAGLE/MTP so the drafter sees its inputs recomputed.
        self.drop_last_hit_block = drop_last_hit_block
        self.event_token_ids = event_token_ids  # False: GPU-tier BlockStored events carry no token ids
        # True: the blocks one allocation evicts go out as one BlockRemoved, and a CPU store job's blocks as one
        # BlockStored, where vLLM publishes one event per block. A consumer that applies hashes in order (the router's
        # index) ends in the same state; the cluster simulator saves an event object and an index call per block.
        self.coalesce_events = coalesce_events
        self.pool = make_pool(num_gpu_blocks)  # ref counts, free queue, hashes, hash map (block_pool.py)
        self.events: list[KVCacheEvent] = []

        self.cpu_capacity = num_cpu_blocks
        self.cpu_self_describing = cpu_events_self_describing
        self.cpu = make_cpu_tier(num_cpu_blocks)  # the hashes it holds, LRU order (block_pool.py)
        # Store jobs of this step, written to the CPU tier after the step (write-through, as vLLM offloads): the
        # blocks' hashes, their event form, and (self-describing events) each one's (parent hash, token ids).
        self._cpu_jobs: list[tuple[list[bytes], list[int], list[tuple[bytes | None, list[int]]] | None]] = []

        # vLLM's PrefixCacheStats (tokens): requests never preempted, preempted ones apart; connector stats apart.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.preempted_prefix_cache_queries = 0
        self.preempted_prefix_cache_hits = 0
        self.external_prefix_cache_queries = 0
        self.external_prefix_cache_hits = 0
        self.cpu_hit_tokens = 0
        self.cpu_stored_blocks = 0
        self.cpu_evicted_blocks = 0
        self.gpu_evicted_blocks = 0

    # --- state ------------------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.n_free

    def unhashed_free_front(self, limit: int) -> int:
        """How many blocks the next allocations can take, at most `limit`, without evicting a cached one (so without
        a KV event)."""
        return self.pool.unhashed_front(limit)

    @property
    def free_queue(self) -> list[int]:
        """The free blocks in eviction order (front first)."""
        return self.pool.free_queue()

    @property
    def block_hash(self) -> list[bytes | None]:
        """Each block's hash, None for an unhashed one (a copy: for tests and invariants)."""
        return self.pool.hashes()

    @property
    def ref_cnt(self) -> list[int]:
        """Each block's ref count (a copy)."""
        return self.pool.ref_counts()

    @property
    def usage(self) -> float:
        """vLLM's kv_cache_usage_perc (a fraction): blocks held by requests, the null block excluded."""
        return 1.0 - self.pool.n_free / (self.num_gpu_blocks - 1)

    @property
    def cpu_usage(self) -> float:
        return len(self.cpu) / self.cpu_capacity if self.cpu_capacity else 0.0

    def take_events(self) -> list[KVCacheEvent]:
        ev = self.events
        self.events = []
        return ev

    # --- prefix lookup ----------------------------------------------------------------------------------------------
    def get_computed_blocks(self, req: SimRequest) -> tuple[list[int], int, int]:
        """Longest cached prefix of full blocks: (GPU blocks, GPU hit tokens, CPU-tier tokens continuing it).

        Never the whole sequence: the last token is always recomputed to get logits (max hit = num_tokens - 1), which
        can cost a whole block when the prompt is block aligned.
        """
        if req.skip_reading_prefix_cache:
            return [], 0, 0
        bs = self.block_size
        hashes = req.block_hashes
        max_blocks = min((req.num_tokens - 1) // bs, len(hashes))
        blocks = self.pool.lookup(hashes, max_blocks)
        n_gpu = j = len(blocks)
        if self.cpu_capacity and n_gpu < max_blocks:
            j += self.cpu.run(hashes, n_gpu, max_blocks)  # the CPU tier's run past the GPU hit
        if self.drop_last_hit_block and j > 0:
            if j > n_gpu:
                j -= 1
            else:
                blocks.pop()
                n_gpu -= 1
                j = n_gpu
        if j > n_gpu:
            self.cpu.touch(hashes[n_gpu:j])  # a hit refreshes the CPU LRU
        return blocks, n_gpu * bs, (j - n_gpu) * bs

    def lookup_cached(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of `block_hashes` this engine holds (GPU cache or CPU tier): serves P2P pulls."""
        pool = self.pool
        cpu = self.cpu
        n = 0
        for h in block_hashes:
            if h not in pool and h not in cpu:
                break
            n += 1
        return n

    def record_prefix_cache_stats(
        self, req: SimRequest, local_hit_tokens: int, external_hit_tokens: int, has_connector: bool
    ) -> None:
        """At admission, as vLLM: queries are the request's tokens; connector queries what the local hit left. A
        request that skips the prefix cache (prompt logprobs) is not counted."""
        if req.skip_reading_prefix_cache:
            return
        if req.num_preemptions > 0:
            # vLLM files re-admissions apart (preempted_*), outside vllm:prefix_cache_* and the connector counters.
            self.preempted_prefix_cache_queries += req.num_tokens
            self.preempted_prefix_cache_hits += local_hit_tokens
            return
        self.prefix_cache_queries += req.num_tokens
        self.prefix_cache_hits += local_hit_tokens
        q = req.num_tokens - local_hit_tokens
        if has_connector and q:
            self.external_prefix_cache_queries += q
            self.external_prefix_cache_hits += external_hit_tokens

    # --- allocation -------------------------------------------------------------------------------------------------
    def allocate_slots(
        self,
        req: SimRequest,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] = (),
        num_external_tokens: int = 0,
        delay_cache: bool = False,
        reserved_blocks: int = 0,
    ) -> bool:
        """Gives `req` slots for `num_new_tokens` more tokens (after its hits); False if the pool is too short.

        `new_computed_blocks` are prefix hits (first allocation only); `num_external_tokens` follow them and arrive
        from elsewhere (CPU tier, a pull). `delay_cache` leaves caching to whoever completes a pull, as vLLM does.
        `reserved_blocks` must stay free afterwards (what in-flight prefills still need).
        """
        bs = self.block_size
        num_hit = len(new_computed_blocks)
        total = req.num_computed_tokens + num_hit * bs + num_external_tokens
        need = total + num_new_tokens
        n_new = (need + bs - 1) // bs - len(req.block_ids) - num_hit
        if n_new > 0 or num_hit:
            pool = self.pool
            # A hit block sitting in the free queue leaves it when touched: it counts against the free blocks.
            n_evictable = pool.num_evictable(new_computed_blocks) if num_hit else 0
            if max(n_new, 0) + n_evictable + reserved_blocks > pool.n_free:
                return False
            if num_hit:
                pool.touch(new_computed_blocks)
                req.block_ids.extend(new_computed_blocks)
                req.num_cached_blocks = len(req.block_ids)
            if n_new > 0:
                req.block_ids.extend(self._get_new_blocks(n_new))
        if not delay_cache:
            n_cache = min(need, req.num_tokens)
            if n_cache // bs > req.num_cached_blocks:
                self.cache_blocks(req, n_cache)
        return True

    def _get_new_blocks(self, n: int) -> list[int]:
        """The first n blocks of the free queue, referenced once (the caller has checked there are n); those that
        still held a hash are evicted, published in the order handed out."""
        out, evicted = self.pool.take(n)
        if evicted:
            self.gpu_evicted_blocks += len(evicted)
            if self.coalesce_events:
                self.events.append(BlockRemoved(evicted, GPU, 0))
            else:
                self.events += [BlockRemoved([x], GPU, 0) for x in evicted]
        return out

    def cache_blocks(self, req: SimRequest, num_tokens: int) -> None:
        """Caches the request's full blocks up to `num_tokens` and publishes them in one BlockStored."""
        bs = self.block_size
        start = req.num_cached_blocks
        n_full = min(num_tokens // bs, len(req.block_hashes))
        if start >= n_full:
            return
        hashes = req.block_hashes
        new_hashes = hashes[start:n_full]
        new_blocks = req.block_ids[start:n_full]
        ev_hashes = self.pool.cache(new_blocks, new_hashes)  # each one's 64-bit form, for the events
        salt = req.cache_salt
        extra_keys: list[tuple[Any, ...] | None] = [None] * (n_full - start)
        if salt and start == 0:
            extra_keys[0] = (salt,)
        need_tokens = self.event_token_ids or (self.cpu_capacity and self.cpu_self_describing)
        tokens = req.tokens(start * bs, n_full * bs) if need_tokens else []
        self.events.append(
            BlockStored(
                ev_hashes,
                hash64(hashes[start - 1]) if start else None,
                tokens if self.event_token_ids else [],
                bs,
                None,
                GPU,
                None,
                extra_keys,
                0,
                self.spec_kind,
            )
        )
        req.num_cached_blocks = n_full
        if self.cpu_capacity:
            metas = None
            if self.cpu_self_describing:
                metas = [
                    (hashes[i - 1] if i else None, tokens[k * bs : (k + 1) * bs])
                    for k, i in enumerate(range(start, n_full))
                ]
            self._cpu_jobs.append((new_hashes, ev_hashes, metas))

    # --- freeing ----------------------------------------------------------------------------------------------------
    def free(self, req: SimRequest) -> None:
        """Returns the request's blocks, tail first, so a finished request's tail blocks are evicted first."""
        blocks = req.block_ids
        req.block_ids = []
        req.num_cached_blocks = 0
        if blocks:
            self.pool.free_reversed(blocks)

    def reset_prefix_cache(self) -> bool:
        """Drops every cached hash and publishes AllBlocksCleared; refused (False) while any block is in use."""
        if self.pool.n_free != self.num_gpu_blocks - 1:
            return False
        self.pool.clear_hashes()
        self.events.append(AllBlocksCleared())
        return True

    # --- CPU tier ---------------------------------------------------------------------------------------------------
    def flush_cpu_stores(self) -> None:
        """Writes this step's newly cached blocks to the CPU tier, as the offloading connector does after a step.

        Per store job: blocks already there are skipped; LRU victims make room (one BlockRemoved "CPU" per job); a job
        that cannot fit is dropped whole (vLLM's prepare_store returns None). Stored blocks are published with vLLM's
        default placeholder payload (hash only), or the full payload when `cpu_events_self_describing`.
        """
        jobs = self._cpu_jobs
        if not jobs:
            return
        self._cpu_jobs = []
        cpu = self.cpu
        events = self.events
        bs = self.block_size
        for hashes, h64s, metas in jobs:
            stored = cpu.store(hashes)
            if stored is None:
                continue  # every block there already, or more new blocks than the whole tier
            kept, evicted = stored
            if kept is not None:  # some were there already
                h64s = [h64s[i] for i in kept]
                if metas is not None:
                    metas = [metas[i] for i in kept]
            if evicted:
                self.cpu_evicted_blocks += len(evicted)
                events.append(BlockRemoved(evicted, CPU, 0))
            if metas is None:
                if self.coalesce_events:
                    events.append(BlockStored(h64s, None, [], 0, None, CPU, None, None, 0))
                else:
                    events += [BlockStored([x], None, [], 0, None, CPU, None, None, 0) for x in h64s]
            else:
                for x, (parent, tokens) in zip(h64s, metas, strict=True):
                    # vLLM defers extra keys on CPU events: published as None
                    events.append(
                        BlockStored(
                            [x],
                            None if parent is None else hash64(parent),
                            tokens,
                            bs,
                            None,
                            CPU,
                            None,
                            None,
                            0,
                            self.spec_kind,
                        )
                    )
            self.cpu_stored_blocks += len(h64s)

    # --- invariants (tests) -----------------------------------------------------------------------------------------
    def check_invariants(self, live: Sequence[SimRequest]) -> None:
        """Ref counts equal the number of live requests holding each block; free = blocks with ref 0 (not block 0)."""
        expect = [0] * self.num_gpu_blocks
        for r in live:
            for b in r.block_ids:
                expect[b] += 1
        assert expect[0] == 0, "the null block was handed out"
        assert expect == self.pool.ref_counts(), "ref counts disagree with the requests holding blocks"
        free = {b for b in range(1, self.num_gpu_blocks) if expect[b] == 0}
        queue = self.free_queue
        assert len(queue) == len(set(queue)) == self.pool.n_free, "free queue holds a block twice or miscounts"
        assert free == set(queue), "free queue disagrees with ref counts"
        block_hash = self.pool.hashes()
        cached = self.pool.cached
        for h, v in cached.items():
            ids = [v] if type(v) is int else list(v)
            for b in ids:
                assert block_hash[b] == h, "cached map points at a block with another hash"
        n_hashed = sum(1 for h in block_hash if h is not None)
        n_mapped = sum(1 if type(v) is int else len(v) for v in cached.values())
        assert n_hashed == n_mapped, "hashed blocks and cache map entries differ"
        assert len(self.cpu) <= self.cpu_capacity
