"""Scalar heads on a causal-LM trunk: PPO's value model and the Bradley-Terry reward model.

Both are Hugging Face classes, so their folders load anywhere: the critic is an
``AutoModelForTokenClassification`` with one label (a value per token), the reward model an
``AutoModelForSequenceClassification`` with one label. Built from a causal-LM checkpoint, the trunk
takes the checkpoint's weights and the head (``score``) is freshly initialised.

Scores are read at positions computed from lengths (``schema.pack_sequences`` layout), never from
token values: Hugging Face's sequence-classification pooling looks for the last token that is not
``pad_token_id``, which is wrong when ``pad_token_id == eos_token_id`` and a response ends in EOS.

Legend: B sequences, Pm longest prompt, T longest response, H hidden size.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoModelForTokenClassification, PreTrainedModel

from rlray.models.loading import ModelError
from rlray.schema import ModelInputs


def _load_head_model(cls, folder: str, key: str) -> PreTrainedModel:
    """Returns ``cls`` with one label from ``folder``; errors are ModelError naming ``key`` and the folder."""
    if not (Path(folder) / "config.json").is_file():
        what = "is not an existing folder" if not Path(folder).is_dir() else "has no config.json"
        raise ModelError(
            f"{key}='{folder}' {what}, so it is not a Hugging Face model folder; "
            f"set {key} to a folder with config.json and safetensors weights"
        )
    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as err:
        raise ModelError(f"{key}='{folder}': cannot read its config.json: {err}") from err
    config.num_labels = 1
    config.classifier_dropout = 0.0
    config.use_cache = False
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = getattr(config, "eos_token_id", None)
    try:
        model = cls.from_pretrained(folder, config=config, dtype=torch.float32, use_safetensors=True)
    except (OSError, ValueError, KeyError) as err:
        raise ModelError(f"{key}='{folder}': cannot load a {cls.__name__} with one label: {err}") from err
    if not hasattr(model, "score"):
        raise ModelError(f"{key}='{folder}': {type(model).__name__} has no 'score' head; use a Llama/Qwen/Mistral-style model")
    return model


def load_value_model(folder: str) -> PreTrainedModel:
    """Returns a float32 token-classification model with one label (PPO's critic), trunk from ``folder``.

    Raises:
        ModelError: the folder is missing, has no config.json, or cannot be loaded as a one-label
            token-classification model (names critic.model_path and the folder).
    """
    return _load_head_model(AutoModelForTokenClassification, folder, "critic.model_path")


def load_reward_model(folder: str, key: str = "reward.model_path") -> PreTrainedModel:
    """Returns a float32 sequence-classification model with one label, trunk (and head, if saved) from ``folder``.

    Args:
        folder: a local Hugging Face folder.
        key: the config key that gave ``folder``, named in errors (``model.path`` when
            algo.name=reward_model trains one).

    Raises:
        ModelError: the folder is missing, has no config.json, or cannot be loaded as a one-label
            sequence-classification model (names ``key`` and the folder).
    """
    return _load_head_model(AutoModelForSequenceClassification, folder, key)


def _hidden_states(model: torch.nn.Module, inputs: ModelInputs) -> torch.Tensor:
    inner = getattr(model, "module", model)  # DDP wrapper
    trunk = getattr(inner, inner.base_model_prefix)
    out = trunk(
        input_ids=inputs.input_ids,
        attention_mask=inputs.attention_mask,
        position_ids=inputs.position_ids,
        use_cache=False,
    )
    return out.last_hidden_state


def response_values(model: torch.nn.Module, inputs: ModelInputs) -> torch.Tensor:
    """Returns [B, T] float32 values V(s_t) of the response's states from a one-label head model.

    State s_t is (prompt, response[:t]); its value is read at the position that predicts response token t
    (the last prompt token for t = 0), the same positions that give response token t its logprob, as verl's
    critic does (``values[:, -T-1:-1]``).

    Args:
        model: a model from ``load_value_model`` (or its DDP wrapper).
        inputs: the rows' forward layout (``schema.ModelInputs``: input_ids, attention_mask, position_ids
            [B, Pm+T] int64 and response_ids [B, T] int64).

    Returns:
        [B, T] float32 values in reward units (meaningless past each response; mask them).
    """
    t = inputs.response_ids.shape[1]
    hidden = _hidden_states(model, inputs)[:, -t - 1 : -1]
    inner = getattr(model, "module", model)
    values = inner.score(hidden).squeeze(-1)
    return values.to(torch.promote_types(values.dtype, torch.float32))  # float64 models (tests) stay float64


def sequence_scores(model: torch.nn.Module, inputs: ModelInputs) -> torch.Tensor:
    """Returns [B] float32 reward-model scores read at each row's last response token.

    Args:
        model: a model from ``load_reward_model`` (or its DDP wrapper).
        inputs: the rows' forward layout (``schema.ModelInputs``, e.g. from ``schema.pack_sequences``); a row's
            last response token is at column Pm + its response length - 1 (an empty response reads column Pm).

    Returns:
        [B] float32 scores (the head's raw output).
    """
    t = inputs.response_ids.shape[1]
    last = inputs.input_ids.shape[1] - t - 1 + inputs.response_lengths.clamp(min=1)
    hidden = _hidden_states(model, inputs)
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    inner = getattr(model, "module", model)
    return inner.score(hidden[rows, last.to(hidden.device)]).squeeze(-1).float()
