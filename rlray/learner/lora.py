"""The policy's LoRA adapters (Hu et al. 2021, through peft): applying them, merging them into the base weights, and
exporting the adapter alone. Part of the policy (``PolicyLearner``); the sharded merge is ``sharding.gathered_merged_lora_state_dict``.
"""

from __future__ import annotations

import json

import torch

from rlray.models.adapters import AdapterWeights


def apply_lora(
    model: torch.nn.Module, *, rank: int, alpha: float, dropout: float, target_modules: list[str] | str
) -> torch.nn.Module:
    """Returns the model wrapped by peft with LoRA adapters (Hu et al. 2021); only the adapters train."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(
        model, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules, bias="none")
    )


@torch.no_grad()
def merged_lora_state_dict(peft_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Returns the base model's state dict with every LoRA delta merged in, under the base names.

    Each adapted weight becomes ``W + get_delta_weight()`` (peft's ``scale * B @ A``, with
    fan-in/fan-out handled); adapter tensors are dropped and ``.base_layer`` is removed from names,
    so the result loads into the original architecture (and the rollout engine) as it is.
    """
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()
    deltas = {
        f"{name}.weight": module.get_delta_weight(module.active_adapters[0])
        for name, module in base.named_modules()
        if isinstance(module, LoraLayer) and module.active_adapters and hasattr(module, "get_delta_weight")
    }
    out = {}
    for key, value in base.state_dict().items():
        if "lora_" in key:
            continue
        name = key.replace(".base_layer.", ".")
        out[name] = value + deltas[name].to(value.dtype) if name in deltas else value
    return out


@torch.no_grad()
def lora_adapter_weights(peft_model: torch.nn.Module, dtype: torch.dtype) -> AdapterWeights:
    """Returns the active LoRA adapter of a peft model as ``save_pretrained`` would write it, tensors cast to ``dtype``
    on the CPU (contiguous); see ``PolicyLearner.export_adapter``."""
    from peft import get_peft_model_state_dict

    name = peft_model.active_adapter
    state = get_peft_model_state_dict(peft_model, adapter_name=name)
    config = json.loads(json.dumps(peft_model.peft_config[name].to_dict(), default=sorted))  # sets sorted, enums str
    config["inference_mode"] = True  # as save_pretrained writes it
    return AdapterWeights({k: v.detach().to("cpu", dtype).contiguous() for k, v in state.items()}, config)
