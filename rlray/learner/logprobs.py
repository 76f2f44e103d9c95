"""Per-token log-probabilities of responses under a causal LM.

Legend: B sequences, Pm longest prompt, T longest response, V vocabulary.
"""

from __future__ import annotations

import contextlib

import torch

from rlray.learner.batching import split_microbatches, to_device


def autocast_context(dtype: str) -> contextlib.AbstractContextManager:
    """Returns a bf16 autocast context on the model's device type when ``dtype == 'bfloat16'``.

    Master weights stay float32; matmuls run in bf16 (about 2.5x faster on AMX CPUs).
    """
    if dtype != "bfloat16":
        return contextlib.nullcontext()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.autocast(device_type=device, dtype=torch.bfloat16)


def response_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor], *, temperature: float = 1.0) -> torch.Tensor:
    """Returns [B, T, V] float32 next-token logits at the response positions, divided by ``temperature``.

    Position i holds the logits that predict response token i. Only the logits of the T+1 last positions are
    computed (``logits_to_keep``), so the cost of the vocabulary projection scales with the response, not the
    prompt. Logits are divided by ``temperature`` before any softmax, as TRL's GRPOTrainer
    (``_get_per_token_logps_and_entropies``) and verl's ``logprobs_from_logits`` do, so that ratios are taken
    under the sampling distribution.

    Args:
        model: a Hugging Face causal LM (or a DDP wrapper of one).
        batch: ``collate`` output: input_ids [B, Pm+T] int64, attention_mask [B, Pm+T] int64,
            position_ids [B, Pm+T] int64, response_ids [B, T] int64.
        temperature: sampling temperature of the rollout (> 0).
    """
    t = batch["response_ids"].shape[1]
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        logits_to_keep=t + 1,
        use_cache=False,
    )
    return out.logits[:, :-1, :].float() / temperature


def logprobs_from_logits(
    logits: torch.Tensor, response_ids: torch.Tensor, *, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns logprobs [B, T] float32 (nats) of ``response_ids`` under ``logits`` [B, T, V], and the entropy [B, T]
    float32 (nats) of each position's distribution or None."""
    logz = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, response_ids.unsqueeze(-1)).squeeze(-1) - logz
    entropy = None
    if with_entropy:
        probs = torch.softmax(logits, dim=-1)
        entropy = logz - (probs * logits).sum(-1)
    return logprobs, entropy


def response_logprobs(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns the logprob of each response token, and optionally the policy entropy per token.

    ``logprobs_from_logits`` over ``response_logits`` (temperature-scaled logits of the T+1 last positions only).

    Args:
        model: a Hugging Face causal LM (or a DDP wrapper of one).
        batch: ``collate`` output (input_ids, attention_mask, position_ids [B, Pm+T], response_ids [B, T]).
        temperature: sampling temperature of the rollout (> 0).
        with_entropy: also return the entropy of the next-token distribution (nats).

    Returns:
        logprobs [B, T] float32 in nats (values at padded positions are meaningless; mask them),
        and entropy [B, T] float32 or None.
    """
    logits = response_logits(model, batch, temperature=temperature)
    return logprobs_from_logits(logits, batch["response_ids"], with_entropy=with_entropy)


@torch.no_grad()
def batched_logprobs(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], *, dtype: str, temperature: float, microbatch_size: int
) -> torch.Tensor:
    """Returns [B, T] float32 response logprobs without grad, computed in micro-batches of ``microbatch_size`` rows.

    Runs in eval mode (restored afterwards) under the learner's autocast, so that the policy, a
    reference copy on the learner and a reference actor give identical values for the same weights.

    Args:
        model: a Hugging Face causal LM.
        batch: ``collate`` output (input_ids, attention_mask, position_ids, response_ids [B, T]).
        dtype: "bfloat16" (bf16 autocast) or "float32".
        temperature: sampling temperature (> 0); see ``response_logprobs``.
        microbatch_size: rows per forward.
    """
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    t = batch["response_ids"].shape[1]
    out = torch.zeros(batch["response_ids"].shape, dtype=torch.float32)
    row = 0
    for mb in split_microbatches(batch, microbatch_size):
        with autocast_context(dtype):
            lp, _ = response_logprobs(model, to_device(mb, device), temperature=temperature)
        out[row : row + lp.shape[0], : lp.shape[1]] = lp.float().cpu()
        row += lp.shape[0]
    model.train(was_training)
    return out[:, :t]
