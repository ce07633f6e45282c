"""`llmd model make-tiny`: the dense Llama and the Qwen3-MoE folders hold the config keys and tensor names vLLM 0.32's
loaders read (that vLLM really serves them: tests/vllm_stack/test_moe.py and the other tests/vllm_stack modules)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from llmd.cli import main
from llmd.models.tiny import make_tiny


def test_moe_folder_is_a_qwen3_moe(tmp_path: Path) -> None:
    out = make_tiny(tmp_path / "moe", moe=True, num_experts=4, experts_per_token=2, moe_intermediate_size=32)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["model_type"] == "qwen3_moe"
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (4, 2, 32)
    assert cfg["decoder_sparse_step"] == 1 and cfg["mlp_only_layers"] == []
    tensors = load_file(str(out / "model.safetensors"))
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        assert tensors[p + "mlp.gate.weight"].shape == (4, h)
        assert tensors[p + "self_attn.q_norm.weight"].shape == (hd,)
        for e in range(4):
            assert tensors[p + f"mlp.experts.{e}.gate_proj.weight"].shape == (32, h)
            assert tensors[p + f"mlp.experts.{e}.down_proj.weight"].shape == (h, 32)
        assert p + "mlp.gate_proj.weight" not in tensors  # every layer is sparse
    # The same tokenizer as the dense model: the router and the simulated engine need nothing else.
    dense = make_tiny(tmp_path / "dense", weights=False)
    assert (out / "tokenizer.json").read_text() == (dense / "tokenizer.json").read_text()
    assert "mlp.experts" not in json.dumps(json.loads((dense / "config.json").read_text()))


def test_make_tiny_moe_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "make-tiny", str(tmp_path / "m"), "--moe"]) == 0
    assert "wrote tiny MoE model" in capsys.readouterr().out
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "qwen3_moe"
