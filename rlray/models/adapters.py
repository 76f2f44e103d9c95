"""Starting from an existing PEFT LoRA adapter (``model.adapter_path``): check it fits the base, then load it trainable.

An adapter folder is what peft's ``save_pretrained`` writes: ``adapter_config.json`` (peft_type, rank,
targets, ``base_model_name_or_path``) and ``adapter_model.safetensors`` with tensors named
``base_model.model.<module>.lora_A.weight`` [r, in_features] and ``...lora_B.weight`` [out_features, r].
``check_adapter`` reads only the JSON and the safetensors headers of both folders, so the driver's preflight
catches a wrong folder or an adapter trained on another base before Ray starts. ``load_adapter`` loads it
with ``is_trainable=True`` (peft's default loads it frozen, and the optimizer would then get an empty
parameter list), as TRL does when given a ``PeftModel`` to continue training.

``AdapterWeights`` is an adapter in memory (the same two files' contents) as the learner exports it for an
adapter-only weight sync; ``write_adapter`` writes it as such a folder (vLLM's runtime LoRA loads folders).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rlray.models.loading import ModelError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."


@dataclass
class AdapterWeights:
    """A LoRA adapter in memory: what peft's ``save_pretrained`` writes, as values.

    Attributes:
        tensors: {peft name: tensor}, the names of ``adapter_model.safetensors``
            (``base_model.model.<module>.lora_A.weight`` [r, in_features], ``...lora_B.weight`` [out_features, r]);
            in Ray's object store, ``rlray.rollout.wire.pack_weights`` output instead of tensors.
        config: the content of ``adapter_config.json`` (peft's LoraConfig as a JSON object: peft_type, r,
            lora_alpha, target_modules, ...).
    """

    tensors: dict[str, Any]
    config: dict[str, Any]

    @property
    def rank(self) -> int:
        """Returns the adapter's largest LoRA rank (``r``, or a larger one in ``rank_pattern``)."""
        return max([int(self.config["r"]), *(int(r) for r in (self.config.get("rank_pattern") or {}).values())])


def write_adapter(folder: str | Path, adapter: AdapterWeights) -> Path:
    """Returns ``folder`` after writing ``adapter`` into it as peft's ``save_pretrained`` would (the folder is created).

    Args:
        folder: where to write ``adapter_config.json`` and ``adapter_model.safetensors``.
        adapter: CPU tensors (any float dtype, written as they are) and the config.
    """
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in adapter.tensors.items()}, str(out / ADAPTER_WEIGHTS))
    (out / ADAPTER_CONFIG).write_text(json.dumps(adapter.config, indent=2, sort_keys=True))
    return out


def read_adapter_config(folder: str | Path) -> dict[str, Any] | None:
    """Returns the parsed ``adapter_config.json`` of ``folder``, or None when the folder has none.

    Raises:
        ModelError: the file exists but is not a JSON object (names the file).
    """
    file = Path(folder) / ADAPTER_CONFIG
    if not file.is_file():
        return None
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ModelError(f"model.adapter_path: cannot read {file}: {err}") from err
    if not isinstance(config, dict):
        raise ModelError(f"model.adapter_path: {file} holds a {type(config).__name__}, not a JSON object")
    return config


