"""The policy learner: forward/backward, logprobs, the optimizer and weight export.

A plain class; ``rlray.loop`` runs it inside each Ray Train worker. Legend: B sequences, T response
tokens, Pm longest prompt.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterable, Iterator

import torch

from rlray.learner.logprobs import autocast_context, response_logprobs
from rlray.learner.objective import LossSpec, Normaliser, policy_objective
from rlray.models import load_causal_lm


def split_microbatches(batch: dict[str, torch.Tensor], size: int) -> Iterator[dict[str, torch.Tensor]]:
    """Yields consecutive row slices of ``batch`` with ``size`` rows each (the last may be shorter).

    Padding columns that are empty in every row of a slice are trimmed, so short micro-batches do
    not pay for the longest response of the step.
    """
    n = batch["input_ids"].shape[0]
    for start in range(0, n, size):
        mb = {k: v[start : start + size] for k, v in batch.items()}
        yield _trim(mb)


def _trim(mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    t_full = mb["response_ids"].shape[1]
    t = int(mb["attention_mask"][:, -t_full:].sum(1).max().item()) if t_full else 0
    p_full = mb["input_ids"].shape[1] - t_full
    p = int(mb["attention_mask"][:, :p_full].sum(1).max().item())
    out = {}
    for k, v in mb.items():
        if v.dim() == 2 and v.shape[1] == p_full + t_full:
            out[k] = v[:, p_full - p : p_full + t]
        elif v.dim() == 2 and v.shape[1] == t_full:
            out[k] = v[:, :t]
        else:
            out[k] = v
    return out


MicroLoss = Callable[[torch.nn.Module, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""fn(model, micro-batch) -> (loss share to backward, {stat name: 0-dim tensor summed over the micro-batch})."""


