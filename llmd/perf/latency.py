"""The latency model: how long one engine step takes on one data-parallel rank, as a roofline.

    step time = max(compute, memory) + communication + fixed overhead

* compute: 2 FLOPs per weight per token through the linear layers (experts included: with expert parallelism every
  GPU receives, on average, as many token-expert pairs as its own tokens send out), plus attention over the context,
  at `mfu` of the GPU's peak (FP8 rate for FP8 weights). Prefill costs only the new (uncached) tokens; cached context
  costs attention only.
* memory: the rank's weights are streamed once per step (dense part plus the resident experts the batch touches),
  plus every context token's KV for decode and for the prefill chunks, plus the new KV written, at `bw_efficiency`
  of peak HBM bandwidth.
* communication: tensor-parallel all-reduces (2 per layer) and expert-parallel all-to-all (dispatch + combine per MoE
  layer) over NVLink, or over the NIC when the group spans nodes. By default not overlapped with compute
  (conservative); `comm_overlap` hides up to that fraction of it behind compute, as two-micro-batch overlap does.
* overhead: scheduling and kernel launches, per step and per layer (see GPUProfile.step_overhead).

Everything is pure arithmetic on constants precomputed in `__init__`, so `step_time` costs a few microseconds and the
same inputs always give the same answer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol

from llmd.perf.gpus import GPUProfile, get_gpu
from llmd.perf.models import ModelProfile, model_for_spec

if TYPE_CHECKING:
    from llmd.spec.model import DeploymentSpec

GiB = 2**30
_ACT_BYTES = 2  # activations travel in bf16 (TP all-reduce, EP combine)
All2All = Literal["low_latency", "high_throughput"]


class Uniforms(Protocol):
    """Where MTP acceptance draws come from: random.Random, or the simulated engine's replayable UniformStream."""

    def random(self) -> float: ...


@dataclass(frozen=True)
class Parallelism:
    """How one engine replica is split: `tp` GPUs per DP rank, `dp` ranks; `ep` shards the experts over all tp*dp
    GPUs of the replica (vLLM --enable-expert-parallel) instead of tensor-slicing every expert over the tp GPUs."""

    tp: int = 1
    dp: int = 1
    ep: bool = False

    def __post_init__(self) -> None:
        if self.tp < 1 or self.dp < 1:
            raise ValueError(f"tp and dp must be at least 1, got tp={self.tp}, dp={self.dp}")

    @property
    def gpus(self) -> int:
        return self.tp * self.dp

    @property
    def expert_shards(self) -> int:
        """GPUs the routed experts are spread over (1: every GPU holds a tensor slice of every expert)."""
        return self.tp * self.dp if self.ep else 1


class DecodeLine(NamedTuple):
    """A decode-only step's time as a function of its batch's total context x (LatencyModel.decode_line): step_time's
    own subexpressions for that batch, evaluated by `line_times` in step_time's order (a tuple: the C planner reads it
    as one, llmd/engines/sim/_decodeplan.c)."""

    p1: float  # attention's part that does not grow with x
    q: float  # tokens each sequence runs through the model per step
    n_half: float  # n * (q + 1) / 2: the positions each verified token sees among the step's own
    a_x: float  # attention seconds per context token (the indexer's with DSA)
    t1: float  # the linear layers and the LM head
    m1: float  # weights (and DSA's selected latents)
    m_y: float  # seconds per context token of KV read in full (the indexer's keys with DSA)
    tk: float  # the new KV written
    draft: float  # MTP drafting, added to compute and memory alike
    has_draft: bool
    comm: float
    hidden: float  # the communication comm_overlap hides, at most the busy time
    has_overlap: bool
    overhead: float


def line_times(line: DecodeLine, totals: Sequence[float]) -> list[float]:
    """step_time for each total context: step_time's float operations on `line`'s terms, in its order (the Python twin
    of _decodeplan.c's `line_times`)."""
    out = []
    for x in totals:
        compute = line.t1 + (line.p1 + line.q * (x + line.n_half) * line.a_x)
        memory = line.m1 + x * line.m_y + line.tk
        if line.has_draft:
            compute += line.draft
            memory += line.draft
        if compute == 0.0 and memory == 0.0:
            out.append(0.0)
            continue
        busy = compute if compute > memory else memory
        comm = line.comm
        if line.has_overlap:
            comm -= line.hidden if line.hidden < busy else busy
        out.append(busy + comm + line.overhead)
    return out


