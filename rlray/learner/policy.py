"""The policy learner: forward/backward, logprobs, the optimizer and weight export.

The learner holds the trained model (with its LoRA adapters, ``rlray.learner.lora``), its optimizer (``OptimizerSpec``)
and a parallelism strategy (``rlray.learner.parallel``: wrapping, frozen placement, micro-batching constraint, state
and export); the reference and the teacher are ``rlray.learner.reference.FrozenScorer``s placed by that strategy.
A plain class; ``rlray.run.online`` runs it inside each Ray Train worker. Legend: B sequences, T response
tokens, Pm longest prompt.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from rlray.learner.batching import MicroBatching, microbatches
from rlray.learner.lora import apply_lora, lora_adapter_weights
from rlray.learner.objective import LossSpec, Normaliser, policy_objective, reduce_stat
from rlray.learner.packing import TokenCounts
from rlray.learner.parallel import Parallelism, Single
from rlray.learner.reference import FrozenScorer
from rlray.learner.scoring import batched_logprobs, packs, response_scores
from rlray.models import load_causal_lm
from rlray.models.adapters import AdapterWeights, load_adapter
from rlray.schema import ModelInputs, StepBatch


@dataclass(frozen=True)
class OptimizerSpec:
    """The trained model's optimizer and schedule.

    Attributes:
        lr, betas, weight_decay: AdamW (Loshchilov & Hutter 2019) settings.
        max_grad_norm: global L2 gradient clip.
        warmup_steps: linear warm-up length in optimizer steps, then constant.
        name: "adamw" (torch) or "adamw_8bit" (bitsandbytes AdamW8bit; CUDA only): ``make_optimizer``.
    """

    lr: float
    max_grad_norm: float
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    warmup_steps: int = 0
    name: str = "adamw"


MicroLoss = Callable[[torch.nn.Module, Any], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""fn(model, micro-batch) -> (loss share to backward, {stat name: 0-dim tensor summed over the micro-batch}); the
micro-batch is a record with ``to(device)`` (``schema.StepBatch`` online, ``rlray.data.pairs.PairBatch`` offline)."""


