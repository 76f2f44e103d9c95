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


@pytest.fixture(scope="session")
def engine_learner_mismatch():
    """Returns fn(engine, learner, prompts, sampling, pad_token_id, batching=None) -> (k3 KL, mean |d|, max |d|) in
    nats/token.

    The engine samples ``sampling`` from ``prompts``; the learner scores the same tokens through its real path
    (``PolicyLearner.logprobs``: ``batched_logprobs``, padded/packed as ``learner.sequence_packing=auto``, shared
    prompts), as a step's old_logprobs. d = learner - rollout logprob per sampled token; k3 is
    ``algos.kl_penalty(rollout, learner, "k3")`` (KL(pi_rollout || pi_learner) from the engine's samples, the run's
    ``algo/rollout_kl``), token mean, computed in float64 (float32 loses exp(d) - 1 at |d| ~ 1e-6).
    benchmarks/mismatch.py measures the same on SmolLM2 in both precisions.
    """
    from rlray import algos
    from rlray.learner import MicroBatching
    from rlray.schema import pack_sequences, response_mask_from_lengths

    def measure(engine, learner, prompts: list[list[int]], sampling, pad_token_id: int,
                batching: MicroBatching | None = None) -> tuple[float, float, float]:
        completions = engine.generate(prompts, sampling)
        inputs = pack_sequences([prompts[c.prompt_index] for c in completions],
                                [c.response_token_ids for c in completions], pad_token_id)
        t = inputs.response_ids.shape[1]
        rollout = torch.tensor([c.rollout_logprobs + [0.0] * (t - len(c.rollout_logprobs)) for c in completions],
                               dtype=torch.float64)
        batching = batching or MicroBatching(sequences=8, packing="auto")  # exact_new_tokens: the exact layout
        learner_lp = learner.logprobs(inputs, reference=False, batching=batching)
        mask = response_mask_from_lengths(inputs)
        k3 = algos.kl_penalty(rollout, learner_lp.double(), "k3")[mask]
        d = (learner_lp.double() - rollout)[mask]
        return float(k3.mean()), float(d.abs().mean()), float(d.abs().max())

    return measure