@dataclass(frozen=True)
class StepBreakdown:
    """The parts of one step's time, in seconds."""

    compute_s: float
    memory_s: float
    comm_s: float
    overhead_s: float

    @property
    def total_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.comm_s + self.overhead_s

    @property
    def bound(self) -> Literal["compute", "memory"]:
        return "compute" if self.compute_s >= self.memory_s else "memory"


def _draft_conditional_acceptance(k: int, rate: float) -> float:
    """The per-position acceptance probability b, given all earlier drafts were accepted, with b + b^2 + ... + b^k =
    k * rate: the chained (stop-at-first-rejection) draw that keeps vLLM's reported mean acceptance."""
    if k <= 0 or rate <= 0:
        return 0.0
    if rate >= 1:
        return 1.0
    target, lo, hi = k * rate, 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(1, k + 1)) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


class LatencyModel:
    """Step times of one DP rank of an engine serving `model` on `gpu` GPUs split as `par`.

    MTP: with `mtp_draft_tokens` = k > 0 every decode step verifies 1 + k tokens per sequence (compute x(1+k), weights
    and KV still read once) and runs k draft passes of the MTP layer. `mtp_acceptance` is the draft acceptance rate as
    vLLM reports it (accepted drafts / proposed drafts), so a step emits 1 + k * rate tokens on average: 3 drafts at
    0.65 give 2.95, the reference deployment's figure (64-70% -> 2.92-3.10).

    `gpus_per_node` decides NVLink versus the NIC for TP and EP groups; `max_num_batched_tokens` sizes the activation
    reserve in `max_kv_tokens`; `all2all` picks DeepEP's kernel family ("low_latency" for decode, "high_throughput"
    with per-node deduplication for prefill); `comm_overlap` in [0, 1] is the share of communication hidden behind
    compute (0: the plain additive roofline).
    """

    def __init__(
        self,
        gpu: GPUProfile,
        model: ModelProfile,
        par: Parallelism = Parallelism(),  # frozen, so one shared default is safe
        mtp_draft_tokens: int = 0,
        mtp_acceptance: float = 0.68,
        *,
        gpus_per_node: int = 8,
        max_num_batched_tokens: int = 8192,
        all2all: All2All = "low_latency",
        comm_overlap: float = 0.0,
    ) -> None:
        if mtp_draft_tokens < 0:
            raise ValueError(f"mtp_draft_tokens must be >= 0, got {mtp_draft_tokens}")
        if not 0 <= mtp_acceptance <= 1:
            raise ValueError(f"mtp_acceptance must be in [0, 1], got {mtp_acceptance}")
        if gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
        if all2all not in ("low_latency", "high_throughput"):
            raise ValueError(f"all2all must be 'low_latency' or 'high_throughput', not {all2all!r}")
        if not 0 <= comm_overlap <= 1:
            raise ValueError(f"comm_overlap must be in [0, 1], got {comm_overlap}")
        self.all2all, self.comm_overlap = all2all, comm_overlap
        self.gpu, self.model, self.par = gpu, model, par
        self.mtp_draft_tokens, self.mtp_acceptance = mtp_draft_tokens, mtp_acceptance
        self.gpus_per_node, self.max_num_batched_tokens = gpus_per_node, max_num_batched_tokens
        self.draft_beta = _draft_conditional_acceptance(mtp_draft_tokens, mtp_acceptance)
        self._lines: dict[int, DecodeLine] = {}  # decode_line's, by batch size

        m, tp, layers = model, par.tp, model.num_layers
        wb = m.weight_bytes_per_param
        self._q = 1 + mtp_draft_tokens  # tokens each decode sequence runs through the model per step

        # ---- compute: seconds per unit of work on one GPU of the rank ----
        lin_rate = (gpu.fp8_flops if wb <= 1 else gpu.bf16_flops) * gpu.mfu  # FP8 GEMMs for FP8 checkpoints
        attn_rate = gpu.bf16_flops * gpu.mfu  # flash attention / FlashMLA compute in bf16 even over an fp8 cache
        self._c_tok = 2 * m.compute_params_per_token / tp / lin_rate
        self._c_logit = 2 * m.vocab_size * m.hidden_size / tp / lin_rate  # LM head, only at sampled positions
        heads = math.ceil(m.num_q_heads / tp)
        if m.attention == "mla":
            # Decode runs MLA "absorbed": every head attends over the cached latent (QK over kv_lora + rope, PV over
            # kv_lora), as FlashMLA does. Dense prefill up-projects the context to per-head K/V (qk + v dims); DSA's
            # sparse kernels stay absorbed for prefill too.
            absorbed = (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
            prefill_dims = absorbed if m.index_topk else m.head_dim + m.v_dim
            decode_dims = absorbed
        else:
            prefill_dims = decode_dims = m.head_dim + m.v_dim
        # FLOPs per (query, key) pair: QK^T and PV, 2 FLOPs per multiply-add, every layer and local head.
        self._a_pf = 2 * layers * heads * prefill_dims / attn_rate
        self._a_dc = 2 * layers * heads * decode_dims / attn_rate
        self._topk = m.index_topk
        # DSA lightning indexer: every query scores every earlier token with index_n_heads fp8 dot products.
        self._a_idx = 2 * layers * m.index_n_heads * m.index_head_dim / (gpu.fp8_flops * gpu.mfu) if m.index_topk else 0
        # Dense MLA chunked prefill up-projects each cached context token's latent to per-head K (nope) and V again
        # every chunk (vLLM's context chunks): 2 * kv_b weights FLOPs per context token.
        nope = m.head_dim - m.qk_rope_head_dim
        self._c_ctx = (
            2 * layers * m.kv_lora_rank * heads * (nope + m.v_dim) / lin_rate
            if m.attention == "mla" and not m.index_topk
            else 0.0
        )

        # ---- memory: seconds per byte-stream ----
        bw = gpu.hbm_bw * gpu.bw_efficiency
        embed_lookup = 0 if m.tie_word_embeddings else m.embedding_params  # only the looked-up rows are read
        self._m_dense = (m.dense_params - embed_lookup) / tp * wb / bw
        shards = par.expert_shards
        if m.is_moe:
            resident = m.num_experts / shards if par.ep else m.num_experts
            per_expert = m.expert_params * m.moe_layers * wb / (1 if par.ep else tp)
            self._m_exp = resident * per_expert / bw  # all resident experts, every MoE layer
            # Each token picks k distinct experts of E, so a given expert is missed by one token with prob 1 - k/E;
            # with EP the rank's experts serve the tokens of all dp ranks (assumed as busy as this one).
            self._log_miss = math.log1p(-m.experts_per_token / m.num_experts)
            self._group = par.dp if par.ep else 1
        else:
            self._m_exp, self._log_miss, self._group = 0.0, 0.0, 1
        if m.attention == "mla":
            latent_gpu = float(m.kv_latent_bytes_per_token)  # the latent is shared by all heads: TP replicates it
        else:
            latent_gpu = m.kv_latent_bytes_per_token * math.ceil(m.num_kv_heads / tp) / m.num_kv_heads
        index_gpu = float(m.kv_index_bytes_per_token)
        self.kv_bytes_per_token_gpu = latent_gpu + index_gpu
        self._m_lat, self._m_idx = latent_gpu / bw, index_gpu / bw
        self._m_kv = self.kv_bytes_per_token_gpu / bw

        # ---- communication ----
        comm_tok, comm_fixed = 0.0, 0.0
        if tp > 1:
            # Ring all-reduce after attention and after the MLP: 2 (tp-1)/tp of the activations per GPU each.
            tp_in_node = tp <= gpus_per_node
            link = (gpu.nvlink_bw if tp_in_node else gpu.ib_bw) * gpu.link_efficiency
            comm_tok += layers * 2 * (2 * (tp - 1) / tp) * m.hidden_size * _ACT_BYTES / link
            comm_fixed += layers * 2 * (gpu.nvlink_latency_s if tp_in_node else gpu.net_latency_s)
        self._ep_tok, self._ep_fixed = 0.0, 0.0
        if par.ep and shards > 1 and m.is_moe:
            # DeepEP-style all-to-all per MoE layer: each token goes to its k experts' GPUs (FP8 dispatch for FP8
            # models) and comes back combined in bf16. Experts are spread evenly over the shards; copies for other
            # nodes cross this GPU's NIC, the rest NVLink, both links busy at once. Low-latency kernels (decode) send
            # every remote copy over the NIC; high-throughput kernels (prefill) send one copy per destination node
            # and forward it over that node's NVLink, so with k experts over N nodes a token crosses the NIC
            # (N-1)(1-(1-1/N)^k) times instead of k(N-1)/N.
            k = m.experts_per_token
            local = min(shards, gpus_per_node)
            nodes = math.ceil(shards / local)
            if all2all == "high_throughput":
                ib_copies = (nodes - 1) * (1 - (1 - 1 / nodes) ** k)
                nvl_copies = k * (shards - 1) / shards
            else:
                ib_copies, nvl_copies = k * (shards - local) / shards, k * (local - 1) / shards
            dispatch = 1 if wb <= 1 else _ACT_BYTES
            bytes_copy = m.hidden_size * (dispatch + _ACT_BYTES) * m.moe_layers / tp
            self._ep_tok = bytes_copy * max(
                ib_copies / (gpu.ib_bw * gpu.link_efficiency), nvl_copies / (gpu.nvlink_bw * gpu.link_efficiency)
            )
            self._ep_fixed = m.moe_layers * 2 * (gpu.net_latency_s if nodes > 1 else gpu.nvlink_latency_s)
        self._comm_tok = comm_tok + self._ep_tok
        self._comm_fixed = comm_fixed + self._ep_fixed

        self._overhead = gpu.step_overhead(layers)
        # Drafting: k sequential passes of the MTP layer(s) over the decode batch (a one-layer drafter where the model
        # has no MTP module, as EAGLE): that fraction of a one-token-per-sequence pass through the whole model.
        self._draft_frac = mtp_draft_tokens * max(m.mtp_layers, 1) / layers if mtp_draft_tokens else 0.0

        # ---- capacity ----
        self.weight_bytes_per_gpu = self._weights_per_gpu()
        # vLLM's profile run reserves room for the peak activations of a max_num_batched_tokens step (taken as 32
        # bytes per token per hidden unit: residual, norms, QKV, MLP intermediate slices), plus ~1 GiB of CUDA
        # context, graphs and NCCL buffers, plus ~2 GiB of DeepEP dispatch/combine buffers with EP.
        self.activation_reserve_bytes = (
            GiB + max_num_batched_tokens * m.hidden_size * 32 + (2 * GiB if par.ep and m.is_moe else 0)
        )

    # ---- construction from a deployment spec ------------------------------------------------------------------

    @classmethod
    def from_spec(cls, spec: DeploymentSpec, role: Literal["prefill", "decode"]) -> LatencyModel:
        """The latency model of one DP rank of the spec's `role` pool: GPU from engine.gpu, model from model.path
        (registry name, config folder, or a coarse profile from active/total_params_b), the pool's parallelism,
        and MTP for the decode pool."""
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', not {role!r}")
        if role == "prefill" and not spec.disaggregated:
            raise ValueError(
                "the spec has no prefill pool (prefill.nodes is 0): decode engines prefill for themselves; "
                "use role='decode'"
            )
        pool = spec.prefill if role == "prefill" else spec.decode
        return cls(
            get_gpu(spec.engine.gpu),
            model_for_spec(spec.model),
            Parallelism(tp=pool.tp_size, dp=pool.dp_size, ep=pool.ep),
            mtp_draft_tokens=spec.mtp.draft_tokens if role == "decode" else 0,
            mtp_acceptance=spec.mtp.acceptance_rate,
            gpus_per_node=pool.gpus_per_node,
            max_num_batched_tokens=pool.max_num_batched_tokens,
            # llm-d's wide-EP recipes run DeepEP's high-throughput kernels on prefill and low-latency ones on decode.
            all2all="high_throughput" if role == "prefill" else "low_latency",
        )

    # ---- the hot path -----------------------------------------------------------------------------------------

    def _parts(self, prefill: Sequence[tuple[int, int]], decode: Sequence[int]) -> tuple[float, float, float, float]:
        # decode_line repeats the decode-only path's operations in this order: change both (tests/test_perf.py
        # holds them bit for bit equal).
        tokens = 0  # tokens through the model this step
        sampled = 0  # positions that need logits
        attn = 0.0  # attention compute, s
        ctx_tokens = 0  # context tokens whose KV is read in full
        latent_tokens = 0.0  # DSA decode: context tokens whose latent is read (the selected top-k)
        topk = self._topk
        for n, c in prefill:
            if n <= 0:
                continue
            tokens += n
            sampled += 1
            ctx_tokens += c
            if topk:
                # Each new token at position x (1-based) attends to min(x, topk) tokens; the indexer scores all x.
                a, b = c + 1, c + n
                if b <= topk:
                    sparse = (a + b) * n * 0.5
                elif a >= topk:
                    sparse = float(n * topk)
                else:
                    sparse = (a + topk) * (topk - a + 1) * 0.5 + (b - topk) * topk
                attn += sparse * self._a_pf + n * (c + (n + 1) * 0.5) * self._a_idx
            else:
                attn += n * (c + (n + 1) * 0.5) * self._a_pf
        compute_extra = ctx_tokens * self._c_ctx
        n_dec = len(decode)
        if n_dec:
            q = self._q
            ctx = sum(decode)
            half = (q + 1) * 0.5  # mean extra positions each verified token sees among the step's own tokens
            tokens += n_dec * q
            sampled += n_dec * q
            if topk:
                cap = topk - half  # min(c + half, topk) = min(c, cap) + half; agentic contexts mostly exceed cap
                if min(decode) >= cap:
                    attended = float(n_dec * topk)
                elif max(decode) <= cap:
                    attended = ctx + n_dec * half
                else:
                    attended = sum([c if c < cap else cap for c in decode]) + n_dec * half
                attn += q * attended * self._a_dc + q * (ctx + n_dec * half) * self._a_idx
                latent_tokens = attended - n_dec * half
                index_tokens = ctx
            else:
                attn += q * (ctx + n_dec * half) * self._a_dc
                ctx_tokens += ctx
                index_tokens = 0
        else:
            index_tokens = 0
        if tokens == 0:
            return 0.0, 0.0, 0.0, 0.0
        compute = tokens * self._c_tok + sampled * self._c_logit + attn + compute_extra
        # Weights: the dense part always, each resident expert if any of the group's tokens routes to it.
        weights = self._m_dense
        if self._m_exp:
            weights += self._m_exp * -math.expm1(tokens * self._group * self._log_miss)
        memory = weights + ctx_tokens * self._m_kv + latent_tokens * self._m_lat + index_tokens * self._m_idx
        memory += tokens * self._m_kv  # new KV written
        comm = tokens * self._comm_tok + self._comm_fixed
        if n_dec and self._draft_frac:
            w1 = self._m_dense
            if self._m_exp:
                w1 += self._m_exp * -math.expm1(n_dec * self._group * self._log_miss)
            draft = max(n_dec * self._c_tok, w1) + n_dec * self._ep_tok + self._ep_fixed
            compute += self._draft_frac * draft  # sequential passes: add to the step, whichever bound it is
            memory += self._draft_frac * draft
        return compute, memory, comm, self._overhead

    def step_time(self, prefill: Sequence[tuple[int, int]], decode: Sequence[int]) -> float:
        """Seconds for one engine step on one DP rank.

        `prefill`: the step's prefill chunks as (new_tokens, context_tokens_before_them) — context being cached
        prefix or earlier chunks. `decode`: each decoding sequence's context length. An empty step takes 0.
        """
        compute, memory, comm, overhead = self._parts(prefill, decode)
        if compute == 0.0 and memory == 0.0:
            return 0.0
        busy = compute if compute > memory else memory
        if self.comm_overlap:
            hidden = self.comm_overlap * comm
            comm -= hidden if hidden < busy else busy
        return busy + comm + overhead

    def decode_line(self, n: int, shortest: int) -> DecodeLine | None:
        """`step_time((), contexts)` for n decoding sequences whose shortest context is `shortest` or more, as a
        function of their total context alone (`line_times`), or None where it depends on more than the total: DSA's
        top-k straddled or not reached (a short context attends to all of it). The constants are step_time's own
        subexpressions for such a batch, so `line_times` computes each step's time with the same floating-point
        operations in the same order: bit for bit the same (tests/test_perf.py holds it).

        Why: decode fast-forward prices up to 64 steps of one batch at once; each exact step_time is ~2 us of Python
        where the line is a few instructions a step. A batch size's line is made once (the model's constants are
        fixed when it is built): a 544-GPU simulation asks for one per decode run, ~1% of its time."""
        if n < 1:
            return None
        topk = self._topk
        if topk and shortest < topk - (self._q + 1) * 0.5:
            return None  # some context attends to fewer than top-k: not a function of the total
        got = self._lines.get(n)
        if got is None:
            got = self._lines[n] = self._decode_line(n)
        return got

    def _decode_line(self, n: int) -> DecodeLine:
        q, topk, half = self._q, self._topk, (self._q + 1) * 0.5
        tokens = n * q  # _parts: tokens and sampled both n * q for a decode-only step
        if topk:
            attended = float(n * topk)
            p1 = q * attended * self._a_dc  # attention over the selected top-k; the indexer's term grows with the total
            a_x = self._a_idx
            m_y = self._m_idx  # the indexer's keys are read in full
            latent = attended - n * half
        else:
            p1, a_x, m_y, latent = 0.0, self._a_dc, self._m_kv, 0.0
        weights = self._m_dense
        if self._m_exp:
            weights += self._m_exp * -math.expm1(tokens * self._group * self._log_miss)
        # memory = weights + ctx_tokens * m_kv + latent * m_lat + index_tokens * m_idx: the term in the total is last.
        m1 = weights + 0 * self._m_kv + latent * self._m_lat if topk else weights
        draft = 0.0
        if self._draft_frac:
            w1 = self._m_dense
            if self._m_exp:
                w1 += self._m_exp * -math.expm1(n * self._group * self._log_miss)
            draft = self._draft_frac * (max(n * self._c_tok, w1) + n * self._ep_tok + self._ep_fixed)
        comm = tokens * self._comm_tok + self._comm_fixed
        return DecodeLine(
            p1=p1,
            q=float(q),
            n_half=n * half,
            a_x=a_x,
            t1=tokens * self._c_tok + tokens * self._c_logit,
            m1=m1,
            m_y=m_y,
            tk=tokens * self._m_kv,
            draft=draft,
            has_draft=bool(self._draft_frac),
            comm=comm,
            hidden=self.comm_overlap * comm,
            has_overlap=bool(self.comm_overlap),
            overhead=self._overhead,
        )

    def step_breakdown(self, prefill: Sequence[tuple[int, int]], decode: Sequence[int]) -> StepBreakdown:
        """`step_time`'s parts: compute, memory, communication (what `comm_overlap` leaves exposed) and overhead."""
        compute, memory, comm, overhead = self._parts(prefill, decode)
        if self.comm_overlap:
            comm -= min(self.comm_overlap * comm, max(compute, memory))
        return StepBreakdown(compute, memory, comm, overhead)

    # ---- convenience ------------------------------------------------------------------------------------------

    def prefill_time(self, new_tokens: int, cached_tokens: int = 0, chunk: int = 8192) -> float:
        """One request's whole prefill alone: `new_tokens` after `cached_tokens` of cached prefix, in chunked-prefill
        steps of at most `chunk` tokens (vLLM's max_num_batched_tokens)."""
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        total, done = 0.0, 0
        while done < new_tokens:
            n = min(chunk, new_tokens - done)
            total += self.step_time(((n, cached_tokens + done),), ())
            done += n
        return total

    def decode_step_time(self, batch_contexts: Sequence[int]) -> float:
        """One decode step (verifying 1 + k tokens per sequence with MTP) for sequences of these context lengths."""
        return self.step_time((), batch_contexts)

    def tokens_per_decode_step(self) -> float:
        """Expected tokens a sequence gains per decode step: 1 + k * acceptance rate (1 without MTP)."""
        return 1.0 + self.mtp_draft_tokens * self.mtp_acceptance

    def sample_accepted(self, rng: Uniforms) -> int:
        """Drafts accepted in one step for one sequence (0..k); the sequence gains this + 1 tokens.

        Drafts are verified in order and the first rejection ends the step, as in real speculative decoding. Each
        draft, given the earlier ones were accepted, is accepted with probability `draft_beta`, chosen so the mean is
        k * acceptance (k=3 at 0.65: beta ~0.80, mean 1.95). A plain Bernoulli(acceptance) per draft, stopping at the
        first rejection, would average only 1.35 and miss the reported 2.95 tokens/step.
        """
        accepted, beta = 0, self.draft_beta
        while accepted < self.mtp_draft_tokens and rng.random() < beta:
            accepted += 1
        return accepted

    def kv_transfer_time(self, num_tokens: int, same_node: bool) -> float:
        """Seconds to move `num_tokens` of KV between two ranks (NIXL P/D hand-off, P2P prefix pull): each GPU moves
        the KV it holds, over NVLink within a node or its own NIC across nodes."""
        if num_tokens <= 0:
            return 0.0
        gpu = self.gpu
        if same_node:
            return num_tokens * self.kv_bytes_per_token_gpu / (gpu.nvlink_bw * gpu.link_efficiency) + (
                gpu.nvlink_latency_s
            )
        return num_tokens * self.kv_bytes_per_token_gpu / (gpu.ib_bw * gpu.link_efficiency) + gpu.net_latency_s

    def kv_transfer_bytes(self, num_tokens: int) -> float:
        """Bytes a transfer of `num_tokens` moves in all: each of the rank's TP GPUs moves the KV it holds (the per-GPU
        bytes kv_transfer_time prices, times TP; a KV head or MLA latent replicated over GPUs moves once per copy)."""
        return max(num_tokens, 0) * self.kv_bytes_per_token_gpu * self.par.tp

    def cpu_restore_time(self, num_tokens: int) -> float:
        """Seconds to copy `num_tokens` of KV from the CPU DRAM tier back into HBM over the host link."""
        return max(num_tokens, 0) * self.kv_bytes_per_token_gpu / self.gpu.pcie_bw

    def cpu_offload_time(self, num_tokens: int) -> float:
        """Seconds to copy `num_tokens` of KV from HBM out to the CPU DRAM tier (PCIe is symmetric)."""
        return max(num_tokens, 0) * self.kv_bytes_per_token_gpu / self.gpu.pcie_bw

    def max_kv_tokens(self, gpu_memory_fraction: float = 0.9) -> int:
        """KV tokens one DP rank can hold: (HBM * fraction - weights per GPU - activation reserve) / KV bytes per
        token per GPU, floored at 0 (0 means the weights alone do not fit)."""
        if not 0 < gpu_memory_fraction <= 1:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {gpu_memory_fraction}")
        budget = self.gpu.hbm_bytes * gpu_memory_fraction - self.weight_bytes_per_gpu - self.activation_reserve_bytes
        return max(0, int(budget // self.kv_bytes_per_token_gpu))

    def _weights_per_gpu(self) -> float:
        m, par = self.model, self.par
        wb, tp = m.weight_bytes_per_param, par.tp
        expert_div = par.expert_shards if par.ep else tp
        total = m.dense_params / tp * wb + m.routed_expert_params / expert_div * wb
        if self.mtp_draft_tokens and m.mtp_params:
            mtp_experts = m.mtp_routed_expert_params
            total += (m.mtp_params - mtp_experts) / tp * wb + mtp_experts / expert_div * wb
        return total

    def __repr__(self) -> str:
        p = self.par
        return (
            f"LatencyModel({self.gpu.name}, {self.model.name}, tp={p.tp} dp={p.dp} ep={p.ep}, "
            f"mtp={self.mtp_draft_tokens}@{self.mtp_acceptance})"
        )