class PolicyLearner:
    """Holds the model (float32 master weights), an optional frozen reference, AdamW and its schedule.

    The model is the policy (a causal LM) by default; ``model_loader`` builds another one-model learner on
    the same machinery (PPO's critic, the reward model of ``algo.name=reward_model``).

    Args:
        model_path: local Hugging Face folder (see ``rlray.models.resolve_model_path``).
        dtype: "bfloat16" runs forward/backward under bf16 autocast; "float32" runs in float32.
        lr, betas, weight_decay: AdamW (Loshchilov & Hutter 2019) settings.
        warmup_steps: linear warm-up length in optimizer steps, then constant.
        max_grad_norm: global L2 gradient clip.
        temperature: rollout sampling temperature; logits are divided by it (see ``response_logprobs``).
        use_reference: keep a frozen copy of the initial policy for KL.
        gradient_checkpointing: recompute activations in backward.
        wrap_model: hook that wraps the policy for data parallelism (``ray.train.torch.prepare_model``);
            identity when None.
        model_loader: builds the float32 model from ``model_path``; None loads a causal LM.
        critic: PPO's critic (a learner over ``rlray.models.load_value_model``); its weights and optimizer
            state travel in this learner's ``state_dict``.

    Raises:
        rlray.models.ModelError: the folder cannot be loaded.
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str,
        lr: float,
        betas: tuple[float, float],
        weight_decay: float,
        warmup_steps: int,
        max_grad_norm: float,
        temperature: float,
        use_reference: bool,
        gradient_checkpointing: bool = False,
        wrap_model: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
        model_loader: Callable[[str], torch.nn.Module] | None = None,
        critic: PolicyLearner | None = None,
    ) -> None:
        self.dtype = dtype
        self.temperature = temperature
        self.max_grad_norm = max_grad_norm
        self.critic = critic
        policy = model_loader(model_path) if model_loader else load_causal_lm(model_path, dtype=torch.float32)
        policy.config.use_cache = False
        if gradient_checkpointing:
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.reference = None
        if use_reference:
            self.reference = copy.deepcopy(policy).eval().requires_grad_(False)
        self.module = policy  # unwrapped, for export and checkpoints
        self.model = wrap_model(policy) if wrap_model else policy
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            [p for p in policy.parameters() if p.requires_grad], lr=lr, betas=betas, weight_decay=weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps else 1.0
        )

    @torch.no_grad()
    def logprobs(self, batch: dict[str, torch.Tensor], *, reference: bool, microbatch_size: int) -> torch.Tensor:
        """Returns [B, T] float32 logprobs of the batch's responses under the policy or the reference.

        Runs without grad in micro-batches of ``microbatch_size`` rows, under the same autocast as the
        update so that the reference and the initial policy give identical values.

        Raises:
            ValueError: ``reference=True`` on a learner built without a reference model.
        """
        model = self.reference if reference else self.module
        if model is None:
            raise ValueError("this learner has no reference model (algo.kl_coef == 0)")
        was_training = model.training
        model.eval()
        t = batch["response_ids"].shape[1]
        out = torch.zeros(batch["response_ids"].shape, dtype=torch.float32)
        row = 0
        for mb in split_microbatches(batch, microbatch_size):
            with autocast_context(self.dtype):
                lp, _ = response_logprobs(model, mb, temperature=self.temperature)
            out[row : row + lp.shape[0], : lp.shape[1]] = lp.float()
            row += lp.shape[0]
        model.train(was_training)
        return out[:, :t]

    def train_minibatch(
        self, minibatch: dict[str, torch.Tensor], spec: LossSpec, norm: Normaliser, microbatch_size: int
    ) -> dict[str, float]:
        """Runs one optimizer step over a mini-batch with gradient accumulation; returns its statistics.

        The micro-batch losses are partial sums under global denominators (``Normaliser``), so the
        accumulated gradient equals the gradient of the whole mini-batch's loss whatever the
        micro-batch split. Gradients stay on the parameters until the next call (for inspection).
        When ``minibatch["old_logprobs"]`` is absent the update is on-policy and
        old logprobs are the detached current ones (ratio 1, as TRL does for a single iteration).

        Args:
            minibatch: this rank's rows of the mini-batch (``collate`` output with advantages [B, T]).
            spec: objective settings.
            norm: global denominators of the mini-batch.
            microbatch_size: rows per forward/backward.

        Returns:
            loss (sum of micro-batch losses), the ``policy_objective`` statistics (pg_loss_sum, kl_sum, ...,
            tokens), grad_norm (pre-clip global L2 norm), lr. Sums are over this rank's valid tokens.
        """

        def micro_loss(model: torch.nn.Module, mb: dict[str, torch.Tensor]):
            with autocast_context(self.dtype):
                lp, entropy = response_logprobs(
                    model, mb, temperature=self.temperature, with_entropy=spec.entropy_coef > 0
                )
            if "old_logprobs" not in mb:
                mb = {**mb, "old_logprobs": lp.detach()}
            return policy_objective(lp.float(), mb, spec, norm, entropy=entropy)

        return self.optimizer_step(split_microbatches(minibatch, microbatch_size), micro_loss)

    def optimizer_step(self, microbatches: Iterable[dict[str, torch.Tensor]], loss_fn: MicroLoss) -> dict[str, float]:
        """Runs one optimizer step with gradient accumulation over ``microbatches``; returns summed statistics.

        Each micro-batch's loss is backwarded as is (a share under global normalisers), with DDP's gradient
        all-reduce only on the last one. Then the global L2 norm is clipped and AdamW steps (skipped when the
        norm is not finite) and the schedule advances.

        Args:
            microbatches: this rank's micro-batches of the mini-batch.
            loss_fn: ``MicroLoss``; runs the forward (under autocast where it wants) and returns the loss share.

        Returns:
            loss (sum of the micro-batch losses), each statistic summed over micro-batches, grad_norm (pre-clip
            global L2 norm) and lr.
        """
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {"loss": 0.0}
        mbs = list(microbatches)
        for i, mb in enumerate(mbs):
            sync = i == len(mbs) - 1
            ctx = self.model.no_sync() if (not sync and hasattr(self.model, "no_sync")) else contextlib.nullcontext()
            with ctx:
                loss, stats = loss_fn(self.model, mb)
                loss.backward()
            totals["loss"] += float(loss.detach())
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + float(v)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.max_grad_norm)
        totals["grad_norm"] = float(grad_norm)
        if math.isfinite(totals["grad_norm"]):
            self.optimizer.step()
        totals["lr"] = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        return totals

    @torch.no_grad()
    def export_weights(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Returns the policy's Hugging Face state dict cast to ``dtype`` (CPU, contiguous), for weight sync."""
        return {k: v.detach().to("cpu", dtype).contiguous() for k, v in self.module.state_dict().items()}

    def state_dict(self) -> dict:
        """Returns the optimizer and scheduler state (the model is saved separately as safetensors).

        With a critic, "critic" holds its weights, optimizer and scheduler (tensors only: loadable with
        ``torch.load(weights_only=True)``).
        """
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        if self.critic is not None:
            state["critic"] = {"model": self.critic.module.state_dict(), **self.critic.state_dict()}
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restores optimizer and scheduler state (and the critic's, when present) saved by ``state_dict``.

        Raises:
            KeyError: the state has no critic entry but this learner has a critic.
        """
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.critic is not None:
            self.critic.module.load_state_dict(state["critic"]["model"])
            self.critic.load_state_dict(state["critic"])
