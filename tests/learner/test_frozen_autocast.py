"""``store_frozen_for_autocast``: a frozen model's linear weights in bf16 give bit-identical outputs under bf16
autocast, in half the memory; tied and trainable weights are left alone."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlray.learner.logprobs import autocast_context, store_frozen_for_autocast


@pytest.fixture
def frozen(tiny_model_path):
    """The tiny Llama (2 layers, hidden 64, tied embeddings), float32, frozen."""
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval().requires_grad_(False)


def test_linear_weights_in_bf16_give_the_same_logits_under_autocast(frozen):
    before = copy.deepcopy(frozen)
    store_frozen_for_autocast(frozen, "bfloat16")
    ids = torch.randint(0, frozen.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), autocast_context("bfloat16"):
        want, got = before(ids).logits, frozen(ids).logits
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_only_untied_linear_weights_are_cast_and_the_bytes_saved_are_counted(frozen):
    cfg = frozen.config
    assert cfg.tie_word_embeddings  # the tiny model ties lm_head to the embeddings
    # per layer: q, o (h x h), k, v (h x kv_heads*head_dim), gate, up, down (h x intermediate); 2 bytes saved per value
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * cfg.intermediate_size
    assert store_frozen_for_autocast(frozen, "bfloat16") == 2 * cfg.num_hidden_layers * per_layer
    dtypes = {name: p.dtype for name, p in frozen.named_parameters(remove_duplicate=False)}
    assert dtypes["model.layers.1.self_attn.k_proj.weight"] == torch.bfloat16
    assert dtypes["model.layers.0.mlp.down_proj.weight"] == torch.bfloat16
    assert dtypes["model.embed_tokens.weight"] == dtypes["lm_head.weight"] == torch.float32  # tied: stays
    assert dtypes["model.layers.0.input_layernorm.weight"] == dtypes["model.norm.weight"] == torch.float32
    assert frozen.lm_head.weight is frozen.model.embed_tokens.weight


def test_float32_leaves_the_model_alone_and_trainable_weights_are_refused(frozen):
    assert store_frozen_for_autocast(frozen, "float32") == 0
    assert {p.dtype for p in frozen.parameters()} == {torch.float32}
    frozen.model.layers[0].mlp.up_proj.requires_grad_(True)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight requires grad"):
        store_frozen_for_autocast(frozen, "bfloat16")
    assert {p.dtype for p in frozen.parameters()} == {torch.float32}  # refused before anything was cast
