"""Frozen models that score responses: the reference and the teacher (``FrozenScorer``), on the learner or on their own
(``ReferenceModel``, a Ray actor when resources.reference.placement == "actor").

Legend: B sequences, T response tokens.
"""

from __future__ import annotations

import torch

from rlray.learner.batching import MicroBatching
from rlray.learner.packing import TokenCounts
from rlray.learner.parallel import Parallelism, Single
from rlray.learner.scoring import batched_logprobs
from rlray.models import load_causal_lm
from rlray.schema import ModelInputs


class FrozenScorer:
    """A frozen model (no optimizer, no grad) that gives response logprobs: the reference, or a distillation teacher.

    The model is placed by the learner's parallelism strategy (``Parallelism.place_frozen``: whole on the policy's
    device with bf16 linear weights under bf16 autocast, or sharded like the policy under FSDP2), and scored under
    the same autocast and temperature as the policy (``batched_logprobs``), so that a frozen copy equal to the
    policy gives the policy's values.

    Args:
        model: the frozen model (``requires_grad`` False on every parameter; ``config.use_cache`` False); placed in
            place.
        dtype: "bfloat16" (bf16 autocast) or "float32".
        temperature: rollout sampling temperature (logits are divided by it).
        parallel: the learner's strategy (``Single()`` when None).
        device: where a whole copy goes (the policy's device), or None to leave it where it is.

    Raises:
        ValueError: a parameter still requires grad (under FSDP2, or a linear weight cast to bf16).
    """

    def __init__(self, model: torch.nn.Module, *, dtype: str, temperature: float, parallel: Parallelism | None = None,
                 device: torch.device | None = None) -> None:
        self.dtype = dtype
        self.temperature = temperature
        self.module = (parallel or Single()).place_frozen(model, dtype=dtype, device=device)

    def logprobs(self, inputs: ModelInputs, batching: MicroBatching, *, tokens: TokenCounts | None = None,
                 temperature: float | None = None) -> torch.Tensor:
        """Returns [B, T] float32 logprobs of the rows' responses (``inputs``), micro-batch by micro-batch as
        ``batching`` says (already the strategy's: ``Parallelism.micro_batching``); the tokens computed add to
        ``tokens`` when given. ``temperature``: the learner's own when it holds the scorer (None: this scorer's)."""
        temperature = self.temperature if temperature is None else temperature
        return batched_logprobs(self.module, inputs, dtype=self.dtype, temperature=temperature, batching=batching,
                                tokens=tokens)


class ReferenceModel:
    """Returns reference logprobs from a frozen copy of the initial policy (a ``FrozenScorer`` in its own process).

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
        model = load_causal_lm(model_path, dtype=torch.float32).eval().requires_grad_(False)
        model.config.use_cache = False
        self.scorer = FrozenScorer(model, dtype=dtype, temperature=temperature)  # bf16 linear weights under bf16
        self.model = self.scorer.module

    def logprobs(self, inputs: ModelInputs, batching: MicroBatching) -> torch.Tensor:
        """Returns [B, T] float32 reference logprobs of the rows' responses (``batched_logprobs``, micro-batch by
        micro-batch as ``batching`` says)."""
        return self.scorer.logprobs(inputs, batching)
