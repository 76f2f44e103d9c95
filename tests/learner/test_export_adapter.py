"""PolicyLearner.export_adapter: the LoRA adapter alone, exactly as peft's save_pretrained writes it (issue 28's
adapter-only weight sync), cast to the engine dtype; refused for a policy that trains every weight."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from rlray.learner import PolicyLearner
from rlray.learner.policy import OptimizerSpec
from rlray.models.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterWeights, write_adapter

LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear"}


def _learner(path: str, **kw) -> PolicyLearner:
    return PolicyLearner(path, dtype="float32", optim=OptimizerSpec(lr=1e-2, max_grad_norm=1e9),
                         temperature=1.0, use_reference=False, **kw)


def _seeded_adapter(learner: PolicyLearner) -> None:
    """Sets every LoRA tensor to seeded noise (peft starts lora_B at 0, which would hide a wrong name or value)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in learner.module.named_parameters():
            if "lora_" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=g))


def test_the_export_is_what_save_pretrained_writes(tiny_model_path, tmp_path):
    learner = _learner(tiny_model_path, lora=LORA)
    _seeded_adapter(learner)
    learner.module.save_pretrained(tmp_path / "saved")
    adapter = learner.export_adapter(torch.float32)
    saved = load_file(str(tmp_path / "saved" / ADAPTER_WEIGHTS))
    # tiny-random: 2 layers x 7 linear modules (q, k, v, o, gate, up, down) x (lora_A, lora_B)
    assert len(adapter.tensors) == 28 and set(adapter.tensors) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(adapter.tensors[name], tensor), name
    config = json.loads((tmp_path / "saved" / ADAPTER_CONFIG).read_text())
    config.pop("auto_mapping")  # save_pretrained names the base class here; the config object holds None
    config["target_modules"] = sorted(config["target_modules"])  # a set there, in no order; sorted in the export
    assert {k: v for k, v in adapter.config.items() if k != "auto_mapping"} == config
    assert adapter.config["r"] == 4 and adapter.config["lora_alpha"] == 8.0 and adapter.config["inference_mode"]
    assert adapter.rank == 4
    # written back as a folder, it is the same two files' content
    write_adapter(tmp_path / "written", adapter)
    assert load_file(str(tmp_path / "written" / ADAPTER_WEIGHTS)).keys() == saved.keys()
    assert json.loads((tmp_path / "written" / ADAPTER_CONFIG).read_text()) == adapter.config


def test_the_export_is_cast_to_the_engine_dtype_and_leaves_the_policy_alone(tiny_model_path):
    learner = _learner(tiny_model_path, lora=LORA)
    _seeded_adapter(learner)
    before = {n: p.detach().clone() for n, p in learner.module.named_parameters()}
    adapter = learner.export_adapter(torch.bfloat16)
    assert {t.dtype for t in adapter.tensors.values()} == {torch.bfloat16}
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in adapter.tensors.values())
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    own = learner.module.get_parameter("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight")
    assert torch.equal(adapter.tensors[name], own.detach().to(torch.bfloat16))
    assert all(torch.equal(p, before[n]) for n, p in learner.module.named_parameters())


def test_the_export_of_a_continued_adapter_is_its_own(tiny_model_path, tmp_path):
    start = _learner(tiny_model_path, lora={**LORA, "target_modules": ["q_proj", "v_proj"]})
    _seeded_adapter(start)
    start.module.save_pretrained(tmp_path / "adapter")
    adapter = _learner(tiny_model_path, adapter_path=str(tmp_path / "adapter")).export_adapter(torch.float32)
    assert isinstance(adapter, AdapterWeights) and sorted(adapter.config["target_modules"]) == ["q_proj", "v_proj"]
    saved = load_file(str(tmp_path / "adapter" / ADAPTER_WEIGHTS))
    assert set(adapter.tensors) == set(saved) and all(torch.equal(adapter.tensors[k], v) for k, v in saved.items())


def test_a_policy_without_lora_has_no_adapter_to_export(tiny_model_path):
    with pytest.raises(ValueError, match="export_adapter needs a LoRA policy"):
        _learner(tiny_model_path).export_adapter(torch.float32)
