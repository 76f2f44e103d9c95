"""Tests for rlray.models.memory: parameter counts and byte formulas, by hand on a tiny shape and against
transformers' own models (built on the meta device: no weights) for the shipped config-only models (configs/models/)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rlray.models import ModelError
from rlray.models import memory as mem

FIXTURES = ("qwen2.5-1.5b", "qwen2.5-7b", "llama-3.1-70b")


@pytest.fixture()
def hand(tmp_path):
    """A hand-sized Llama: h 8, f 12, L 2, a 2, k 1, head_dim left out (h / a = 4), V 16, tied."""
    conf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8, "intermediate_size": 12,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 16,
            "tie_word_embeddings": True}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(conf))
    return mem.read_model_shape(tmp_path)


def test_parameter_counts_by_hand(hand):
    assert (hand.head_dim, hand.num_kv_heads, hand.qkv_bias, hand.architecture) == (4, 1, False, "LlamaForCausalLM")
    # q [8, 2*4] + o [8, 8]: 2*8*8 = 128; k, v [8, 1*4]: 2*8*4 = 64
    assert hand.attention_parameters == 192
    assert hand.mlp_parameters == 3 * 8 * 12 == 288
    assert hand.layer_parameters == 192 + 288 + 2 * 8 == 496
    # 2 layers + embedding 16*8 + tied lm_head 0 + final norm 8
    assert hand.parameters == 2 * 496 + 128 + 8 == 1128
    assert hand.linear_parameters == 2 * 480 + 128 == 1088  # the tied lm_head is still an nn.Linear call
    assert hand.root_parameters == 128 + 8
    assert hand.kv_bytes_per_token(2) == 2 * 2 * 1 * 4 * 2 == 32
    # rank 2: q 8+8, k 8+4, v 8+4, o 8+8, gate 8+12, up 8+12, down 12+8 = 116 per layer, 2 layers
    assert hand.lora_parameters(2, "all-linear") == 2 * 2 * 116 == 464
    assert hand.lora_parameters(2, ["q_proj", "v_proj"]) == 2 * 2 * (16 + 12) == 112
    assert hand.lora_parameters(2, ["lm_head"]) == 2 * (8 + 16) and hand.lora_parameters(0, "all-linear") == 0


def test_byte_formulas_by_hand(hand):
    # per token and layer: float32 4*(4h) = 128; compute c*(2h + 5*a*d + 4f) = c*(16 + 40 + 48) = 104c; lse 4a = 8
    assert mem.layer_activation_bytes(hand, 4) == 128 + 416 + 8 == 552
    assert mem.layer_activation_bytes(hand, 2) == 128 + 208 + 8 == 344
    # 10 tokens: 2 layers + the final norm's 8h = 64 bytes; checkpointed: each layer's float32 input 4h = 32, one
    # layer recomputed, the final norm
    assert mem.activation_bytes(hand, 10, 4, checkpointing=False) == 10 * (2 * 552 + 64) == 11680
    assert mem.activation_bytes(hand, 10, 4, checkpointing=True) == 10 * (2 * 32 + 552 + 64) == 6800
    # 6 positions x V 16: 8 bytes each, 8 + 12 with the entropy, 8 + 40 with the JSD
    assert mem.logits_bytes(6, 16) == 768
    assert mem.logits_bytes(6, 16, entropy=True) == 6 * 16 * 20
    assert mem.logits_bytes(6, 16, entropy=True, jsd=True) == 6 * 16 * 60
    # frozen copy: float32 all; bf16: the 2 * 480 untied linear weights in 2 bytes, the other 168 in 4
    assert mem.frozen_copy_bytes(hand, "float32") == 4 * 1128
    assert mem.frozen_copy_bytes(hand, "bfloat16") == 2 * 960 + 4 * 168 == 2592
    # 3 sequences of 20 tokens hold 2 blocks of 16 tokens each
    assert mem.kv_cache_bytes(3, 20, 32) == 3 * 32 * 32 == 3072


@pytest.mark.parametrize("name", FIXTURES)
def test_counts_match_transformers_models_of_the_fixtures(repo_root, name):
    folder = repo_root / "configs" / "models" / name
    shape = mem.read_model_shape(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    assert shape.parameters == sum(p.numel() for p in model.parameters())
    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert shape.linear_parameters == sum(m.weight.numel() + (0 if m.bias is None else m.bias.numel()) for m in linear)


def test_counts_match_the_tiny_random_model(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    shape = mem.read_model_shape(tiny_model_path)
    assert shape.parameters == sum(p.numel() for p in model.parameters()) == 6_587_008
    assert shape.kv_bytes_per_token(4) == 2 * 2 * 2 * 32 * 4


def test_public_parameter_counts_and_the_7b_weights_in_bf16(repo_root):
    sizes = {name: mem.read_model_shape(repo_root / "configs" / "models" / name).parameters for name in FIXTURES}
    # the model cards: Qwen2.5-1.5B 1.54B, Qwen2.5-7B 7.61B, Llama-3.1-70B 70.6B parameters
    assert sizes["qwen2.5-1.5b"] / 1.54e9 == pytest.approx(1.0, abs=0.005)
    assert sizes["qwen2.5-7b"] / 7.61e9 == pytest.approx(1.0, abs=0.005)
    assert sizes["llama-3.1-70b"] / 70.6e9 == pytest.approx(1.0, abs=0.005)
    assert sizes["qwen2.5-7b"] * 2 / mem.GIB == pytest.approx(14.185, abs=1e-3)  # 7.6B x 2 bytes: 14.19 GiB in bf16


def test_read_model_shape_errors(tmp_path):
    with pytest.raises(ModelError, match="cannot read the model's config.json"):
        mem.read_model_shape(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8, "num_attention_heads": 2}))
    with pytest.raises(ModelError, match="config.json has no 'intermediate_size'"):
        mem.read_model_shape(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"num_local_experts": 8}))
    with pytest.raises(ModelError, match="mixture-of-experts"):
        mem.read_model_shape(tmp_path)
