"""The frozen reference model on its own (a Ray actor when resources.reference.placement == "actor").

Legend: B sequences, T response tokens.
"""

from __future__ import annotations

import torch

from rlray.learner.batching import MicroBatching
from rlray.learner.logprobs import store_frozen_for_autocast
from rlray.learner.scoring import batched_logprobs
from rlray.models import load_causal_lm
from rlray.schema import ModelInputs


class ReferenceModel:
    """Returns reference logprobs from a frozen copy of the initial policy.

    Args:
        model_path: local Hugging Face folder of the initial policy.
        dtype: "bfloat16" (bf16 autocast, as the learner; the linear weights are stored in bf16, which gives the
            same outputs: ``store_frozen_for_autocast``) or "float32".
        temperature: rollout sampling temperature (logits are divided by it, as the learner does).
        torch_threads: torch.set_num_threads for this process.
    """

    def __init__(self, model_path: str, *, dtype: str, temperature: float, torch_threads: int) -> None:
        torch.set_num_threads(torch_threads)
        self.dtype = dtype
        self.temperature = temperature
        self.model = load_causal_lm(model_path, dtype=torch.float32).eval().requires_grad_(False)
        self.model.config.use_cache = False
        store_frozen_for_autocast(self.model, dtype)  # bf16 linear weights under bf16 autocast: same outputs

    def logprobs(self, inputs: ModelInputs, batching: MicroBatching) -> torch.Tensor:
        """Returns [B, T] float32 reference logprobs of the rows' responses (``batched_logprobs``, micro-batch by
        micro-batch as ``batching`` says)."""
        return batched_logprobs(self.model, inputs, dtype=self.dtype, temperature=self.temperature, batching=batching)
