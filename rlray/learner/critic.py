"""PPO's critic on the learner: values at rollout time, and the clipped value-loss update.

The critic is a ``PolicyLearner`` over ``rlray.models.load_value_model`` (a value head on a copy of the policy
checkpoint, or on ``critic.model_path``), with its own AdamW; the policy learner carries it (``learner.critic``),
so its weights and optimizer state travel in the policy learner's ``state_dict``.

Legend: B sequences, T response tokens.
"""

from __future__ import annotations

import torch

from rlray import algos
from rlray.learner.batching import MicroBatching, microbatches
from rlray.learner.objective import Normaliser
from rlray.learner.parallel import Parallelism
from rlray.learner.policy import OptimizerSpec, PolicyLearner
from rlray.learner.scoring import packs, response_value_scores
from rlray.models.heads import load_value_model
from rlray.schema import ModelInputs, StepBatch

CRITIC_STAT_KEYS = ("value_loss_sum", "value_clipped_sum", "value_tokens")


def build_critic(model_path: str, *, dtype: str, lr: float, max_grad_norm: float,
                 parallel: Parallelism | None = None) -> PolicyLearner:
    """Returns the critic learner: a value model (``load_value_model``) with AdamW (betas 0.9/0.999, no decay).

    Args:
        model_path: local folder of the trunk (the policy checkpoint, or ``critic.model_path`` resolved).
        dtype: "bfloat16" (autocast) or "float32".
        lr: AdamW learning rate.
        max_grad_norm: global L2 gradient clip.
        parallel: the policy learner's parallelism strategy (``rlray.learner.parallel``), or None (``Single()``).

    Raises:
        rlray.models.ModelError: the folder cannot hold a one-label token-classification model.
    """
    return PolicyLearner(
        model_path,
        dtype=dtype,
        temperature=1.0,
        optim=OptimizerSpec(lr=lr, max_grad_norm=max_grad_norm, betas=(0.9, 0.999), weight_decay=0.0, warmup_steps=0),
        parallel=parallel,
        use_reference=False,
        model_loader=load_value_model,
    )


@torch.no_grad()
def critic_values(critic: PolicyLearner, inputs: ModelInputs, response_mask: torch.Tensor,
                  batching: MicroBatching) -> torch.Tensor:
    """Returns [B, T] float32 critic values V(s_t) of the rows' response states (no grad, eval mode), micro-batch by
    micro-batch (``batching``: rows or tokens, padded or packed; the tokens computed add to the critic's
    ``take_tokens``).

    Values where ``response_mask`` [B, T] bool is False (past each response) are 0.
    """
    model = critic.module
    was_training = model.training
    model.eval()
    batching = critic.micro_batching(batching)
    packed = packs(model, batching.packing)
    device = next(model.parameters()).device
    out = torch.zeros(inputs.response_ids.shape, dtype=torch.float32)
    for rows, mb in microbatches(inputs, batching, packed=packed):
        values, tokens = response_value_scores(model, mb.to(device), dtype=critic.dtype, packed=packed,
                                               share_prefixes=batching.share_prefixes)
        out[rows, : values.shape[1]] = values.float().cpu()
        critic.tokens.add(tokens)
    model.train(was_training)
    return torch.where(response_mask, out, torch.zeros_like(out))


def value_objective(
    values: torch.Tensor, mb: StepBatch, clip_eps: float | None, norm: Normaliser
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Returns the micro-batch's share of the mini-batch value loss (token-mean, global count) and its sums.

    loss = sum over valid tokens of 0.5 * max((V - R)^2, (V_clip - R)^2) / num_tokens * world_size
    (``algos.value_loss``; verl ``compute_value_loss`` with token-mean aggregation).

    Args:
        values: [B, T] float32 current critic values (with grad).
        mb: micro-batch (``StepBatch``) with old_values [B, T] (rollout-time values), returns [B, T] (GAE
            targets) and response_mask [B, T] bool.
        clip_eps: value clip range in reward units, or None.
        norm: global denominators of the mini-batch.

    Returns:
        (loss, {"value_loss_sum", "value_clipped_sum", "value_tokens"}) summed over valid tokens.
    """
    mask = mb.response_mask
    per_token, diag = algos.value_loss(values, mb.old_values, mb.returns, mask, clip_eps=clip_eps)
    loss = algos.aggregate_loss(per_token, mask, "token-mean", num_tokens=norm.num_tokens) * norm.world_size
    stats = {
        "value_loss_sum": per_token.detach().sum(),
        "value_clipped_sum": diag["clipped"].sum(),
        "value_tokens": mask.float().sum(),
    }
    return loss, stats


def train_critic_minibatch(
    critic: PolicyLearner,
    minibatch: StepBatch,
    clip_eps: float | None,
    norm: Normaliser,
    batching: MicroBatching,
) -> dict[str, float]:
    """Runs one critic optimizer step over a mini-batch, micro-batch by micro-batch (``batching``); returns loss,
    grad_norm, lr and the value-loss sums."""
    batching = critic.micro_batching(batching)
    packed = packs(critic.model, batching.packing)

    def micro_loss(model: torch.nn.Module, mb: StepBatch):
        values, tokens = response_value_scores(model, mb.inputs, dtype=critic.dtype, packed=packed,
                                               share_prefixes=batching.share_prefixes)
        critic.tokens.add(tokens)
        return value_objective(values.float(), mb, clip_eps, norm)

    return critic.optimizer_step([mb for _, mb in microbatches(minibatch, batching, packed=packed)], micro_loss)