class PolicyLearner:
    """Holds the trained model (float32 master weights), its optimizer and schedule, and the parallelism strategy;
    the frozen reference and teacher it scores with are ``FrozenScorer``s placed by the same strategy.

    The model is the policy (a causal LM) by default; ``model_loader`` builds another one-model learner on
    the same machinery (PPO's critic, the reward model of ``algo.name=reward_model``).

    Args:
        model_path: local Hugging Face folder (see ``rlray.models.resolve_model_path``).
        dtype: "bfloat16" runs forward/backward under bf16 autocast; "float32" runs in float32.
        temperature: rollout sampling temperature; logits are divided by it (see ``response_logprobs``).
        optim: the optimizer, its schedule and the gradient clip (``OptimizerSpec``).
        parallel: the parallelism strategy (``rlray.learner.parallel``: ``Single``, ``DDP``, ``FSDP2``, which shards
            the reference and the teacher too); None is ``Single()`` (the model stays where it loads).
        use_reference: keep a frozen copy of the initial policy for KL (under bf16 its linear weights are stored in
            bf16, which gives the same outputs: ``store_frozen_for_autocast``; under FSDP2 a sharded copy). With
            LoRA no copy is kept: the reference is the base model with the adapters off.
        gradient_checkpointing: recompute activations in backward.
        lora: peft LoRA settings {"rank", "alpha", "dropout", "target_modules"}; None or rank 0 trains
            every weight. Only the adapters train; ``export_weights`` returns merged weights, ``export_adapter`` the
            adapter alone.
        adapter_path: a peft LoRA adapter folder to continue (``rlray.models.adapters.load_adapter``: loaded
            trainable, with its own settings; exclusive with ``lora``), or None.
        model_loader: builds the float32 model from ``model_path``; None loads a causal LM.
        critic: PPO's critic (a learner over ``rlray.models.load_value_model``); its weights and optimizer
            state travel in this learner's ``state_dict``.
        teacher_path: local Hugging Face folder of a distillation teacher (``teacher.path`` resolved) to hold frozen
            on this learner (``resources.teacher.placement == "learner"``), or None. It gives teacher logprobs
            (``teacher_logprobs``) and, for the JSD loss, full logits inside each micro-batch.
        reference_elsewhere: the run's reference is a reference actor's frozen copy of ``model_path``
            (``resources.reference.placement == "actor"``; no copy here): ``at_reference`` holds for it too, so a run's
            first step takes its reference logprobs from the policy instead of the actor.

    Raises:
        rlray.models.ModelError: the folder cannot be loaded, or the adapter does not fit it.
        ValueError: both ``lora`` (rank > 0) and ``adapter_path`` are given.
        ImportError: optimizer "adamw_8bit" without bitsandbytes.
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str,
        temperature: float,
        optim: OptimizerSpec,
        parallel: Parallelism | None = None,
        use_reference: bool = False,
        gradient_checkpointing: bool = False,
        lora: dict | None = None,
        adapter_path: str | None = None,
        model_loader: Callable[[str], torch.nn.Module] | None = None,
        critic: PolicyLearner | None = None,
        teacher_path: str | None = None,
        reference_elsewhere: bool = False,
    ) -> None:
        self.dtype = dtype
        self.temperature = temperature
        self.max_grad_norm = optim.max_grad_norm
        self.parallel = parallel or Single()
        self.critic = critic
        self.tokens = TokenCounts()  # what the forward passes computed, until take_tokens
        policy = model_loader(model_path) if model_loader else load_causal_lm(model_path, dtype=torch.float32)
        policy.config.use_cache = False
        if gradient_checkpointing:
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.use_reference = use_reference
        if adapter_path is not None and lora and lora["rank"]:
            raise ValueError("pass lora or adapter_path, not both: the adapter brings its own LoRA settings")
        self.lora = bool(lora and lora["rank"]) or adapter_path is not None
        reference = None
        if use_reference and not self.lora:
            reference = copy.deepcopy(policy).eval().requires_grad_(False)
        if adapter_path is not None:
            policy = load_adapter(policy, adapter_path, model_path)
        elif self.lora:
            policy = apply_lora(policy, **lora)
        self.module = policy  # unwrapped (DDP) or the sharded model itself (FSDP2), for export and checkpoints
        self.model = self.parallel.wrap(policy)
        self.model.train()
        teacher = None
        if teacher_path is not None:
            teacher = load_causal_lm(teacher_path, dtype=torch.float32).requires_grad_(False)
            teacher.config.use_cache = False
        self.reference = self._frozen(reference)
        self.teacher = self._frozen(teacher)
        # the policy's weights are still the reference's (at_reference): its frozen copy here, or a reference actor's
        self._at_reference = not self.lora and (reference is not None or reference_elsewhere)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(optim.name, params, lr=optim.lr, betas=optim.betas,
                                        weight_decay=optim.weight_decay)
        warmup = optim.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0
        )

    def _frozen(self, model: torch.nn.Module | None) -> FrozenScorer | None:
        """Returns a frozen model (reference, teacher) as a ``FrozenScorer`` placed by the strategy: sharded like the
        policy (FSDP2), or whole on the policy's device (the wrap moved it to its GPU) with bf16 linear weights under
        bf16 autocast; None for None."""
        if model is None:
            return None
        device = next(self.module.parameters()).device
        return FrozenScorer(model, dtype=self.dtype, temperature=self.temperature, parallel=self.parallel, device=device)

    @property
    def sharded(self) -> bool:
        """Returns True when the strategy shards the model's state over the ranks (FSDP2: collectives to save it)."""
        return self.parallel.sharded

    @property
    def has_reference(self) -> bool:
        """Returns True when this learner can compute reference logprobs (a frozen copy, or LoRA's base)."""
        return self.reference is not None or (self.lora and self.use_reference)

    @property
    def at_reference(self) -> bool:
        """Returns True while the policy's weights are still its frozen reference copy's: a full-weight learner with a
        reference (not LoRA; its own copy, or a reference actor's of the same folder: ``reference_elsewhere``) that has
        taken no optimizer step and loaded no snapshot since it was built.

        While it holds, reference logprobs equal the policy's own (the reference is the initial policy, scored under
        the same code, autocast and temperature: ``FrozenScorer``), so a run's first step takes them from the policy's
        forward instead of a reference pass (``rlray.learner.online.reference_and_old``, ``train_minibatch``).
        """
        return self._at_reference

    def take_tokens(self) -> TokenCounts:
        """Returns the tokens this learner's forward passes computed since the last call (and starts counting anew)."""
        tokens, self.tokens = self.tokens, TokenCounts()
        return tokens

    def micro_batching(self, batching: MicroBatching) -> MicroBatching:
        """Returns ``batching`` as this learner runs it: the strategy's constraint (``Parallelism.micro_batching``: an
        FSDP-sharded model cuts by sequences, not tokens)."""
        return self.parallel.micro_batching(batching)

    def logprobs(self, inputs: ModelInputs, *, reference: bool, batching: MicroBatching) -> torch.Tensor:
        """Returns [B, T] float32 logprobs of the rows' responses (``inputs``) under the policy or the reference.

        Runs without grad micro-batch by micro-batch (``batching``: rows or tokens per micro-batch, padded or
        packed), under the same autocast as the update so that the reference and the initial policy give
        identical values. With LoRA the reference is the base model with the adapters switched off (no copy is
        kept). The tokens computed add to ``take_tokens``'.

        Raises:
            ValueError: ``reference=True`` on a learner built without a reference model, or packing "on" for a
                model that cannot pack.
        """
        if reference and not self.has_reference:
            raise ValueError("this learner has no reference model (algo.kl_coef == 0)")
        batching = self.micro_batching(batching)
        if reference and not self.lora:
            return self.reference.logprobs(inputs, batching, tokens=self.tokens, temperature=self.temperature)
        args = dict(dtype=self.dtype, temperature=self.temperature, batching=batching, tokens=self.tokens)
        if reference:
            with self.module.disable_adapter():
                return batched_logprobs(self.module, inputs, **args)
        return batched_logprobs(self.module, inputs, **args)

    def teacher_logprobs(self, inputs: ModelInputs, *, batching: MicroBatching) -> torch.Tensor:
        """Returns [B, T] float32 logprobs of the rows' responses (``inputs``) under the teacher (``batched_logprobs``, the
        same autocast and temperature as the policy's, so a teacher equal to the policy gives the same values).

        Raises:
            ValueError: this learner holds no teacher (``resources.teacher.placement`` is actor, or no teacher.path).
        """
        if self.teacher is None:
            raise ValueError("this learner holds no teacher (teacher.path unset, or resources.teacher.placement=actor)")
        return self.teacher.logprobs(inputs, self.micro_batching(batching), tokens=self.tokens,
                                    temperature=self.temperature)

    def train_minibatch(
        self, minibatch: StepBatch, spec: LossSpec, norm: Normaliser, batching: MicroBatching
    ) -> dict[str, float]:
        """Runs one optimizer step over a mini-batch with gradient accumulation; returns its statistics.

        The micro-batch losses are partial sums under global denominators (``Normaliser``), so the
        accumulated gradient equals the gradient of the whole mini-batch's loss whatever the
        micro-batch split. Gradients stay on the parameters until the next call (for inspection).
        When ``minibatch.old_logprobs`` is None the update is on-policy and
        old logprobs are the detached current ones (ratio 1, as TRL does for a single iteration).
        With ``spec.jsd_weight > 0`` the teacher's full logits are computed in each micro-batch (no grad) next to the
        student's, and the per-token generalized JSD enters the objective (``policy_objective``'s ``jsd``).

        Args:
            minibatch: this rank's rows of the mini-batch (a ``StepBatch`` with advantages [B, T]).
            spec: objective settings.
            norm: global denominators of the mini-batch.
            batching: micro-batches (rows or a token budget) and layout (padded or packed, prefixes shared).

        Returns:
            loss (sum of micro-batch losses), the ``policy_objective`` statistics (pg_loss_sum, kl_sum, ...,
            tokens), grad_norm (pre-clip global L2 norm), lr. Sums are over this rank's valid tokens.
        """

        if spec.jsd_weight > 0 and self.teacher is None:
            raise ValueError("a JSD distillation loss (jsd_weight > 0) needs a teacher on this learner (teacher_path)")
        batching = self.micro_batching(batching)
        teacher = self.teacher.module if self.teacher is not None else None
        packed = packs(self.model, batching.packing) and (teacher is None or packs(teacher, batching.packing))
        at_reference = self.at_reference  # read before this optimizer step moves the weights

        def micro_loss(model: torch.nn.Module, mb: StepBatch):
            # the teacher's logits (JSD) live only inside this micro-batch, at the student's positions
            got = response_scores(model, mb.inputs, dtype=self.dtype, temperature=self.temperature, packed=packed,
                                  share_prefixes=batching.share_prefixes, with_entropy=spec.entropy_coef > 0,
                                  teacher=teacher if spec.jsd_weight > 0 else None, jsd_beta=spec.jsd_beta,
                                  inplace_backward=True, exact_new_tokens=batching.exact_new_tokens)
            self.tokens.add(got.tokens)
            if mb.old_logprobs is None:
                mb = dataclasses.replace(mb, old_logprobs=got.logprobs.detach())
            if mb.ref_logprobs is None and at_reference:  # the policy is still the reference: its logprobs are
                mb = dataclasses.replace(mb, ref_logprobs=got.logprobs.detach())  # the reference's
            return policy_objective(got.logprobs.float(), mb, spec, norm, entropy=got.entropy, jsd=got.jsd)

        return self.optimizer_step([mb for _, mb in microbatches(minibatch, batching, packed=packed)], micro_loss)

    def optimizer_step(self, microbatches: Iterable[Any], loss_fn: MicroLoss) -> dict[str, float]:
        """Runs one optimizer step with gradient accumulation over ``microbatches``; returns summed statistics.

        Each micro-batch's loss is backwarded as is (a share under global normalisers), with DDP's gradient
        all-reduce only on the last one (FSDP2 reduce-scatters after each: ``rlray.learner.sharding``; a rank with
        fewer micro-batches than another repeats its last one with the loss times 0, since every forward gathers
        over the ranks). Then the global L2 norm is clipped (over the sharded gradients under FSDP2) and AdamW
        steps (skipped when the norm is not finite) and the schedule advances.

        Args:
            microbatches: this rank's micro-batches of the mini-batch (records with ``to(device)``).
            loss_fn: ``MicroLoss``; runs the forward (under autocast where it wants) and returns the loss share.

        Returns:
            loss (sum of the micro-batch losses), each statistic summed over micro-batches (the max for
            ``objective.MAX_STAT_KEYS``), grad_norm (pre-clip global L2 norm) and lr.
        """
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {"loss": 0.0}
        device = next(self.module.parameters()).device  # CUDA after Ray Train's prepare_model on GPU
        mbs = [mb.to(device) for mb in microbatches]
        real = len(mbs)
        mbs = self.parallel.even_microbatches(mbs, device)
        for i, mb in enumerate(mbs):
            with self.parallel.accumulating(self.model, last=i == len(mbs) - 1):
                loss, stats = loss_fn(self.model, mb)
                if i >= real:  # a repeat that keeps this rank in step with the others' gathers: no gradient, no stats
                    (loss * 0.0).backward()
                    continue
                loss.backward()
            totals["loss"] += float(loss.detach())
            for k, v in stats.items():
                totals[k] = reduce_stat(k, totals.get(k), float(v))
        grad_norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.max_grad_norm)
        totals["grad_norm"] = float(self.parallel.whole(grad_norm))
        if math.isfinite(totals["grad_norm"]):
            self.optimizer.step()
            self._at_reference = False
        totals["lr"] = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        return totals

    @torch.no_grad()
    def export_weights(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """Returns the policy's Hugging Face state dict cast to ``dtype`` on ``device`` (contiguous), for weight sync.

        With LoRA the adapters are merged into a copy (W + scale * B A; the policy is untouched), under
        the base model's names. With FSDP2 this is a collective: every rank must call it, and only rank 0 gets
        the tensors (the others get an empty dict); they are gathered one at a time and cast at once, so rank 0
        never holds the model twice (``sharding.gathered_state_dict``).
        """
        return self.parallel.export_weights(self.module, lora=self.lora, dtype=dtype, device=device)

    @torch.no_grad()
    def checkpoint_weights(self) -> dict[str, torch.Tensor]:
        """Returns what ``save_pretrained`` writes as the policy's weights, whole and in float32: every tensor, or the
        adapters only with LoRA (peft's names before it strips the adapter name). A collective under FSDP2 (rank 0
        gets them, the others {}); unsharded, the module's own tensors (no copy)."""
        return self.parallel.checkpoint_weights(self.module, lora=self.lora)

    @torch.no_grad()
    def export_adapter(self, dtype: torch.dtype) -> AdapterWeights:
        """Returns the policy's LoRA adapter alone, for an adapter-only weight sync (the base weights never change).

        The tensors are peft's ``get_peft_model_state_dict`` (the names and values ``save_pretrained`` writes to
        adapter_model.safetensors: lora_A [r, in_features] and lora_B [out_features, r] per adapted module) cast to
        ``dtype`` on the CPU, contiguous; the config is ``adapter_config.json``'s content as JSON values
        (``inference_mode`` true, sets as sorted lists). Under DDP every rank holds the same adapter, so rank 0 alone calls it.

        Raises:
            ValueError: the learner trains every weight (no ``lora`` and no ``adapter_path``), or is sharded (FSDP).
        """
        if not self.lora or self.sharded:
            raise ValueError("export_adapter needs a LoRA policy (model.lora.rank > 0 or model.adapter_path) on an "
                             "unsharded learner; use export_weights (rollout.lora_sync=merged)")
        return lora_adapter_weights(self.module, dtype)

    def state_dict(self) -> dict:
        """Returns the optimizer and scheduler state (the model is saved separately as safetensors).

        With a critic, "critic" holds its weights, optimizer and scheduler (tensors only: loadable with
        ``torch.load(weights_only=True)``). Sharded (FSDP2), the schedulers' state only: the optimizer's shards and
        the critic's weights are in ``sharded_state_dict``.
        """
        state = {"scheduler": self.scheduler.state_dict()}
        optimizer = self.parallel.optimizer_state(self.optimizer)
        if optimizer is not None:
            state["optimizer"] = optimizer
        if self.critic is not None:
            model = {} if self.critic.sharded else {"model": self.critic.module.state_dict()}
            state["critic"] = {**model, **self.critic.state_dict()}
        return state

    def sharded_state_dict(self) -> dict:
        """Returns this rank's optimizer state keyed by parameter name, and the critic's weights and optimizer, for
        ``torch.distributed.checkpoint`` (``get_optimizer_state_dict``: DTensor shards under FSDP2, whole tensors
        otherwise). A collective under FSDP2. An optimizer that has not stepped yet gets zero state first (torch
        steps it at lr 0: the weights do not move), so that a fresh learner's dict is the template to load into.
        """
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state = {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
        if self.critic is not None:
            state["critic"] = {"model": get_model_state_dict(self.critic.model), **self.critic.sharded_state_dict()}
        return state

    def load_sharded_state_dict(self, state: dict) -> None:
        """Restores the optimizer state (and the critic's weights and optimizer) of ``sharded_state_dict``'s layout,
        shards or whole tensors, into this learner however it is sharded. A collective under FSDP2."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        self._at_reference = False
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        if self.critic is not None:
            set_model_state_dict(self.critic.model, state["critic"]["model"])
            self.critic.load_sharded_state_dict(state["critic"])

    def load_state_dict(self, state: dict) -> None:
        """Restores the scheduler state, and the optimizer's (and the critic's) when present, saved by ``state_dict``.

        A whole optimizer state (an unsharded learner's snapshot) loads into a sharded learner too: its parameter
        numbers are the trainable parameters in order, under their names (``set_optimizer_state_dict``).

        Raises:
            KeyError: the state has no critic entry but this learner has a critic.
        """
        self._at_reference = False  # restore_learner loads a snapshot's weights with this state
        if "optimizer" in state:  # absent from a sharded learner's state: it is in sharded_state_dict
            self.parallel.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.critic is not None:
            if "model" in state["critic"]:
                with self.critic.parallel.whole_into_shards():
                    self.critic.module.load_state_dict(state["critic"]["model"])
            self.critic.load_state_dict(state["critic"])


def make_optimizer(
    name: str, params: list[torch.nn.Parameter], *, lr: float, betas: tuple[float, float], weight_decay: float
) -> torch.optim.Optimizer:
    """Returns AdamW over ``params``: torch's ("adamw") or bitsandbytes' 8-bit one ("adamw_8bit", CUDA only).

    Raises:
        ImportError: "adamw_8bit" without the bitsandbytes package.
        ValueError: an unknown name.
    """
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    if name == "adamw_8bit":
        try:
            import bitsandbytes as bnb
        except ImportError as err:
            raise ImportError(
                "learner.optimizer=adamw_8bit needs bitsandbytes on a CUDA machine (pip install rlray[vllm]); "
                "or set learner.optimizer=adamw"
            ) from err
        return bnb.optim.AdamW8bit(params, lr=lr, betas=betas, weight_decay=weight_decay)
    raise ValueError(f"learner.optimizer={name!r}: use 'adamw' or 'adamw_8bit'")
