"""Fixtures for the rollout tests: the tiny model in transformers, and reference computations.

The tiny model itself ('tiny-random': a seeded random 2-layer float32 Llama, head_dim 32, tied
embeddings, SmolLM2's tokenizer) comes from the session fixture `tiny_model_path` in
tests/conftest.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM


@pytest.fixture(scope="session")
def tiny_hf(tiny_model_path: str) -> torch.nn.Module:
    """Returns the tiny model in transformers, float32, eval mode. Tests must not modify it."""
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def eos_id(tiny_model_path: str) -> int:
    """Returns the tiny model's EOS token id (SmolLM2's <|im_end|>)."""
    return int(json.loads((Path(tiny_model_path) / "config.json").read_text())["eos_token_id"])
