"""The latency model: profiles against published numbers, and step times against the physics they claim to follow."""

from __future__ import annotations

import dataclasses
import itertools
import random
from pathlib import Path

import pytest

from llmd.perf import (
    GPUS,
    MODELS,
    LatencyModel,
    ModelProfile,
    Parallelism,
    get_gpu,
    get_model,
)
from llmd.perf.latency import line_times
from llmd.spec import DeploymentSpec, ModelSpec, PoolSpec, load_spec

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
H100 = get_gpu("H100-80GB")
LLAMA8 = MODELS["llama-3.1-8b"]
GLM = MODELS["glm-5.2"]
# 8B on one H100: achievable compute rate for its bf16 GEMMs, as the brief's back-of-envelope uses it.
H100_RATE = 989e12 * 0.55


@pytest.fixture(scope="module")
def glm_spec() -> DeploymentSpec:
    return load_spec(EXAMPLES / "glm52-544gpu.yaml")


# ---- profiles ------------------------------------------------------------------------------------------------------


def test_h100_profile_is_the_datasheet() -> None:
    assert H100.bf16_flops == pytest.approx(989e12)
    assert H100.fp8_flops == pytest.approx(2 * H100.bf16_flops, rel=0.01)
    assert H100.hbm_bw == pytest.approx(3.35e12)
    assert 80e9 <= H100.hbm_bytes <= 86e9
    assert H100.nvlink_bw == pytest.approx(450e9)
    assert H100.ib_bw == pytest.approx(400e9 / 8)  # NDR 400 Gb/s
    assert GPUS["H200"].hbm_bw > H100.hbm_bw and GPUS["H200"].hbm_bytes > 1.7 * H100.hbm_bytes
    assert GPUS["A100-80GB"].fp8_flops == GPUS["A100-80GB"].bf16_flops  # no FP8 tensor cores
    assert GPUS["B200"].bf16_flops > 2 * H100.bf16_flops
    assert 1.5e-3 <= H100.step_overhead(GLM.num_layers) <= 2.5e-3  # ~2 ms for big models
    assert get_gpu("h100-80gb") is H100


def test_unknown_names_list_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"H100-80GB.*H200.*A100-80GB.*B200.*cpu"):
        get_gpu("TPU-v5")
    with pytest.raises(ValueError, match=r"tiny.*llama-3\.1-8b.*glm-5\.2"):
        get_model("no-such-model")
    with pytest.raises(ValueError, match=r"'gpt_bigcode'.*llama"):
        ModelProfile.from_hf_config({"model_type": "gpt_bigcode", "hidden_size": 8})
    spec = DeploymentSpec(model=ModelSpec(path=str(tmp_path / "nothing-here")))
    with pytest.raises(ValueError, match="known models"):
        LatencyModel.from_spec(spec, "decode")


