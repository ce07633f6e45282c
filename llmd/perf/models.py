"""Model profiles: the shapes the latency model needs (parameters, layers, attention and KV geometry, MoE layout).

Profiles are computed from Hugging Face `config.json` fields, so a registry entry and the same model's config folder
give identical profiles. Parameter counts come from the shapes of every weight matrix (norms and biases included);
"active" parameters are those one token passes through: all dense weights plus `experts_per_token` routed experts per
MoE layer. The registry's entries are data: llmd/perf/data/models.yaml, extended by the user's profile folders.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from llmd.perf.gpus import UnknownProfileError
from llmd.perf.profile_file import check_fields, entry_error, field_types, pop_base
from llmd.perf.profile_table import ProfileTable

if TYPE_CHECKING:
    from llmd.spec.model import ModelSpec

Attention = Literal["mha", "gqa", "mla"]

_GQA_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "glm4_moe")
_MLA_TYPES = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa", "kimi_k2")
SUPPORTED_MODEL_TYPES = _GQA_TYPES + _MLA_TYPES


@dataclass(frozen=True)
class ModelProfile:
    """A transformer as the roofline model sees it.

    Parameter counts are plain numbers of weights. `total_params = dense_params + num_experts * expert_params *
    moe_layers + mtp_params`: `dense_params` is everything of the main model that is not a routed expert (attention,
    dense and shared-expert MLPs, routers, norms, embeddings, LM head); `mtp_params` is the multi-token-prediction
    module (loaded only when MTP is on). `head_dim` is the query/key head size (for MLA: nope + rope part).
    """

    name: str
    total_params: int
    active_params: int
    num_layers: int
    hidden_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    attention: Attention
    v_head_dim: int = 0  # 0: same as head_dim
    kv_lora_rank: int = 0  # MLA: rank of the compressed KV latent that is cached
    qk_rope_head_dim: int = 0  # MLA: decoupled RoPE key part, cached next to the latent
    weight_bytes_per_param: float = 2.0  # bf16 = 2, fp8 = 1
    kv_bytes_per_element: float = 2.0  # KV cache dtype: bf16 = 2, fp8 = 1
    vocab_size: int = 0  # 0: unknown (coarse profiles); then embeddings are folded into dense_params
    tie_word_embeddings: bool = False
    num_experts: int = 0  # routed experts per MoE layer; 0: dense model
    experts_per_token: int = 0
    moe_layers: int = 0
    expert_params: int = 0  # one routed expert in one layer
    dense_params: int = 0
    mtp_params: int = 0
    mtp_layers: int = 0
    # DeepSeek Sparse Attention (DSA): a lightning indexer scores every cached token with a small fp8 key and each query
    # attends only to its top `index_topk`. 0: dense attention.
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.attention not in ("mha", "gqa", "mla"):
            raise ValueError(f"model profile {self.name!r}: attention must be mha, gqa or mla, not {self.attention!r}")
        for field_name in ("total_params", "active_params", "num_layers", "hidden_size", "num_q_heads", "head_dim"):
            if getattr(self, field_name) <= 0:
                raise ValueError(f"model profile {self.name!r}: {field_name} must be positive")
        if self.active_params > self.total_params:
            raise ValueError(f"model profile {self.name!r}: active_params exceeds total_params")
        if self.attention == "mla" and self.kv_lora_rank <= 0:
            raise ValueError(f"model profile {self.name!r}: MLA needs kv_lora_rank")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"model profile {self.name!r}: experts_per_token must be in 1..num_experts")

    # ---- derived ------------------------------------------------------------------------------------------------

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and self.moe_layers > 0

    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def routed_expert_params(self) -> int:
        """All routed experts of the main model (the part expert parallelism shards)."""
        return self.num_experts * self.expert_params * self.moe_layers

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def compute_params_per_token(self) -> int:
        """Weights one token multiplies through, excluding the input embedding (a lookup) and the LM head (only the
        positions that are sampled need logits)."""
        head_and_embed = self.embedding_params * (1 if self.tie_word_embeddings else 2)
        return max(self.active_params - head_and_embed, 1)

    @property
    def kv_latent_bytes_per_token(self) -> int:
        """Attention KV the cache keeps per token, all layers: K and V of every KV head (MHA/GQA) or, for MLA, the
        compressed latent plus the RoPE key, shared by all heads."""
        if self.attention == "mla":
            per_layer = self.kv_lora_rank + self.qk_rope_head_dim
        else:
            per_layer = self.num_kv_heads * (self.head_dim + self.v_dim)
        return round(per_layer * self.num_layers * self.kv_bytes_per_element)

    @property
    def kv_index_bytes_per_token(self) -> int:
        """DSA indexer keys cached per token, all layers (one `index_head_dim` key per layer; 0 without DSA)."""
        return round(self.index_head_dim * self.num_layers * self.kv_bytes_per_element) if self.index_topk else 0

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token, all layers and heads: GQA/MHA 2*kv_heads*head_dim*layers*dtype; MLA
        (kv_lora_rank + rope_dim)*layers*dtype, plus the DSA indexer's keys where the model has them."""
        return self.kv_latent_bytes_per_token + self.kv_index_bytes_per_token

    @property
    def weight_bytes(self) -> float:
        """All weights of the checkpoint, MTP module included."""
        return self.total_params * self.weight_bytes_per_param

    @property
    def mtp_routed_expert_params(self) -> int:
        return self.num_experts * self.expert_params * self.mtp_layers if self.is_moe else 0

    # ---- constructors -------------------------------------------------------------------------------------------

    @classmethod
    def from_hf_config(
        cls,
        source: str | os.PathLike[str] | Mapping[str, Any],
        *,
        name: str | None = None,
        kv_bytes_per_element: float | None = None,
    ) -> ModelProfile:
        """Profile from a Hugging Face config: a dict, a config.json path, or a model folder holding config.json.

        `kv_bytes_per_element` overrides the KV dtype (default: the model's dtype, as vLLM's `--kv-cache-dtype auto`).
        """
        if isinstance(source, Mapping):
            cfg = dict(source)
            default_name = str(cfg.get("_name_or_path") or cfg.get("model_type") or "model")
        else:
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            try:
                cfg = json.loads(path.read_text())
            except FileNotFoundError:
                raise FileNotFoundError(f"no config.json at {path}") from None
            default_name = path.parent.name or "model"
        profile = _profile_from_config(cfg, name or default_name)
        if kv_bytes_per_element is not None:
            profile = replace(profile, kv_bytes_per_element=kv_bytes_per_element)
        return profile

    @classmethod
    def coarse(cls, name: str, total_params: float, active_params: float, *, weight_bytes_per_param: float = 2.0):
        """A rough profile from parameter counts alone (a spec's total_params_b/active_params_b for an unknown model).

        Assumes a Llama-shaped stack: hidden = 128 * layers (8B: 4096/32, 70B: 8192/80, 405B: 16384/126 all sit near
        that aspect ratio) and 12*hidden^2 weights per layer, GQA with 8 KV heads of 128. If total exceeds active
        the model is taken to be a fine-grained MoE with top-8 routing whose dense part is 40% of the active
        parameters (DeepSeek-V3: ~15B of 37B; GLM-5: ~17B of 40B).
        """
        total, active = round(total_params), round(active_params)
        is_moe = total > active * 1.05
        dense_active = active * 0.4 if is_moe else active
        hidden = max(128, round((active * 128 / 12) ** (1 / 3) / 128) * 128)
        layers = max(1, round(hidden / 128))
        heads = max(1, hidden // 128)
        fields: dict[str, Any] = {}
        if is_moe:
            k = 8
            routed_active = active - round(dense_active)
            num_experts = max(k, round(k * (total - dense_active) / routed_active))
            expert_params = max(1, round(routed_active / (k * layers)))
            dense = total - num_experts * expert_params * layers
            fields = dict(num_experts=num_experts, experts_per_token=k, moe_layers=layers, expert_params=expert_params)
        else:
            dense = total
        return cls(
            name=name,
            total_params=total,
            active_params=active,
            num_layers=layers,
            hidden_size=hidden,
            num_q_heads=heads,
            num_kv_heads=min(8, heads),
            head_dim=128,
            attention="gqa" if heads > 8 else "mha",
            weight_bytes_per_param=weight_bytes_per_param,
            dense_params=dense,
            **fields,
        )


# ---- parameter counting from config.json ---------------------------------------------------------------------------


def _get(cfg: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def _weight_bytes(cfg: Mapping[str, Any]) -> float:
    quant = cfg.get("quantization_config") or {}
    method = str(quant.get("quant_method", "")).lower()
    if method == "fp8" or "fp8" in str(quant.get("fmt", "")).lower():
        return 1.0
    if method in ("awq", "gptq") and quant.get("bits"):
        return int(quant["bits"]) / 8
    dtype = str(_get(cfg, "torch_dtype", "dtype", default="bfloat16")).lower().removeprefix("torch.")
    return 4.0 if dtype in ("float32", "fp32") else 2.0


def _profile_from_config(cfg: Mapping[str, Any], name: str) -> ModelProfile:
    model_type = str(cfg.get("model_type", ""))
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"config.json model_type {model_type!r} is not one the latency model can read; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    h = int(cfg["hidden_size"])
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    vocab = int(cfg["vocab_size"])
    tied = bool(cfg.get("tie_word_embeddings", False))
    embed = vocab * h * (1 if tied else 2)
    final_norm = h
    layer_norms = 2 * h
    if model_type in _MLA_TYPES:
        return _mla_profile(cfg, name, h, layers, heads, vocab, tied, embed + final_norm, layer_norms)

    # GQA / MHA: q, k, v, o projections (+ qkv bias for Qwen2 and GLM-4.5, + per-head q/k RMSNorm for Qwen3).
    kv_heads = int(_get(cfg, "num_key_value_heads", default=heads))
    head_dim = int(_get(cfg, "head_dim", default=h // heads))
    attn = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim
    if model_type == "qwen2" or model_type == "qwen2_moe" or cfg.get("attention_bias"):
        attn += heads * head_dim + 2 * kv_heads * head_dim
    if model_type in ("qwen3", "qwen3_moe") or cfg.get("use_qk_norm"):
        attn += 2 * head_dim
    inter = int(_get(cfg, "intermediate_size", default=4 * h))
    dense_mlp = 3 * h * inter  # SwiGLU: gate, up, down

    # MoE layout per family: routed experts, their size, shared experts, and which layers are MoE.
    num_experts, k, moe_inter, shared, moe_layer = 0, 0, 0, 0, [False] * layers
    if model_type == "qwen3_moe" or model_type == "qwen2_moe":
        num_experts, k = int(cfg["num_experts"]), int(cfg["num_experts_per_tok"])
        moe_inter = int(cfg["moe_intermediate_size"])
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        only_dense = set(cfg.get("mlp_only_layers") or [])
        moe_layer = [i not in only_dense and (i + 1) % step == 0 for i in range(layers)]
        if model_type == "qwen2_moe":
            shared = 3 * h * int(cfg.get("shared_expert_intermediate_size", 0)) + h  # + the shared expert's gate
    elif model_type == "mixtral":
        num_experts, k, moe_inter = int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"]), inter
        moe_layer = [True] * layers
    elif model_type == "glm4_moe":
        num_experts, k = int(cfg["n_routed_experts"]), int(cfg["num_experts_per_tok"])
        moe_inter = int(cfg["moe_intermediate_size"])
        shared = 3 * h * moe_inter * int(cfg.get("n_shared_experts", 0) or 0)
        first_dense = int(cfg.get("first_k_dense_replace", 0) or 0)
        moe_layer = [i >= first_dense for i in range(layers)]
        shared += num_experts  # e_score_correction_bias
    moe_layers = sum(moe_layer)
    expert = 3 * h * moe_inter
    router = h * num_experts
    per_dense_layer = attn + layer_norms + dense_mlp
    per_moe_layer_dense = attn + layer_norms + shared + router
    dense_params = embed + final_norm + per_dense_layer * (layers - moe_layers) + per_moe_layer_dense * moe_layers
    total = dense_params + num_experts * expert * moe_layers
    active = dense_params + k * expert * moe_layers
    return ModelProfile(
        name=name,
        total_params=total,
        active_params=active,
        num_layers=layers,
        hidden_size=h,
        num_q_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        attention="mha" if kv_heads == heads else "gqa",
        weight_bytes_per_param=_weight_bytes(cfg),
        kv_bytes_per_element=2.0,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        num_experts=num_experts if moe_layers else 0,
        experts_per_token=k if moe_layers else 0,
        moe_layers=moe_layers if num_experts else 0,
        expert_params=expert if num_experts and moe_layers else 0,
        dense_params=dense_params,
    )


def _mla_profile(
    cfg: Mapping[str, Any],
    name: str,
    h: int,
    layers: int,
    heads: int,
    vocab: int,
    tied: bool,
    embed_and_final_norm: int,
    layer_norms: int,
) -> ModelProfile:
    """DeepSeek-V3-style: multi-head latent attention, fine-grained routed + shared experts, first k layers dense,
    optional MTP layers (`num_nextn_predict_layers`) and DSA indexer (`index_topk`)."""
    q_lora = int(cfg.get("q_lora_rank") or 0)
    kv_lora = int(cfg["kv_lora_rank"])
    nope, rope, v_dim = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"])
    qk = nope + rope
    # q: down-projection + norm + up-projection (or one projection without q_lora); kv: down-projection to the latent
    # and the RoPE key + norm, up-projection of the latent to per-head K (nope part) and V; output projection.
    q_proj = (h * q_lora + q_lora + q_lora * heads * qk) if q_lora else h * heads * qk
    attn = q_proj + h * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v_dim) + heads * v_dim * h
    index_topk = int(cfg.get("index_topk") or 0) if str(cfg.get("model_type")) != "deepseek_v3" else 0
    index_heads = int(cfg.get("index_n_heads") or 0) if index_topk else 0
    index_dim = int(cfg.get("index_head_dim") or 0) if index_topk else 0
    if index_topk:
        # Lightning indexer: query up-projection from the q latent, one shared key, its LayerNorm, per-head weights.
        attn += q_lora * index_heads * index_dim + h * index_dim + 2 * index_dim + h * index_heads
    num_experts, k = int(cfg["n_routed_experts"]), int(cfg["num_experts_per_tok"])
    moe_inter, inter = int(cfg["moe_intermediate_size"]), int(cfg["intermediate_size"])
    n_shared = int(cfg.get("n_shared_experts") or 0)
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    freq = int(cfg.get("moe_layer_freq") or 1)
    moe_layers = sum(1 for i in range(layers) if i >= first_dense and i % freq == 0)
    expert = 3 * h * moe_inter
    moe_dense_part = attn + layer_norms + n_shared * expert + h * num_experts + num_experts  # + router and its bias
    dense_layer = attn + layer_norms + 3 * h * inter
    dense_params = embed_and_final_norm + dense_layer * (layers - moe_layers) + moe_dense_part * moe_layers
    active = dense_params + k * expert * moe_layers
    # An MTP module: one MoE decoder layer plus the projection of [embedding; hidden] back to hidden and three norms
    # (embedding and LM head are shared with the main model). Counted in total_params, as in the released
    # checkpoints (DeepSeek-V3: 685B = 671B main + 11.6B of MTP layer + copies of the embedding and head).
    mtp_layers = int(cfg.get("num_nextn_predict_layers") or 0)
    mtp = mtp_layers * (moe_dense_part + num_experts * expert + 2 * h * h + 3 * h)
    total = dense_params + num_experts * expert * moe_layers + mtp
    return ModelProfile(
        name=name,
        total_params=total,
        active_params=active,
        num_layers=layers,
        hidden_size=h,
        num_q_heads=heads,
        num_kv_heads=heads,
        head_dim=qk,
        attention="mla",
        v_head_dim=v_dim,
        kv_lora_rank=kv_lora,
        qk_rope_head_dim=rope,
        weight_bytes_per_param=_weight_bytes(cfg),
        kv_bytes_per_element=2.0,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        num_experts=num_experts,
        experts_per_token=k,
        moe_layers=moe_layers,
        expert_params=expert,
        dense_params=dense_params,
        mtp_params=mtp,
        mtp_layers=mtp_layers,
        index_topk=index_topk,
        index_n_heads=index_heads,
        index_head_dim=index_dim,
    )


# ---- registry ------------------------------------------------------------------------------------------------------

_TYPES = field_types(ModelProfile)
_REQUIRED = [f.name for f in fields(ModelProfile) if f.default is MISSING and f.name != "name"]
_CONFIG_EXAMPLE = "{model_type: llama, hidden_size: 4096, ...}"


def _read_entry(path: Path, name: str, raw: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    rest, base = pop_base(path, "model", name, raw)
    config = rest.pop("config", None)
    if config is not None and not (isinstance(config, dict) and all(isinstance(key, str) for key in config)):
        problem = f"expected a mapping of config.json fields, like `config: {_CONFIG_EXAMPLE}`"
        raise entry_error(path, "model", name, "config", problem)
    positive = ("weight_bytes_per_param", "kv_bytes_per_element")
    checked = check_fields(path, "model", name, rest, _TYPES, {}, positive=positive, also=("base", "config"))
    if config is not None:
        checked["config"] = config
    return checked, base


def _make(name: str, values: dict[str, Any]) -> ModelProfile:
    """The profile its `config` (config.json fields) gives, with the entry's own profile fields over it; or, without a
    config, the profile its fields spell out."""
    profile_fields = dict(values)
    config = profile_fields.pop("config", None)
    if config is None:
        missing = [field for field in _REQUIRED if field not in profile_fields]
        if missing:
            raise ValueError(
                f"a new model needs `config:` (its config.json fields, like {_CONFIG_EXAMPLE}), or the profile "
                f"fields {', '.join(missing)}, or `base: <a known model>` to start from one"
            )
        if "dense_params" not in profile_fields:
            # The latency model streams dense_params every step, so a hand-written profile must not leave it at 0:
            # it is what total_params holds besides the routed experts and the MTP module.
            experts = profile_fields.get("num_experts", 0) * profile_fields.get("expert_params", 0)
            routed = experts * profile_fields.get("moe_layers", 0)
            profile_fields["dense_params"] = (
                profile_fields["total_params"] - routed - profile_fields.get("mtp_params", 0)
            )
        return ModelProfile(name=name, **profile_fields)
    try:
        profile = ModelProfile.from_hf_config(config, name=name)
    except KeyError as e:
        model_type = config.get("model_type")
        raise ValueError(f"its config lacks {e.args[0]!r}, which a {model_type} config.json has") from None
    except (ValueError, TypeError) as e:
        # int("big") says only 'big': name the config field that holds it.
        culprits = [key for key, value in config.items() if isinstance(value, str) and repr(value) in str(e)]
        where = f"config field {culprits[0]!r}: " if culprits else ""
        raise ValueError(f"{where}{e}") from None
    return replace(profile, **profile_fields)


# The built-in profiles live in llmd/perf/data/models.yaml as config.json contents, with their sources; the user's
# profile folders (LLMD_PERF_PATH, add_profile_dir) add models or override fields.
MODELS: Mapping[str, ModelProfile] = ProfileTable("model", "models.yaml", _read_entry, _make)


def _normalise(name: str) -> str:
    return name.strip().rstrip("/").rsplit("/", 1)[-1].lower().removesuffix("-instruct")


def lookup_model(name: str) -> ModelProfile | None:
    """The registry entry `name` names (exact, or a hub id / path whose last part matches, case-insensitively)."""
    if name in MODELS:
        return MODELS[name]
    return {key.lower(): profile for key, profile in MODELS.items()}.get(_normalise(name))


def get_model(name_or_path: str | os.PathLike[str]) -> ModelProfile:
    """A registry profile by name, else the profile of a model folder (or config.json) on disk.

    Registry names match exactly or by their last path part, case-insensitively ("meta-llama/Llama-3.1-8B-Instruct"
    finds "llama-3.1-8b"), but an existing folder with a config.json wins over a name match.
    """
    text = os.fspath(name_or_path)
    if text in MODELS:
        return MODELS[text]
    path = Path(text)
    if (path.is_dir() and (path / "config.json").is_file()) or (path.is_file() and path.name.endswith(".json")):
        return ModelProfile.from_hf_config(path)
    found = lookup_model(text)
    if found is not None:
        return found
    raise UnknownProfileError(
        f"unknown model {text!r}: not a registered profile and not a folder with a config.json; known models: "
        f"{', '.join(MODELS)}"
    )


def model_for_spec(model: ModelSpec) -> ModelProfile:
    """The profile a deployment spec's `model` section describes: the registry entry its path (or served name) names,
    else the config.json of the folder at its path, else a coarse profile from active_params_b/total_params_b."""
    candidates = [model.path] + ([model.served_name] if model.served_name else [])
    for candidate in candidates:
        if candidate in MODELS:
            return MODELS[candidate]
    path = Path(model.path)
    if (path / "config.json").is_file():
        return ModelProfile.from_hf_config(path)
    for candidate in candidates:
        found = lookup_model(candidate)
        if found is not None:
            return found
    if model.active_params_b or model.total_params_b:
        total_b = model.total_params_b or model.active_params_b or 0.0
        active_b = model.active_params_b or total_b
        return ModelProfile.coarse(model.served_name or model.path, total_b * 1e9, active_b * 1e9)
    raise UnknownProfileError(
        f"model.path {model.path!r} is neither a registered model profile nor a folder with a config.json, and "
        f"model.active_params_b/total_params_b are not set; known models: {', '.join(MODELS)}"
    )


__all__ = ["MODELS", "SUPPORTED_MODEL_TYPES", "ModelProfile", "get_model", "lookup_model", "model_for_spec"]
