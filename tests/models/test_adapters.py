"""rlray.models.adapters: a PEFT LoRA adapter given as model.adapter_path is checked against the base (headers
only) and loaded trainable; every bad folder gets a ModelError naming model.adapter_path, the folder and the fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from rlray.models.adapters import check_adapter, load_adapter
from rlray.models.loading import ModelError, load_causal_lm, resolve_model_path

TARGETS = ["q_proj", "v_proj"]


def _save_adapter(model: torch.nn.Module, out: Path, base_name: str) -> dict[str, torch.Tensor]:
    """Saves a rank-4 LoRA adapter on ``model`` with seeded non-zero lora_B (peft starts B at 0); returns its tensors."""
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0))
    peft_model.peft_config["default"].base_model_name_or_path = base_name
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)
    peft_model.save_pretrained(out, safe_serialization=True)
    return {n: p.detach().clone() for n, p in peft_model.named_parameters() if "lora_" in n}


def _llama(hidden: int, layers: int) -> LlamaForCausalLM:
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=hidden // 4, vocab_size=100)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def adapter(tiny_model_path, tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    out = tmp_path_factory.mktemp("adapter") / "adapter"
    saved = _save_adapter(load_causal_lm(tiny_model_path), out, "tiny-random")
    return str(out), saved


def test_a_fitting_adapter_passes_and_returns_its_config(adapter, tiny_model_path):
    config = check_adapter(adapter[0], tiny_model_path)
    assert config["peft_type"] == "LORA" and config["r"] == 4 and sorted(config["target_modules"]) == TARGETS


def test_the_adapter_loads_trainable_with_its_saved_weights(adapter, tiny_model_path):
    model = load_adapter(load_causal_lm(tiny_model_path), adapter[0], tiny_model_path)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    # 2 layers x (q_proj, v_proj) x (lora_A, lora_B) = 8 tensors, all trainable, nothing else
    assert len(trainable) == 8 and all("lora_" in n for n in trainable)
    assert set(trainable) == set(adapter[1])
    for name, value in adapter[1].items():
        assert torch.equal(trainable[name].detach(), value), name  # loaded, not freshly initialised


def test_a_missing_folder_names_the_key(tmp_path, tiny_model_path):
    with pytest.raises(ModelError) as err:
        check_adapter(str(tmp_path / "nope"), tiny_model_path)
    assert str(err.value).startswith(f"model.adapter_path='{tmp_path / 'nope'}' is not an existing folder")


def test_a_folder_without_adapter_config_is_named(tmp_path, tiny_model_path):
    with pytest.raises(ModelError) as err:
        check_adapter(str(tmp_path), tiny_model_path)
    assert str(err.value).startswith(f"model.adapter_path='{tmp_path}' has no adapter_config.json")
    with pytest.raises(ModelError) as err:  # a full model folder given as the adapter
        check_adapter(tiny_model_path, tiny_model_path)
    assert "is a full model folder (config.json, no adapter_config.json); set model.path to it" in str(err.value)


def test_an_adapter_folder_given_as_model_path_is_told_to_move(adapter):
    with pytest.raises(ModelError) as err:
        resolve_model_path(adapter[0])
    assert str(err.value) == (
        f"model.path='{adapter[0]}' is a PEFT adapter folder (adapter_config.json, no config.json); set "
        f"model.adapter_path='{adapter[0]}' and model.path to its base model (its adapter_config.json names base "
        "'tiny-random')"
    )


def test_a_non_lora_adapter_and_missing_weights_are_named(adapter, tmp_path, tiny_model_path):
    folder = tmp_path / "a"
    shutil.copytree(adapter[0], folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(ModelError, match=r"has no adapter_model\.safetensors \(rlray reads safetensors only\)"):
        check_adapter(str(folder), tiny_model_path)
    (folder / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "IA3"}))
    with pytest.raises(ModelError, match=r"is a 'IA3' adapter; rlray continues LoRA adapters only"):
        check_adapter(str(folder), tiny_model_path)
    (folder / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(ModelError, match=r"adapter_config\.json holds a list, not a JSON object"):
        check_adapter(str(folder), tiny_model_path)


def test_an_adapter_of_another_base_is_named_with_shapes(tmp_path, tiny_model_path):
    _save_adapter(_llama(hidden=64, layers=2), tmp_path / "narrow", "other/narrow-model")
    with pytest.raises(ModelError) as err:
        check_adapter(str(tmp_path / "narrow"), tiny_model_path)
    # the tiny model's q_proj is [128 out, 128 in]; the narrow base's lora_A is [r=4, 64 in]
    assert str(err.value) == (
        f"model.adapter_path='{tmp_path / 'narrow'}': tensor 'base_model.model.model.layers.0.self_attn.q_proj.lora_A"
        ".weight' has shape [4, 64] but the base weight 'model.layers.0.self_attn.q_proj.weight' of model.path has "
        "shape [128, 128] (it was trained on base 'other/narrow-model'); use the adapter's own base model as model.path"
    )
    with pytest.raises(ModelError, match="has shape"):  # load_adapter checks before peft sees it
        load_adapter(load_causal_lm(tiny_model_path), str(tmp_path / "narrow"), tiny_model_path)


def test_an_adapter_of_a_deeper_base_names_the_missing_module(tmp_path, tiny_model_path):
    _save_adapter(_llama(hidden=128, layers=3), tmp_path / "deep", "other/deep-model")
    with pytest.raises(ModelError) as err:
        check_adapter(str(tmp_path / "deep"), tiny_model_path)
    assert "the adapter has module 'model.layers.2.self_attn.q_proj', which model.path does not have" in str(err.value)
    assert "(it was trained on base 'other/deep-model')" in str(err.value)