def check_adapter(adapter_path: str, model_dir: str) -> dict[str, Any]:
    """Returns the adapter's config after checking that ``adapter_path`` is a LoRA adapter that fits ``model_dir``.

    Args:
        adapter_path: the value of ``model.adapter_path``: a folder written by peft's ``save_pretrained``.
        model_dir: the base model's local Hugging Face folder (``model.path`` resolved).

    Raises:
        ModelError: the folder is missing; it has no adapter_config.json (a full model folder is told to go
            in model.path); it is not a LoRA adapter (peft_type); it has no adapter_model.safetensors; or an
            adapted module is not in the base model or its shapes differ (an adapter for another base).
            Every message names model.adapter_path, the folder and the fix.
    """
    key = f"model.adapter_path='{adapter_path}'"
    folder = Path(adapter_path)
    if not folder.is_dir():
        raise ModelError(f"{key} is not an existing folder; set it to a folder written by peft's save_pretrained "
                         f"({ADAPTER_CONFIG}, {ADAPTER_WEIGHTS}), or unset it to start from model.path alone")
    config = read_adapter_config(folder)
    if config is None:
        if (folder / "config.json").is_file():
            raise ModelError(f"{key} is a full model folder (config.json, no {ADAPTER_CONFIG}); set model.path to it "
                             "and leave model.adapter_path unset")
        raise ModelError(f"{key} has no {ADAPTER_CONFIG}, so it is not a PEFT adapter folder; point it at the folder "
                         "peft's save_pretrained wrote")
    if config.get("peft_type") != "LORA":
        raise ModelError(f"{key} is a {config.get('peft_type')!r} adapter; rlray continues LoRA adapters only "
                         "(peft_type 'LORA')")
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise ModelError(f"{key} has no {ADAPTER_WEIGHTS} (rlray reads safetensors only); re-save the adapter with "
                         "save_pretrained(..., safe_serialization=True)")
    check_adapter_shapes(key, config, _shapes(folder / ADAPTER_WEIGHTS), _base_shapes(model_dir))
    return config


def load_adapter(model: torch.nn.Module, adapter_path: str, model_dir: str) -> torch.nn.Module:
    """Returns ``model`` wrapped by peft with the adapter of ``adapter_path`` loaded trainable (only the adapters train).

    Args:
        model: the base model loaded from ``model_dir``.
        adapter_path: the value of ``model.adapter_path`` (see ``check_adapter``).
        model_dir: the base model's local folder (``model.path`` resolved), checked against the adapter.

    Raises:
        ModelError: ``check_adapter`` fails, peft cannot load the adapter onto the model, or no adapter
            parameter ends up trainable.
    """
    from peft import PeftModel

    check_adapter(adapter_path, model_dir)
    try:
        peft_model = PeftModel.from_pretrained(model, adapter_path, is_trainable=True)
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        raise ModelError(f"model.adapter_path='{adapter_path}': cannot load it onto model.path='{model_dir}': {err}") from err
    if not any(p.requires_grad for p in peft_model.parameters()):
        raise ModelError(f"model.adapter_path='{adapter_path}' loaded with no trainable parameter; it cannot train")
    return peft_model


def _shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Returns {tensor name: shape} from one safetensors file's header (no tensor is read)."""
    with safe_open(str(file), framework="pt") as handle:
        return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}


def _base_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    """Returns {tensor name: shape} of every ``*.safetensors`` file of the base model folder."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        shapes.update(_shapes(file))
    return shapes


def check_adapter_shapes(key: str, config: dict[str, Any], adapter: dict[str, tuple[int, ...]],
                         base: dict[str, tuple[int, ...]]) -> None:
    """Raises ModelError (its message starting with ``key``) when a lora_A/lora_B tensor's module is not in ``base``
    or its shape does not fit.

    lora_A [r, in] must match the base weight's in-features (dim 1), lora_B [out, r] its out-features (dim 0).
    A tied LM head missing from the base files is not checked.
    """
    trained_on = config.get("base_model_name_or_path")
    hint = f" (it was trained on base '{trained_on}')" if trained_on else ""
    for name, shape in sorted(adapter.items()):
        part = ".lora_A." if ".lora_A." in name else ".lora_B." if ".lora_B." in name else None
        if part is None or not name.endswith(".weight"):
            continue
        module = name.removeprefix(_PREFIX).split(part)[0]
        weight = base.get(f"{module}.weight")
        if weight is None:
            if module.endswith("lm_head"):
                continue
            raise ModelError(f"{key}: the adapter has module '{module}', which model.path does not have{hint}; "
                             "use the adapter's own base model as model.path")
        dim = 1 if part == ".lora_A." else 0
        if len(weight) != 2 or len(shape) != 2 or shape[dim] != weight[dim]:
            raise ModelError(f"{key}: tensor '{name}' has shape {list(shape)} but the base weight '{module}.weight' "
                             f"of model.path has shape {list(weight)}{hint}; use the adapter's own base model as "
                             "model.path")
