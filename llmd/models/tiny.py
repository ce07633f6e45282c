"""Make a tiny random-weight model folder offline: config, safetensors weights, a locally trained tokenizer.

Dense: a Llama. MoE (`moe=True`): a Qwen3-MoE (`Qwen3MoeForCausalLM`, 8 experts, top-2), the layout of Qwen3-30B-A3B
checkpoints (per-expert gate/up/down projections, q/k norms), which vLLM 0.32's CPU build serves on one instance.
The same folder serves the simulated engine (which only needs the tokenizer) and vLLM's CPU build (which loads the
weights too). Its output text is noise, but the engine, scheduler, prefix cache and KV events are real. Only numpy,
safetensors and tokenizers are needed, so it works in the light install.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def _corpus() -> list[str]:
    # Real English and code from the standard library: stable for a given Python, and varied enough that the
    # tokenizer learns merges that real prompts exercise.
    import argparse
    import collections
    import json as json_mod
    import pathlib
    import re
    import string
    import textwrap

    texts: list[str] = []
    for mod in (argparse, collections, json_mod, pathlib, re, string, textwrap):
        texts.append(inspect.getsource(mod))
    return texts


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def make_tiny(
    out_dir: str | Path,
    *,
    vocab_size: int = 1024,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 4,
    intermediate_size: int = 256,
    max_position_embeddings: int = 4096,
    seed: int = 0,
    weights: bool = True,
    moe: bool = False,
    num_experts: int = 8,
    experts_per_token: int = 2,
    moe_intermediate_size: int = 64,
) -> Path:
    """Write the model folder and return its path. Deterministic under `seed`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer(vocab_size)
    tok.save(str(out / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
        "pad_token": "<pad>",
        "unk_token": None,
        "model_max_length": max_position_embeddings,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "special": True,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            }
            for t, i in ids.items()
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "<pad>"}, indent=2)
    )
    head_dim = hidden_size // num_heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": ids["<s>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<pad>"],
        "attention_bias": False,
        "mlp_bias": False,
    }
    if moe:
        config.update(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            num_experts=num_experts,
            num_experts_per_tok=experts_per_token,
            moe_intermediate_size=moe_intermediate_size,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            rms_norm_eps=1e-6,
        )
        del config["mlp_bias"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": ids["<s>"], "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<pad>"]})
    )
    if weights:
        _write_weights(out, config, seed)
    return out


def _write_weights(out: Path, cfg: dict, seed: int) -> None:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    q_out, kv_out = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float16)

    tensors = {
        "model.embed_tokens.weight": w(v, h),
        "model.norm.weight": np.ones(h, np.float16),
        "lm_head.weight": w(v, h),
    }
    moe = cfg["model_type"] == "qwen3_moe"
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(q_out, h),
            p + "self_attn.k_proj.weight": w(kv_out, h),
            p + "self_attn.v_proj.weight": w(kv_out, h),
            p + "self_attn.o_proj.weight": w(h, q_out),
            p + "input_layernorm.weight": np.ones(h, np.float16),
            p + "post_attention_layernorm.weight": np.ones(h, np.float16),
        }
        if not moe:
            tensors |= {
                p + "mlp.gate_proj.weight": w(inter, h),
                p + "mlp.up_proj.weight": w(inter, h),
                p + "mlp.down_proj.weight": w(h, inter),
            }
            continue
        # Qwen3 normalizes q and k per head; the router (`mlp.gate`) scores every expert.
        tensors |= {
            p + "self_attn.q_norm.weight": np.ones(hd, np.float16),
            p + "self_attn.k_norm.weight": np.ones(hd, np.float16),
            p + "mlp.gate.weight": w(cfg["num_experts"], h),
        }
        e_inter = cfg["moe_intermediate_size"]
        for e in range(cfg["num_experts"]):
            tensors |= {
                p + f"mlp.experts.{e}.gate_proj.weight": w(e_inter, h),
                p + f"mlp.experts.{e}.up_proj.weight": w(e_inter, h),
                p + f"mlp.experts.{e}.down_proj.weight": w(h, e_inter),
            }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
