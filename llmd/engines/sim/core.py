"""The simulated vLLM engine core: pure and deterministic. Time comes in as `now`; each step says how long it took.

The server drives it: `add_request`/`abort_request` as requests come and go, `step(now)` whenever `has_work()`, the
step's `duration_s` from the latency model decides when its outputs and KV events are delivered (at now + duration).
P/D and P2P transfers run outside (the server does the network part): the core hands out `PullTask`s and is told when
they finish; a prefill side keeps finished requests' blocks leased until pulled or expired.
"""

from __future__ import annotations

import contextlib
import heapq
import random
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from llmd.kv.events import KVCacheEvent
from llmd.kv.hashing import BlockHasher

from .decode_run import DecodeRun, plan
from .kv_cache import KVCacheManager
from .request import FINISH_REASONS, FinishReason, RequestStatus, SimRequest, TokenSampler
from .scheduler import EngineScheduler, SchedulerOutput
from .uniforms import UniformStream, vectorisable

if TYPE_CHECKING:
    from llmd.perf.latency import Uniforms

_RUNNING = RequestStatus.RUNNING
_FINISHED_LENGTH = RequestStatus.FINISHED_LENGTH_CAPPED
_FIRST_FINISHED = RequestStatus.FINISHED_STOPPED
_PREEMPTED = RequestStatus.PREEMPTED
_WAITING = RequestStatus.WAITING
_LENGTH = FinishReason.LENGTH
_STATUS_FOR = {reason: status for status, reason in FINISH_REASONS.items()}


class StepCostModel(Protocol):
    """What the core needs from llmd/perf/latency.py."""

    def step_time(self, prefill: Sequence[tuple[int, int]], decode: Sequence[int]) -> float: ...
    def cpu_restore_time(self, num_tokens: int) -> float: ...
    def kv_transfer_time(self, num_tokens: int, same_node: bool) -> float: ...
    def tokens_per_decode_step(self) -> float: ...
    def sample_accepted(self, rng: Uniforms) -> int: ...