def test_tiny_profile_matches_the_tiny_model_folder(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    from llmd.models.tiny import make_tiny

    folder = make_tiny(tmp_path / "tiny", weights=True)
    profile = ModelProfile.from_hf_config(folder / "config.json")
    assert profile == MODELS["tiny"]
    assert get_model(folder) == MODELS["tiny"]  # a folder path resolves through its config.json
    # The parameter count derived from config.json is the number of weights actually written.
    tensors = load_file(str(folder / "model.safetensors"))
    assert profile.total_params == profile.active_params == sum(t.size for t in tensors.values())
    assert profile.kv_bytes_per_token == 2 * 4 * 32 * 2 * 2  # K and V, 4 heads of 32, 2 layers, bf16


def test_published_parameter_counts() -> None:
    assert MODELS["llama-3.1-8b"].total_params == pytest.approx(8.03e9, rel=0.005)
    assert MODELS["llama-3.1-70b"].total_params == pytest.approx(70.6e9, rel=0.005)
    ds = MODELS["deepseek-v3"]
    assert ds.total_params - ds.mtp_params == pytest.approx(671e9, rel=0.005)  # "671B main model"
    assert ds.active_params == pytest.approx(37e9, rel=0.05)
    # The deployment: ~753B total (with its MTP layer), ~39B active (GLM-5 counts ~40B).
    assert GLM.total_params == pytest.approx(753e9, rel=0.01)
    assert 38e9 <= GLM.compute_params_per_token <= 42e9
    assert GLM.weight_bytes_per_param == 1  # FP8 checkpoint
    # Other families read from config.json: Qwen3-30B-A3B (30.5B / 3.3B) and Qwen2.5-7B (7.61B).
    qwen3_moe = ModelProfile.from_hf_config(
        {
            "model_type": "qwen3_moe",
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
        }
    )
    assert qwen3_moe.total_params == pytest.approx(30.5e9, rel=0.01)
    assert qwen3_moe.active_params == pytest.approx(3.3e9, rel=0.03)
    qwen2 = ModelProfile.from_hf_config(
        {
            "model_type": "qwen2",
            "vocab_size": 152064,
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
        }
    )
    assert qwen2.total_params == pytest.approx(7.61e9, rel=0.005)


def test_glm_kv_is_mla_sized() -> None:
    # fp8 latent (kv_lora_rank + rope dim) plus the DSA indexer's fp8 key, per layer.
    assert GLM.attention == "mla"
    assert GLM.kv_bytes_per_token == ((512 + 64) + 128) * 78 * 1
    # The same heads as plain bf16 MHA would cache 2 * 64 heads * 256 * 78 * 2 bytes: ~90x more.
    assert GLM.kv_bytes_per_token * 80 < 2 * 64 * 256 * 78 * 2
    assert MODELS["deepseek-v3"].kv_bytes_per_token == (512 + 64) * 61 * 2
    assert LLAMA8.kv_bytes_per_token == 2 * 8 * 128 * 32 * 2


# ---- decode ---------------------------------------------------------------------------------------------------------


def test_decode_is_memory_bound_at_batch_1() -> None:
    lm = LatencyModel(H100, LLAMA8)
    parts = lm.step_breakdown((), [512])
    assert parts.bound == "memory"
    weights_over_bandwidth = LLAMA8.weight_bytes / H100.hbm_bw  # ~4.8 ms
    assert weights_over_bandwidth / 2 <= lm.decode_step_time([512]) <= 2 * weights_over_bandwidth


def test_decode_becomes_compute_bound_at_large_batch() -> None:
    lm = LatencyModel(H100, LLAMA8)
    assert lm.step_breakdown((), [64] * 1024).bound == "compute"
    # Batching amortises the weight reads: 1024 sequences per step cost far less than 1024 single steps.
    batch_rate = 1024 / lm.decode_step_time([64] * 1024)
    assert batch_rate > 20 / lm.decode_step_time([64])
    # Long contexts make decode memory-bound again through the KV reads.
    assert lm.step_breakdown((), [32768] * 64).bound == "memory"


def test_decode_time_grows_with_context() -> None:
    lm = LatencyModel(H100, LLAMA8)
    short, long = lm.decode_step_time([1000] * 32), lm.decode_step_time([30000] * 32)
    extra_kv = 32 * 29000 * LLAMA8.kv_bytes_per_token / (H100.hbm_bw * H100.bw_efficiency)
    assert long - short == pytest.approx(extra_kv, rel=0.05)


def test_mtp_tokens_per_step_matches_the_reference() -> None:
    assert LatencyModel(H100, GLM, mtp_draft_tokens=3, mtp_acceptance=0.65).tokens_per_decode_step() == pytest.approx(
        2.95
    )
    assert 2.9 <= LatencyModel(H100, GLM, mtp_draft_tokens=3).tokens_per_decode_step() <= 3.1  # default 0.68
    assert LatencyModel(H100, GLM).tokens_per_decode_step() == 1.0


def test_sample_accepted_averages_to_the_expectation() -> None:
    lm = LatencyModel(H100, GLM, mtp_draft_tokens=3, mtp_acceptance=0.65)
    rng = random.Random(1234)
    draws = [lm.sample_accepted(rng) for _ in range(40000)]
    assert set(draws) <= {0, 1, 2, 3}
    assert 1 + sum(draws) / len(draws) == pytest.approx(lm.tokens_per_decode_step(), abs=0.03)
    assert [lm.sample_accepted(random.Random(7)) for _ in range(5)] == [
        lm.sample_accepted(random.Random(7)) for _ in range(5)
    ]
    assert LatencyModel(H100, GLM).sample_accepted(rng) == 0  # no MTP: no drafts
    full = LatencyModel(H100, GLM, mtp_draft_tokens=2, mtp_acceptance=1.0)
    assert {full.sample_accepted(rng) for _ in range(100)} == {2}


def test_mtp_multiplies_compute_not_weight_reads() -> None:
    plain = LatencyModel(H100, LLAMA8)
    mtp = LatencyModel(H100, LLAMA8, mtp_draft_tokens=3)
    # Memory-bound batch 1: verifying 4 tokens costs about the same step as 1, so tokens per second nearly triple.
    assert mtp.decode_step_time([512]) < 1.15 * plain.decode_step_time([512])
    # Compute-bound batch: 4x the tokens through the linear layers.
    ratio = mtp.step_breakdown((), [64] * 1024).compute_s / plain.step_breakdown((), [64] * 1024).compute_s
    assert 3.9 <= ratio <= 4.5


# ---- prefill --------------------------------------------------------------------------------------------------------


def test_prefill_of_8k_tokens_on_h100_is_plausible() -> None:
    lm = LatencyModel(H100, LLAMA8)
    t = lm.prefill_time(8192)
    linear = 2 * 8e9 * 8192 / H100_RATE  # ~0.24 s before attention
    assert linear * 0.9 <= t <= 0.6
    assert lm.step_breakdown([(8192, 0)], ()).bound == "compute"


def test_prefill_grows_about_linearly_with_new_tokens() -> None:
    lm = LatencyModel(H100, LLAMA8)
    t4k, t8k, t16k = lm.prefill_time(4096), lm.prefill_time(8192), lm.prefill_time(16384)
    # Linear layers dominate at these lengths; causal attention adds a little superlinearity.
    assert 1.9 <= t8k / t4k <= 2.3
    assert 1.9 <= t16k / t8k <= 2.4


def test_cached_prefix_costs_attention_only() -> None:
    lm = LatencyModel(H100, LLAMA8)
    n = 4096
    times = [lm.prefill_time(n, cached_tokens=c) for c in (0, 8192, 16384, 24576)]
    steps = [b - a for a, b in itertools.pairwise(times)]
    # Each extra cached token adds the same cost (no linear-layer work on cached tokens) ...
    assert max(steps) == pytest.approx(min(steps), rel=0.02)
    # ... and that cost is attention's: QK^T and PV of the n new queries against it (4 * L * H * d FLOPs per pair),
    # plus reading its KV, which is negligible here.
    attention_per_cached = 4 * LLAMA8.num_layers * LLAMA8.num_q_heads * LLAMA8.head_dim * n / H100_RATE
    assert steps[0] / 8192 == pytest.approx(attention_per_cached, rel=0.05)
    # A cached prefix is much cheaper than computing it.
    assert lm.prefill_time(n, cached_tokens=24576) < 0.5 * lm.prefill_time(n + 24576)


def test_prefill_is_chunked() -> None:
    lm = LatencyModel(H100, LLAMA8)
    whole = lm.prefill_time(20000, chunk=8192)
    by_hand = sum(lm.step_time([(n, c)], []) for n, c in ((8192, 0), (8192, 8192), (3616, 16384)))
    assert whole == pytest.approx(by_hand)
    assert lm.prefill_time(0) == 0.0
    # Smaller chunks re-read the weights and pay the overhead more often.
    assert lm.prefill_time(20000, chunk=512) > whole


# ---- parallelism and communication ----------------------------------------------------------------------------------


def test_tensor_parallel_splits_work_and_kv() -> None:
    m70 = MODELS["llama-3.1-70b"]
    assert LatencyModel(H100, m70).max_kv_tokens() == 0  # 141 GB of bf16 weights do not fit one H100
    tp4, tp8 = LatencyModel(H100, m70, Parallelism(tp=4)), LatencyModel(H100, m70, Parallelism(tp=8))
    assert tp8.kv_bytes_per_token_gpu == tp4.kv_bytes_per_token_gpu / 2 == m70.kv_bytes_per_token / 8
    assert tp8.decode_step_time([2000] * 16) < tp4.decode_step_time([2000] * 16)
    assert tp4.step_breakdown((), [2000] * 16).comm_s > 0
    # TP across nodes moves the all-reduces onto the NIC.
    tp16 = LatencyModel(H100, m70, Parallelism(tp=16))
    assert tp16.step_breakdown([(8192, 0)], ()).comm_s > 5 * tp8.step_breakdown([(8192, 0)], ()).comm_s


def test_ep_all_to_all_costs_more_across_nodes() -> None:
    par = Parallelism(tp=1, dp=16, ep=True)
    in_node = LatencyModel(H100, GLM, par, gpus_per_node=16)
    across = LatencyModel(H100, GLM, par, gpus_per_node=8)
    decode = [20000] * 32
    assert across.step_breakdown((), decode).comm_s > 2 * in_node.step_breakdown((), decode).comm_s
    assert across.decode_step_time(decode) > in_node.decode_step_time(decode)
    # Sending one copy per destination node (DeepEP high-throughput) beats one per expert on the NIC.
    dedup = LatencyModel(H100, GLM, par, all2all="high_throughput")
    assert dedup.step_breakdown([(8192, 0)], ()).comm_s < across.step_breakdown([(8192, 0)], ()).comm_s
    # Overlap hides communication behind compute, never below the busy time.
    overlap = LatencyModel(H100, GLM, par, comm_overlap=1.0)
    parts = across.step_breakdown([(8192, 0)], ())
    busy = max(parts.compute_s, parts.memory_s)
    assert overlap.step_time([(8192, 0)], ()) == pytest.approx(max(busy, parts.comm_s) + parts.overhead_s)
    assert overlap.step_time([(8192, 0)], ()) < across.step_time([(8192, 0)], ())


def test_ep_reads_only_the_experts_the_batch_touches() -> None:
    lm = LatencyModel(H100, GLM, Parallelism(dp=16, ep=True))
    one, many = lm.step_breakdown((), [1000]), lm.step_breakdown((), [1000] * 256)
    assert one.memory_s < many.memory_s
    all_weights = lm.weight_bytes_per_gpu / (H100.hbm_bw * H100.bw_efficiency)
    assert many.memory_s >= 0.95 * all_weights  # a big batch touches every resident expert
    assert one.memory_s < 0.75 * all_weights


def test_kv_transfers() -> None:
    lm = LatencyModel(H100, GLM, Parallelism(dp=16, ep=True))
    tokens = 195_000
    size = tokens * GLM.kv_bytes_per_token
    over_ib = lm.kv_transfer_time(tokens, same_node=False)
    assert size / H100.ib_bw < over_ib < 2 * size / H100.ib_bw
    assert lm.kv_transfer_time(tokens, same_node=True) < over_ib / 5
    assert lm.kv_transfer_time(2 * tokens, same_node=False) == pytest.approx(2 * over_ib, rel=0.01)
    assert lm.cpu_restore_time(tokens) == pytest.approx(size / H100.pcie_bw)
    assert lm.cpu_offload_time(tokens) == pytest.approx(lm.cpu_restore_time(tokens))
    assert lm.kv_transfer_time(0, same_node=False) == 0.0
    assert lm.kv_transfer_bytes(tokens) == size and lm.kv_transfer_bytes(0) == 0
    # TP: each GPU moves the heads it holds (all of them once), or its own copy of an MLA latent.
    m70 = MODELS["llama-3.1-70b"]
    assert LatencyModel(H100, m70, Parallelism(tp=4)).kv_transfer_bytes(10) == 10 * m70.kv_bytes_per_token
    assert LatencyModel(H100, GLM, Parallelism(tp=4)).kv_transfer_bytes(10) == 4 * 10 * GLM.kv_bytes_per_token


# ---- capacity and the deployment spec -------------------------------------------------------------------------------


def test_llama8b_kv_capacity_on_h100() -> None:
    # (0.9 * 80 GB - 16 GB weights - reserve) / 128 KiB per token: vLLM reports ~450K tokens.
    assert 400_000 <= LatencyModel(H100, LLAMA8).max_kv_tokens() <= 500_000
    assert LatencyModel(H100, LLAMA8).max_kv_tokens(0.5) < LatencyModel(H100, LLAMA8).max_kv_tokens(0.9)


def test_glm_decode_rank_holds_a_195k_context(glm_spec: DeploymentSpec) -> None:
    decode = LatencyModel.from_spec(glm_spec, "decode")
    assert decode.par == Parallelism(tp=1, dp=128, ep=True)
    # Weights per GPU: the ~19B replicated dense part plus 1/128 of the experts, in fp8.
    assert 20e9 <= decode.weight_bytes_per_gpu <= 30e9
    capacity = decode.max_kv_tokens(glm_spec.kv.gpu_memory_fraction)
    assert capacity >= 195_000
    assert 195_000 * GLM.kv_bytes_per_token < H100.hbm_bytes * 0.9 - decode.weight_bytes_per_gpu


def test_from_spec_on_the_examples(glm_spec: DeploymentSpec) -> None:
    prefill = LatencyModel.from_spec(glm_spec, "prefill")
    decode = LatencyModel.from_spec(glm_spec, "decode")
    assert prefill.model is GLM and prefill.gpu is H100
    assert prefill.mtp_draft_tokens == 0 and decode.mtp_draft_tokens == 3
    assert decode.mtp_acceptance == glm_spec.mtp.acceptance_rate
    assert prefill.par == Parallelism(tp=1, dp=16, ep=True)
    assert prefill.all2all == "high_throughput" and decode.all2all == "low_latency"
    # A decode step for a rank's few long agentic contexts, and a cached agentic turn's prefill, take plausible times.
    assert 0.005 < decode.decode_step_time([195_000] * 4) < 0.2
    assert 0.05 < prefill.prefill_time(1500, cached_tokens=195_000, chunk=16384) < 2.0

    default = DeploymentSpec()
    tiny = LatencyModel.from_spec(default, "decode")
    assert tiny.model == MODELS["tiny"] and tiny.gpu is H100
    assert 0 < tiny.decode_step_time([100]) < 0.01
    assert LatencyModel.from_spec(default, "prefill").prefill_time(1000) > 0
    with pytest.raises(ValueError, match="no prefill pool"):
        LatencyModel.from_spec(DeploymentSpec(prefill=PoolSpec(nodes=0)), "prefill")
    with pytest.raises(ValueError, match="role"):
        LatencyModel.from_spec(default, "router")  # type: ignore[arg-type]


def test_from_spec_coarse_profile_from_parameter_counts() -> None:
    spec = DeploymentSpec(model=ModelSpec(path="acme/moe-400b", total_params_b=400, active_params_b=20))
    lm = LatencyModel.from_spec(spec, "decode")
    assert lm.model.total_params == pytest.approx(400e9, rel=0.01)
    assert lm.model.active_params == pytest.approx(20e9, rel=0.01)
    assert lm.model.is_moe
    # Bigger active counts cost more per token.
    dense = LatencyModel.from_spec(
        DeploymentSpec(model=ModelSpec(path="acme/dense-40b", total_params_b=40, active_params_b=40)), "decode"
    )
    assert dense.model.num_experts == 0
    assert dense.prefill_time(4096) > lm.prefill_time(4096)


def test_cpu_profile_gives_short_tiny_model_steps() -> None:
    lm = LatencyModel(get_gpu("cpu"), MODELS["tiny"])
    assert 0.3e-3 < lm.decode_step_time([100]) < 2e-3
    assert 2e-3 < lm.prefill_time(1000) < 0.1


# ---- purity ---------------------------------------------------------------------------------------------------------


def test_step_time_is_deterministic_and_pure() -> None:
    lm = LatencyModel.from_spec(load_spec(EXAMPLES / "glm52-544gpu.yaml"), "decode")
    prefill = [(512, 1000), (2048, 150_000)]
    decode = [1000, 195_000, 3000, 60_000]
    first = lm.step_time(prefill, decode)
    assert all(lm.step_time(prefill, decode) == first for _ in range(100))
    assert prefill == [(512, 1000), (2048, 150_000)] and decode == [1000, 195_000, 3000, 60_000]
    assert lm.step_time(tuple(prefill), tuple(reversed(decode))) == pytest.approx(first, rel=1e-12)
    twin = LatencyModel.from_spec(load_spec(EXAMPLES / "glm52-544gpu.yaml"), "decode")
    assert twin.step_time(prefill, decode) == first
    assert lm.step_time([], []) == 0.0
    parts = lm.step_breakdown(prefill, decode)
    assert parts.total_s == pytest.approx(first)
    assert dataclasses.asdict(parts).keys() == {"compute_s", "memory_s", "comm_s", "overhead_s"}


@pytest.mark.parametrize("seed", range(3))
def test_decode_line_prices_a_decode_step_as_step_time_does_bit_for_bit(glm_spec: DeploymentSpec, seed: int) -> None:
    """Decode fast-forward prices a run's steps on the line (LatencyModel.decode_line, line_times) instead of calling
    step_time per step: for every model and layout, the same float, and no line where the total does not decide."""
    models = [LatencyModel.from_spec(glm_spec, "decode"), LatencyModel.from_spec(glm_spec, "prefill")]
    models += [LatencyModel(H100, m, Parallelism(tp=2, dp=8, ep=True), 2, comm_overlap=0.3) for m in MODELS.values()]
    models += [LatencyModel(H100, LLAMA8), LatencyModel(H100, LLAMA8, Parallelism(tp=2), 3, comm_overlap=0.5)]
    rng = random.Random(seed)
    priced = refused = 0
    for lm in models:
        for _ in range(300):
            n = rng.randint(1, 64)
            hi = rng.choice([100, 3_000, 300_000])
            rows = [rng.randint(1, hi) for _ in range(n)]
            line = lm.decode_line(n, min(rows))
            if line is None:
                # Only DSA's top-k makes the time depend on more than the total: a context short of it.
                assert lm.model.index_topk and min(rows) < lm.model.index_topk
                refused += 1
                continue
            priced += 1
            totals = [float(sum(rows)), float(sum(rows) + n * 7)]
            grown = [c + 7 for c in rows]
            assert line_times(line, totals) == [lm.step_time((), rows), lm.step_time((), grown)]
    assert priced > 1000 and refused > 50
    assert LatencyModel(H100, GLM).decode_line(0, 10**6) is None
