"""vLLM v1's continuous-batching scheduler (vllm/v1/core/sched/scheduler.py, FCFS policy), small.

Each step has a budget of `max_num_batched_tokens` and at most `max_num_seqs` running requests. RUNNING requests come
first, in admission order: a decode takes 1 token (1 + drafts with MTP), a prefill chunk what is left of its prompt
within the budget. When a running request cannot get KV blocks, the most recently admitted running request is
preempted (recompute mode: blocks freed, back to the front of WAITING) until it fits or it is itself the victim. Only
when no request was preempted this step are waiting requests admitted, FCFS: requests whose pulled KV has arrived
first, then the WAITING queue; a request that does not fit stops admission (no skipping ahead), as in vLLM.

A request parked for a pull holds its blocks without making progress and cannot be preempted, so (as vLLM's
`_inflight_prefill_reserved_blocks`) it is admitted only if the blocks every in-flight prefill still needs to reach
its full prompt stay free: otherwise parked requests could hold the pool while the one ahead of them waits forever.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .kv_cache import KVCacheManager
from .request import RequestStatus, SimRequest

_RUNNING = RequestStatus.RUNNING
_WAITING = RequestStatus.WAITING
_PREEMPTED = RequestStatus.PREEMPTED
_WAITING_FOR_REMOTE_KVS = RequestStatus.WAITING_FOR_REMOTE_KVS


@dataclass(slots=True, init=False)
class SchedulerOutput:
    """What one step computes. Prefill chunks include resumed (preempted) requests recomputing their tokens.
    (__init__ written out: mypyc compiles it, not the dataclass's generated one; one is made every step.)"""

    prefills: list[tuple[SimRequest, int]]  # (request, new tokens); context = computed
    decodes: list[tuple[SimRequest, int]]  # (request, 1 + draft tokens)
    num_scheduled_tokens: int
    preempted: list[SimRequest]
    new_pulls: list[SimRequest]  # entered WAITING_FOR_REMOTE_KVS this step
    cpu_restore_tokens: list[int]  # per admitted request that hit the CPU tier

    def __init__(
        self,
        prefills: list[tuple[SimRequest, int]] | None = None,
        decodes: list[tuple[SimRequest, int]] | None = None,
        num_scheduled_tokens: int = 0,
        preempted: list[SimRequest] | None = None,
        new_pulls: list[SimRequest] | None = None,
        cpu_restore_tokens: list[int] | None = None,
    ) -> None:
        self.prefills = [] if prefills is None else prefills
        self.decodes = [] if decodes is None else decodes
        self.num_scheduled_tokens = num_scheduled_tokens
        self.preempted = [] if preempted is None else preempted
        self.new_pulls = [] if new_pulls is None else new_pulls
        self.cpu_restore_tokens = [] if cpu_restore_tokens is None else cpu_restore_tokens


class EngineScheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        num_speculative_tokens: int = 0,
        has_connector: bool = True,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.num_spec = num_speculative_tokens
        self.has_connector = has_connector
        self.running: list[SimRequest] = []
        self.waiting: deque[SimRequest] = deque()
        # Requests whose pull finished (or must now recompute): they hold KV blocks, so vLLM admits them first.
        self.kv_ready: deque[SimRequest] = deque()
        self.pulling: dict[str, SimRequest] = {}
        # Requests between admission and the end of their prefill (chunked, or parked for a pull): vLLM reserves the
        # blocks they still need when it admits a pull.
        self.inflight_prefills: dict[str, SimRequest] = {}
        self.num_preemptions = 0
        bs = kv.block_size
        self._spec_step_blocks = -(-(1 + num_speculative_tokens) // bs) if num_speculative_tokens else 0

    @property
    def num_waiting(self) -> int:
        """vLLM's num_requests_waiting: WAITING, PREEMPTED and WAITING_FOR_REMOTE_KVS."""
        return len(self.waiting) + len(self.kv_ready) + len(self.pulling)

    def add(self, req: SimRequest) -> None:
        self.waiting.append(req)

    def remove(self, req: SimRequest) -> None:
        """Takes an unfinished request out of whichever queue holds it (abort, pull failure)."""
        self.inflight_prefills.pop(req.request_id, None)
        if req.status == _RUNNING:
            self.running.remove(req)
        elif req.status == _WAITING_FOR_REMOTE_KVS:
            self.pulling.pop(req.request_id, None)
        elif req in self.kv_ready:
            self.kv_ready.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def _reserved_blocks(self) -> int:
        bs = self.kv.block_size
        extra = 1 + self.num_spec if self.num_spec else 0
        total = 0
        for r in self.inflight_prefills.values():
            need = -(-(min(r.num_tokens, self.max_model_len) + extra) // bs) - len(r.block_ids)
            if need > 0:
                total += need
        return total

    def _preempt(self, req: SimRequest) -> None:
        self.inflight_prefills.pop(req.request_id, None)
        self.kv.free(req)
        req.status = _PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        kv = self.kv
        budget = self.max_num_batched_tokens
        max_len = self.max_model_len
        num_spec = self.num_spec
        running = self.running
        prefills = out.prefills
        decodes = out.decodes
        inflight = self.inflight_prefills

        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.num_computed_tokens
            ntok = req.num_tokens
            # A decode has every token but the last sampled one computed. A prefill (or a preempted request's
            # recompute) whose chunk stopped one short of the end is still a prefill: one token, no drafts, as vLLM.
            decode = computed == ntok - 1 and req.output_token_ids and req.request_id not in inflight
            if decode:
                n = 1
                if num_spec:
                    # Drafts past the request's last token would be thrown away: don't schedule them.
                    n += max(0, min(num_spec, req.max_tokens - len(req.output_token_ids) - 1, max_len - ntok - 1))
            else:
                n = ntok - computed
            n = min(n, budget, max_len - computed)
            if n <= 0:
                i += 1
                continue
            fits = True
            while not kv.allocate_slots(req, n):
                victim = running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    fits = False
                    break
            if not fits:
                break
            if decode:
                decodes.append((req, n))
            else:
                prefills.append((req, n))
                if computed + n < ntok:
                    inflight[req.request_id] = req
                else:
                    inflight.pop(req.request_id, None)
            budget -= n
            i += 1

        if not out.preempted:
            budget = self._admit(out, budget)
        out.num_scheduled_tokens = self.max_num_batched_tokens - budget
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        kv = self.kv
        running = self.running
        while budget > 0 and len(running) < self.max_num_seqs:
            queue = self.kv_ready if self.kv_ready else self.waiting
            if not queue:
                break
            req = queue[0]
            pull = False
            n_cpu = 0
            if req.num_computed_tokens == 0:
                blocks, n_local, n_cpu = kv.get_computed_blocks(req)
                if req.pull_pending:
                    # The NIXL connector claims the request (first connector wins): no CPU-tier load for it.
                    n_cpu = 0
                    n_ext = self._pull_tokens(req, n_local)
                    pull = n_ext > 0
                else:
                    n_ext = n_cpu
                computed = n_local + n_ext
                n = 0 if pull else min(req.num_tokens - computed, budget)
                reserved = self._reserved_blocks() + self._spec_step_blocks if pull else 0
                if not kv.allocate_slots(req, n, blocks, n_ext, delay_cache=pull, reserved_blocks=reserved):
                    break
                kv.record_prefix_cache_stats(req, n_local, n_ext, self.has_connector or n_cpu > 0)
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = req.num_prefill_cached_tokens = n_local + n_ext
                    params = req.kv_transfer_params
                    if pull and params is not None:
                        # vLLM reports the prefill side's hits on the decode side when the proxy forwards them.
                        cached = params.get("remote_prefill_cached_tokens")
                        if isinstance(cached, int):
                            req.num_cached_tokens = cached
                if n_cpu:
                    kv.cpu_hit_tokens += n_cpu
                    out.cpu_restore_tokens.append(n_cpu)
            else:
                # Pulled KV arrived: blocks are held and cached; only the tail (usually the last token) is computed.
                computed = req.num_computed_tokens
                n = min(req.num_tokens - computed, budget)
                if not kv.allocate_slots(req, n):
                    break
            queue.popleft()
            req.num_computed_tokens = computed
            if pull:
                req.pull_pending = False
                req.pull_local_tokens = computed - n_ext
                req.pull_tokens = n_ext
                req.status = _WAITING_FOR_REMOTE_KVS
                self.pulling[req.request_id] = req
                self.inflight_prefills[req.request_id] = req
                out.new_pulls.append(req)
                continue
            req.status = _RUNNING
            running.append(req)
            out.prefills.append((req, n))
            if computed + n < req.num_tokens:
                self.inflight_prefills[req.request_id] = req
            else:
                self.inflight_prefills.pop(req.request_id, None)
            budget -= n
        return budget

    def _pull_tokens(self, req: SimRequest, n_local: int) -> int:
        """Tokens a pull will bring beyond the local hit.

        P/D (vLLM NixlConnector): the whole prompt; the decode side then recomputes only the last token. P2P (by hash
        from a peer's cache, no remote request): the peer's full blocks, at most `remote_num_tokens`.
        """
        params = req.kv_transfer_params or {}
        if params.get("remote_request_id") is not None:
            return req.num_prompt_tokens - n_local
        bs = self.kv.block_size
        peer = min(int(params.get("remote_num_tokens") or 0), req.num_prompt_tokens)
        return max(0, peer // bs * bs - n_local)