@dataclass(slots=True)
class SimEngineConfig:
    block_size: int = 64
    hash_algo: str = "sha256"
    hash_seed: str | None = None  # the PYTHONHASHSEED a real engine would run with
    num_gpu_blocks: int = 4096  # vLLM's "# GPU blocks", the null block included
    num_cpu_blocks: int = 0  # CPU tier (vLLM native offloading); 0 = off
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 32768
    vocab_size: int = 32000
    special_token_ids: tuple[int, ...] = ()
    seed: int = 0
    engine_id: str = "sim-engine"
    dp_rank: int = 0
    role: Literal["both", "prefill", "decode"] = "both"  # informational: any engine serves both legs, as vLLM kv_both
    kv_lease_s: float = 30.0  # vLLM NixlConnector kv_lease_duration
    # vLLM's kv_load_failure_policy (default "fail"): a failed pull fails the request, or it prefills locally.
    pull_failure_policy: Literal["recompute", "fail"] = "fail"
    num_speculative_tokens: int = 0  # MTP drafts per step; 0 = off
    kv_transfer: bool = True  # a KV connector (NixlConnector) is configured: kv_transfer_params are honoured
    side_channel_host: str = "localhost"  # VLLM_NIXL_SIDE_CHANNEL_HOST
    side_channel_port: int = 5600  # VLLM_NIXL_SIDE_CHANNEL_PORT; the published port adds dp_rank
    tp_size: int = 1
    kv_cache_spec_kind: str = "full_attention"  # "mla_attention" for MLA models (GLM, DeepSeek)
    cpu_events_self_describing: bool = False  # vLLM's self_describing_kv_events for CPU-tier BlockStored
    enable_mfu_metrics: bool = False  # vLLM's --enable-mfu-metrics: steps report their estimated work
    # BlockStored events carry the blocks' token ids, as vLLM's do; a consumer that reads only the hashes (the cluster
    # simulator's router) saves producing them: a long prompt's ids are tens of thousands of ints per event.
    event_token_ids: bool = True
    # One event per evicting allocation and per CPU store job instead of per block (KVCacheManager.coalesce_events):
    # for the cluster simulator, whose router index ends the same either way; a live engine speaks vLLM's stream.
    coalesce_events: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_gpu_blocks < 2:
            raise ValueError("block_size must be >= 1 and num_gpu_blocks >= 2")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise ValueError("max_num_seqs, max_num_batched_tokens must be >= 1 and max_model_len >= 2")
        # vLLM refuses to start when one max_model_len sequence cannot fit in the KV cache; so do we (it also means a
        # lone request can always run, so preemption cannot livelock).
        need = -(-self.max_model_len // self.block_size)
        if need > self.num_gpu_blocks - 1:
            raise ValueError(
                f"max_model_len {self.max_model_len} needs {need} KV blocks of {self.block_size} tokens, "
                f"more than the {self.num_gpu_blocks - 1} usable blocks"
            )
        if self.pull_failure_policy not in ("recompute", "fail"):
            raise ValueError(f"pull_failure_policy must be 'recompute' or 'fail', got {self.pull_failure_policy!r}")


# The engine's per-step records are dataclasses with their __init__ written out (init=False): mypyc compiles a method
# written in the class, while the one the dataclass decorator generates runs as Python bytecode, and these are made
# for every step and output (~1.5% of a 544-GPU simulation). The same signature as the generated one.
@dataclass(slots=True, init=False)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    num_cached_tokens: int
    kv_transfer_params: dict[str, Any] | None
    # On a request's first output: prompt tokens it newly wrote to the prefix cache (vLLM's PrefillStats
    # num_cache_creation_tokens: its full cached blocks' tokens, at most the prompt, less what was cached before it).
    num_cache_creation_tokens: int | None

    def __init__(
        self,
        request_id: str,
        new_token_ids: list[int],
        finished: bool,
        finish_reason: FinishReason | None,
        num_cached_tokens: int,
        kv_transfer_params: dict[str, Any] | None = None,
        num_cache_creation_tokens: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.new_token_ids = new_token_ids
        self.finished = finished
        self.finish_reason = finish_reason
        self.num_cached_tokens = num_cached_tokens
        self.kv_transfer_params = kv_transfer_params
        self.num_cache_creation_tokens = num_cache_creation_tokens


@dataclass(slots=True, init=False)
class StepResult:
    duration_s: float
    outputs: list[RequestOutput]
    events: list[KVCacheEvent]
    scheduled_tokens: int
    num_running: int
    num_waiting: int
    num_preempted: int
    # --enable-mfu-metrics: the step's estimated (FLOPs, bytes read, bytes written) per GPU
    work: tuple[float, float, float] | None

    def __init__(
        self,
        duration_s: float,
        outputs: list[RequestOutput],
        events: list[KVCacheEvent],
        scheduled_tokens: int,
        num_running: int,
        num_waiting: int,
        num_preempted: int = 0,
        work: tuple[float, float, float] | None = None,
    ) -> None:
        self.duration_s = duration_s
        self.outputs = outputs
        self.events = events
        self.scheduled_tokens = scheduled_tokens
        self.num_running = num_running
        self.num_waiting = num_waiting
        self.num_preempted = num_preempted
        self.work = work


@dataclass(slots=True)
class PullTask:
    """KV the server must fetch for a request, then report with `finish_pull`.

    P/D (vLLM NixlConnector): `remote_request_id` and `remote_block_ids` name the prefill engine's leased blocks; the
    peer serves them with `lookup_lease` and the puller then calls `release_lease` there. P2P: `remote_request_id` is
    None and the peer is asked for `block_hashes` from its prefix cache (`lookup_cached`). Either way `num_tokens` start
    at prompt position `first_token` (after the local prefix hit) and land in `local_block_ids`.
    """

    request_id: str
    remote_engine_id: str | None
    remote_host: str | None
    remote_port: int | None
    remote_request_id: str | None
    remote_block_ids: list[int]
    block_hashes: list[bytes]
    local_block_ids: list[int]
    num_tokens: int
    first_token: int


@dataclass(slots=True)
class EngineStats:
    """Counters with vLLM's metric meanings (prefix cache counters in tokens)."""

    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float  # a fraction in [0, 1], as vLLM's gauge
    prefix_cache_queries: int
    prefix_cache_hits: int
    external_prefix_cache_queries: int  # connector (CPU tier, pulls) lookups: what the local hit left
    external_prefix_cache_hits: int
    cpu_prefix_cache_hits: int  # tokens restored from the CPU tier
    cpu_cache_usage_perc: float
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    request_success: dict[str, int]  # finished requests by finish reason
    num_leased_requests: int
    num_pulls_ok: int
    num_pulls_failed: int
    num_gpu_blocks_evicted: int
    num_cpu_blocks_stored: int
    num_cpu_blocks_evicted: int


class EngineCore:
    def __init__(self, config: SimEngineConfig, latency: StepCostModel) -> None:
        self.config = c = config
        self.latency = latency
        self.hasher = BlockHasher(c.block_size, c.hash_algo, c.hash_seed)
        self.kv = KVCacheManager(
            c.num_gpu_blocks,
            c.block_size,
            num_cpu_blocks=c.num_cpu_blocks,
            kv_cache_spec_kind=c.kv_cache_spec_kind,
            cpu_events_self_describing=c.cpu_events_self_describing,
            drop_last_hit_block=c.num_speculative_tokens > 0,
            event_token_ids=c.event_token_ids,
            coalesce_events=c.coalesce_events,
        )
        self.scheduler = EngineScheduler(
            self.kv,
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            max_model_len=c.max_model_len,
            num_speculative_tokens=c.num_speculative_tokens,
            has_connector=c.kv_transfer or c.num_cpu_blocks > 0,
        )
        self.sampler = TokenSampler(c.vocab_size, c.special_token_ids)
        # The MTP draws: where the latency model's acceptance draw can be replayed in bulk, the same sequence from a
        # stream decode fast-forward reads ahead in (plan_decode); random.Random otherwise.
        self._mtp_draws = _mtp_draws(latency) if c.num_speculative_tokens else None
        self._mtp_rng: random.Random | UniformStream = (
            UniformStream(f"{c.seed}/mtp") if self._mtp_draws is not None else random.Random(f"{c.seed}/mtp")
        )
        self.requests: dict[str, SimRequest] = {}  # unfinished requests
        self.leases: dict[str, SimRequest] = {}  # finished prefill legs whose blocks wait for a pull
        self._lease_heap: list[tuple[float, int, str]] = []
        self._lease_seq = 0
        self._pulls: list[PullTask] = []
        self._pending_outputs: list[RequestOutput] = []
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.request_success = {r.value: 0 for r in FinishReason}
        self.num_pulls_ok = 0
        self.num_pulls_failed = 0
        self.cpu_restores = 0  # admissions that copied a CPU-tier hit back into HBM, and the seconds that took
        self.cpu_restore_s = 0.0

    # --- requests ---------------------------------------------------------------------------------------------------
    def add_request(self, req: SimRequest) -> None:
        c = self.config
        if req.request_id in self.requests:
            raise ValueError(f"request {req.request_id!r} is already in the engine")
        if not req.prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(req.prompt_token_ids) > c.max_model_len:
            raise ValueError(f"prompt of {len(req.prompt_token_ids)} tokens exceeds max_model_len {c.max_model_len}")
        if req.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        req.init_engine_state(self.hasher, f"{c.seed}/{req.request_id}")
        params = req.kv_transfer_params
        if c.kv_transfer and params and params.get("do_remote_prefill"):
            req.pull_pending = _valid_pull_params(params)
        self.requests[req.request_id] = req
        self.scheduler.add(req)

    def abort_request(self, request_id: str, reason: str = FinishReason.ABORT) -> bool:
        """Ends an unfinished request and frees its blocks at once; False if unknown or already finished.

        `reason` is what the request success counters record: "abort" for a client that went away, "stop" when the
        server ends a request on a stop string (vLLM's frontend aborts those in the core but counts them as stop).
        """
        status = _STATUS_FOR[FinishReason(reason)]
        if status == _FINISHED_LENGTH:
            raise ValueError("a request ends by length only when it generates its last token")
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.remove(req)
        if self._pulls:
            self._pulls = [t for t in self._pulls if t.request_id != request_id]
        self._finish(req, status, None)
        return True

    def has_work(self) -> bool:
        s = self.scheduler
        return bool(s.running or s.waiting or s.kv_ready or self._pending_outputs)

    # --- the step ---------------------------------------------------------------------------------------------------
    def step(self, now: float) -> StepResult:
        self.expire_leases(now)
        so = self.scheduler.schedule()
        lat = self.latency
        duration = 0.0
        work = None
        if so.prefills or so.decodes:
            prefill = [(n, r.num_computed_tokens) for r, n in so.prefills]
            decode = [r.num_tokens for r, _ in so.decodes]
            duration = lat.step_time(prefill, decode)
            if self.config.enable_mfu_metrics:
                work = _step_work(lat, prefill, decode)
        for t in so.cpu_restore_tokens:
            restore = lat.cpu_restore_time(t)
            duration += restore
            self.cpu_restores += 1
            self.cpu_restore_s += restore
        end = now + duration
        for r in so.new_pulls:
            self._pulls.append(self._pull_task(r))

        outputs = self._pending_outputs
        self._pending_outputs = []
        finished: list[SimRequest] = []
        for r, n in so.prefills:
            if r.first_scheduled_time is None:
                r.first_scheduled_time = now
            r.num_computed_tokens += n
            if r.num_computed_tokens >= r.num_tokens:
                self._emit(r, 1, end, outputs, finished)
        if so.decodes:
            rng = self._mtp_rng
            for r, n in so.decodes:
                k = n - 1
                a = min(lat.sample_accepted(rng), k) if k > 0 else 0
                r.num_computed_tokens += 1 + a
                self._emit(r, 1 + a, end, outputs, finished)
        if finished:
            s = self.scheduler
            s.running = [r for r in s.running if r.status < _FIRST_FINISHED]
        self.kv.flush_cpu_stores()
        s = self.scheduler
        return StepResult(
            duration,
            outputs,
            self.kv.take_events(),
            so.num_scheduled_tokens,
            len(s.running),
            s.num_waiting,
            len(so.preempted),
            work,
        )

    # --- decode fast-forward (decode_run.py) ---------------------------------------------------------------------
    def plan_decode(self, now: float, max_steps: int = 256) -> DecodeRun | None:
        """The next steps from `now`, if they are decode-only steps nothing inside the core can change: at most
        `max_steps`, none with a finish, a first token, an admission or a preemption. None: call step().

        Nothing happens to the core but what step(now) does first (leases past their time expire); `advance` carries
        the steps out. Between the two, only `advance` may touch the core: anything else (a request, an abort, a
        finished pull, a released lease) comes after applying the steps begun by then, and the rest are dropped."""
        self.expire_leases(now)
        return plan(self, now, max_steps)

    def advance(self, run: DecodeRun, steps: int, complete: bool = True) -> list[KVCacheEvent]:
        """Carries out `run`'s steps up to `steps` as step() would; returns the KV events of the steps carried out.
        `complete=False`: the KV work only, the requests' tokens later (DecodeRun.apply)."""
        run.apply(self, steps, complete)
        return self.kv.take_events()

    def decode_outputs(self, run: DecodeRun, a: int, b: int) -> list[RequestOutput]:
        """Outputs of steps a..b-1, one per request: for b = a + 1 what step() gives for that step. Steps not yet
        carried out are, when a request's tokens are not all in its output script."""
        out = []
        for i, r in enumerate(run.requests):
            if r.status != _RUNNING:
                continue  # aborted meanwhile
            toks = run.tokens(i, a, b)
            if toks is None:
                run.apply(self, b)
                toks = run.tokens(i, a, b)
                assert toks is not None
            out.append(RequestOutput(r.request_id, toks, False, None, r.num_cached_tokens))
        return out

    def _emit(
        self, r: SimRequest, count: int, end: float, outputs: list[RequestOutput], finished: list[SimRequest]
    ) -> None:
        max_len = self.config.max_model_len
        n_out = len(r.output_token_ids)
        created = None
        if n_out == 0:
            cached = min(r.num_cached_blocks * self.config.block_size, r.num_prompt_tokens)
            created = max(0, cached - r.num_prefill_cached_tokens)
        if count > 1:
            # vLLM appends sampled tokens one by one and stops at max_tokens or max_model_len (always at least one).
            count = max(1, min(count, r.max_tokens - n_out, max_len - r.num_tokens))
        toks = r.draw_tokens(count, self.sampler)
        r.append_output(toks)
        self.generation_tokens_total += count
        first = n_out == 0
        if first and r.first_token_time is None:
            r.first_token_time = end
            self.prompt_tokens_total += r.num_prompt_tokens
        if n_out + count >= r.max_tokens or r.num_tokens >= max_len:
            params = self._finish(r, _FINISHED_LENGTH, end, first_output=first)
            del self.requests[r.request_id]
            finished.append(r)
            outputs.append(RequestOutput(r.request_id, toks, True, _LENGTH, r.num_cached_tokens, params, created))
        else:
            outputs.append(RequestOutput(r.request_id, toks, False, None, r.num_cached_tokens, None, created))

    def _finish(
        self, r: SimRequest, status: RequestStatus, end: float | None, first_output: bool = False
    ) -> dict[str, Any] | None:
        """Sets the final status; frees or leases the blocks; returns vLLM's kv_transfer_params for the response."""
        r.status = status
        reason = FINISH_REASONS[status]
        r.finish_reason = reason
        r.finished_time = end
        self.request_success[reason.value] += 1
        params = r.kv_transfer_params
        if (
            status == _FINISHED_LENGTH
            and self.config.kv_transfer
            and params
            and params.get("do_remote_decode")
            and r.block_ids
        ):
            return self._lease(r, end if end is not None else 0.0, first_output)
        self.kv.free(r)
        return None

    # --- P/D: the prefill side --------------------------------------------------------------------------------------
    def _lease(self, r: SimRequest, end: float, first_output: bool) -> dict[str, Any]:
        c = self.config
        bs = c.block_size
        block_ids = r.block_ids[: -(-r.num_computed_tokens // bs)]
        self.release_lease(r.request_id)  # a reused request id must not orphan the old lease's blocks
        self.leases[r.request_id] = r
        self._lease_seq += 1
        heapq.heappush(self._lease_heap, (end + c.kv_lease_s, self._lease_seq, r.request_id))
        # vLLM 0.32 NixlConnector (pull mode) request_finished() on the prefill side, key for key.
        params: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(block_ids)],  # one list per KV cache group
            "remote_engine_id": c.engine_id,
            "remote_request_id": r.request_id,
            "remote_host": c.side_channel_host,
            "remote_port": c.side_channel_port + c.dp_rank,
            "tp_size": c.tp_size,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": r.num_computed_tokens,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
        }
        if first_output:
            # vLLM adds it only when the request finishes on its first output (the usual max_tokens=1 leg).
            params["remote_prefill_cached_tokens"] = r.num_cached_tokens
        return params

    def lookup_lease(
        self, remote_request_id: str, block_ids: Sequence[int], now: float | None = None
    ) -> list[tuple[bytes | None, list[int]]] | None:
        """(full block hash or None for a partial block, token ids) per leased block asked for; None if the lease is
        unknown, expired (at `now`, when given) or the ids are not all the lease's."""
        r = self.leases.get(remote_request_id)
        if r is None:
            return None
        if now is not None and r.finished_time is not None and now > r.finished_time + self.config.kv_lease_s:
            return None
        bs = self.config.block_size
        index = {b: i for i, b in enumerate(r.block_ids)}
        out = []
        for b in block_ids:
            i = index.get(b)
            if i is None or i * bs >= r.num_computed_tokens:
                return None
            # Only blocks whose every token is in KV are full blocks here: the sampled token that may complete the
            # last block in the request's hashes was never computed.
            end = (i + 1) * bs
            h = r.block_hashes[i] if end <= r.num_computed_tokens else None
            out.append((h, r.tokens(i * bs, min(end, r.num_computed_tokens))))
        return out

    def release_lease(self, request_id: str) -> bool:
        """The puller is done (vLLM: the decode side's notification): free the leased blocks now."""
        r = self.leases.pop(request_id, None)
        if r is None:
            return False
        self.kv.free(r)
        return True

    def expire_leases(self, now: float) -> int:
        """Frees leases whose holder never pulled by `finished + kv_lease_s`; step() calls it."""
        heap = self._lease_heap
        n = 0
        while heap and heap[0][0] < now:
            _, _, rid = heapq.heappop(heap)
            r = self.leases.pop(rid, None)
            if r is not None:
                self.kv.free(r)
                n += 1
        return n

    def next_lease_expiry(self) -> float | None:
        """When the next lease runs out (the server may want to step then even when idle)."""
        heap = self._lease_heap
        while heap and heap[0][2] not in self.leases:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    # --- P/D and P2P: the pulling side ------------------------------------------------------------------------------
    def _pull_task(self, r: SimRequest) -> PullTask:
        params = r.kv_transfer_params or {}
        bs = self.config.block_size
        first_block = r.pull_local_tokens // bs
        end_tok = r.pull_local_tokens + r.pull_tokens
        remote_ids: list[int] = []
        rid = params.get("remote_request_id")
        if rid is not None:
            ids = params.get("remote_block_ids") or []
            if ids and isinstance(ids[0], list):
                ids = ids[0]
            remote_ids = list(ids[first_block:])
        port = params.get("remote_port")
        return PullTask(
            r.request_id,
            params.get("remote_engine_id"),
            params.get("remote_host"),
            int(port) if port is not None else None,
            rid,
            remote_ids,
            r.block_hashes[first_block : end_tok // bs],
            r.block_ids[first_block : -(-end_tok // bs)],
            r.pull_tokens,
            r.pull_local_tokens,
        )

    def pending_pulls(self) -> list[PullTask]:
        """Pulls to start, each handed out once."""
        p = self._pulls
        self._pulls = []
        return p

    def lookup_cached(self, block_hashes: Sequence[bytes]) -> int:
        """P2P, the serving peer: how many leading blocks of `block_hashes` are cached here (GPU or CPU tier)."""
        return self.kv.lookup_cached(block_hashes)

    def finish_pull(self, request_id: str, ok: bool, num_tokens: int | None = None) -> None:
        """A pull ended. ok: its blocks become computed and cached (BlockStored "GPU"), and the request goes on with
        the rest (for P/D just the last prompt token, as vLLM). `num_tokens` < the task's means only that many arrived
        (a P2P peer that lost blocks): the rest is prefilled locally. Not ok: the failure policy decides."""
        s = self.scheduler
        r = s.pulling.pop(request_id, None)
        if r is None:
            return  # aborted meanwhile, or unknown
        status = _PREEMPTED if r.num_preemptions else _WAITING
        if ok:
            self.num_pulls_ok += 1
            got = r.pull_tokens if num_tokens is None else max(0, min(num_tokens, r.pull_tokens))
            computed = r.pull_local_tokens + got
            if got < r.pull_tokens:
                computed -= computed % self.config.block_size  # only whole blocks are usable
            if computed > 0:
                self.kv.cache_blocks(r, computed)
                r.num_computed_tokens = min(computed, r.num_tokens - 1)
                r.status = status
                s.kv_ready.append(r)
                return
        else:
            self.num_pulls_failed += 1
            if self.config.pull_failure_policy == "fail":
                s.inflight_prefills.pop(request_id, None)
                del self.requests[request_id]
                self._finish(r, RequestStatus.FINISHED_ERROR, None)
                self._pending_outputs.append(
                    RequestOutput(request_id, [], True, FinishReason.ERROR, r.num_cached_tokens)
                )
                return
        # Recompute: start over with a local lookup; the pull is not retried (vLLM consumed do_remote_prefill).
        self.kv.free(r)
        r.num_computed_tokens = 0
        r.status = status
        s.kv_ready.append(r)

    # --- misc -------------------------------------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        """Events produced outside step() (finish_pull, reset_prefix_cache); step() returns its own."""
        return self.kv.take_events()

    def stats(self) -> EngineStats:
        kv = self.kv
        s = self.scheduler
        return EngineStats(
            num_requests_running=len(s.running),
            num_requests_waiting=s.num_waiting,
            kv_cache_usage_perc=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            external_prefix_cache_queries=kv.external_prefix_cache_queries,
            external_prefix_cache_hits=kv.external_prefix_cache_hits,
            cpu_prefix_cache_hits=kv.cpu_hit_tokens,
            cpu_cache_usage_perc=kv.cpu_usage,
            num_preemptions=s.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            request_success=dict(self.request_success),
            num_leased_requests=len(self.leases),
            num_pulls_ok=self.num_pulls_ok,
            num_pulls_failed=self.num_pulls_failed,
            num_gpu_blocks_evicted=kv.gpu_evicted_blocks,
            num_cpu_blocks_stored=kv.cpu_stored_blocks,
            num_cpu_blocks_evicted=kv.cpu_evicted_blocks,
        )

    def check_invariants(self) -> None:
        """Block accounting is exact (tests): every held block belongs to a live request or a lease."""
        self.kv.check_invariants([*self.requests.values(), *self.leases.values()])
        assert all(rid in self.requests for rid in self.scheduler.inflight_prefills), "a finished in-flight prefill"


def _step_work(lat: Any, prefill: Sequence[tuple[int, int]], decode: Sequence[int]) -> tuple[float, float, float]:
    """A step's (FLOPs, bytes read, bytes written) per GPU, back from the roofline's compute and memory seconds: the
    new tokens' KV is written, every other byte read."""
    b = lat.step_breakdown(prefill, decode)
    gpu = lat.gpu
    flops = b.compute_s * gpu.bf16_flops * gpu.mfu
    moved = b.memory_s * gpu.hbm_bw * gpu.bw_efficiency
    tokens = sum(n for n, _ in prefill) + len(decode) * (1 + getattr(lat, "mtp_draft_tokens", 0))
    written = min(tokens * lat.kv_bytes_per_token_gpu, moved)
    return flops, moved - written, written


_MTP_VECTORISABLE: weakref.WeakKeyDictionary[Any, tuple[float, int] | None] = weakref.WeakKeyDictionary()


def _mtp_draws(latency: StepCostModel) -> tuple[float, int] | None:
    """(acceptance per draft, drafts) when `latency.sample_accepted` is the chained draw decode fast-forward replays
    in bulk (llmd.perf's LatencyModel: it exposes both); checked once per latency model."""
    try:
        return _MTP_VECTORISABLE[latency]
    except (KeyError, TypeError):
        pass
    beta, k = getattr(latency, "draft_beta", None), getattr(latency, "mtp_draft_tokens", 0)
    got = None
    if isinstance(beta, float) and isinstance(k, int) and k > 0 and vectorisable(latency.sample_accepted, beta, k):
        got = (beta, k)
    with contextlib.suppress(TypeError):  # not weakly referenceable: checked again next time
        _MTP_VECTORISABLE[latency] = got
    return got


def _valid_pull_params(params: dict[str, Any]) -> bool:
    """Whether do_remote_prefill params name something to pull from (else the request prefills locally)."""
    if not all(params.get(k) is not None for k in ("remote_engine_id", "remote_host", "remote_port")):
        return False
    if params.get("remote_request_id") is not None:
        return bool(params.get("remote_block_ids"))
    return bool(params.get("remote_num_tokens"))


__all__ = [
    "EngineCore",
    "EngineStats",
    "PullTask",
    "RequestOutput",
    "SchedulerOutput",
    "SimEngineConfig",
    "StepCostModel",
    "StepResult",
]
