"""The offline run (``OfflineRun``): dpo, ipo, kto, orpo, simpo, reward_model and sft on preference pairs.

It runs in the same run loop as online runs (``rlray.run.session.train``; the worker picks the kind by
``cfg.algo.family``), with the same learner, tracking, progress bar, guards and snapshots. Every rank loads
the pairs and walks the same seeded cursor, so no experience crosses ranks: each takes its contiguous
share of the step's pairs. A run, top to bottom:

  0. once: load pairs, split train/eval, tokenize, and cache the reference policy's sequence logprobs
     per pair in the pair table (``Algorithm.reference_logps``: dpo, ipo, kto), computed by the policy before its
     first update
  1. take the step's pairs (the data cursor)
  2. (``Algorithm.kl_reference_point``: kto) the reference point z_ref over the step's mismatched pairs
  3. one optimizer step: micro-batches with gradient accumulation under global counts
  4. log; eval on the held-out pairs (eval/pairwise_accuracy, eval/loss); final snapshot
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from functools import partial

import pyarrow as pa
import torch

from rlray import algos, schema
from rlray.data import PromptStream
from rlray.data.pairs import collate_pairs, load_preference_pairs, pairs_table, split_pairs
from rlray.learner import PolicyLearner, autocast_context
from rlray.learner.batching import MicroBatching
from rlray.learner.collective import Collective
from rlray.learner.preference import PAIR_OBJECTIVES, PairNormaliser, PreferenceSpec, pair_outputs
from rlray.models import load_tokenizer
from rlray.models.heads import load_reward_model
from rlray.observe.tracking import Tracker
from rlray.plan import RunPlan
from rlray.run import build
from rlray.run.context import RunContext, StepResult

log = logging.getLogger(__name__)


@dataclass
class OfflineRun(RunContext):
    """Everything an offline step needs on one rank; built once per worker by ``setup``.

    Every rank holds the pair tables and walks the same cursor (``stream``); ``tracker`` is rank 0's.

    Attributes:
        stream: the data cursor over the training pairs (every rank walks the same one).
        spec: the preference objective's plain values.
        train_pairs / eval_pairs: the tokenized pair tables (reference logprobs cached for dpo, ipo and kto).
        row_of: prompt_id -> row of train_pairs.
        data_metrics: the data counts and the reference pass's time, logged at step 0 of a fresh run.
    """

    stream: PromptStream | None = None
    spec: PreferenceSpec | None = None
    train_pairs: pa.Table | None = None
    eval_pairs: pa.Table | None = None
    row_of: dict[str, int] = field(default_factory=dict)
    data_metrics: dict[str, float] = field(default_factory=dict)

    @property
    def method(self) -> str:
        """Returns the offline method (``cfg.algo.name``)."""
        return self.settings.algo.name

    @property
    def algorithm(self) -> algos.Algorithm:
        """Returns the method's registry entry (``rlray.algos.registry``): its objective and what it needs."""
        return self.settings.algo.algorithm

    def run_step(self, step: int) -> StepResult:
        """Runs 0-based ``step``: 1. take the step's pairs, 2-3. one optimizer step; stage 4 (eval when due, log,
        guard, snapshot, hooks) is the session's step boundary."""
        t = time.perf_counter()
        with self.coll.timed(f"the update of step {step + 1}"):  # every rank alike (watchdog.collective_s)
            metrics = update(self, take_pairs(self))  # 1-3. pairs, (kto) reference point, optimizer step
        metrics["timing/update_s"] = time.perf_counter() - t
        metrics["data/epoch"] = float(self.stream.epoch)
        self.policy_version = step + 1
        return StepResult(metrics)

    def start_metrics(self) -> dict[str, float]:
        """Returns the data counts and the held-out metrics of the initial policy (every rank evaluates)."""
        first = evaluate(self) if self.settings.offline.eval_fraction else {}
        return {**self.data_metrics, **first}

    def evaluate_when_due(self, steps_done: int) -> dict[str, float]:
        """Returns eval/* and timing/eval_s every ``offline.eval_every_steps`` steps and after the last (every rank)."""
        off, every = self.settings.offline, self.settings.offline.eval_every_steps
        if not off.eval_fraction or not ((every and steps_done % every == 0) or steps_done == self.plan.max_steps):
            return {}
        t = time.perf_counter()
        metrics = evaluate(self)
        metrics["timing/eval_s"] = time.perf_counter() - t
        return metrics

    def progress_text(self, steps_done: int, metrics: dict[str, float]) -> str:
        """Returns 'rlray <method> step k/N loss=... acc=...' (margin=... for unpaired KTO rows, which have no accuracy)."""
        text = f"rlray {self.method} step {steps_done}/{self.plan.max_steps} loss={metrics['learner/loss']:.4f}"
        if "algo/pairwise_accuracy" in metrics:
            return f"{text} acc={metrics['algo/pairwise_accuracy']:.2f}"
        return f"{text} margin={metrics['algo/reward_margin']:.3f}"

    def data_epoch(self) -> int:
        """Returns the pair cursor's epoch (every rank walks the same one)."""
        return self.stream.epoch

    def cursor_state(self) -> dict:
        """Returns the pair cursor's state (``PromptStream.state_dict``)."""
        return self.stream.state_dict()

    def load_cursor_state(self, state: dict) -> None:
        """Sets the pair cursor to a snapshot's ``state`` (every rank)."""
        self.stream.load_state_dict(state)


# --------------------------------------------------------------------------------------------
# Setup: pairs, split, reference logprobs
# --------------------------------------------------------------------------------------------
def build_learner(plan: RunPlan, model_dir: str, world: int) -> PolicyLearner:
    """Returns the learner: the policy, or a one-label sequence-classification model for a reward head
    (``Algorithm.reward_head``: reward_model).

    The same keyword arguments as online runs (``rlray.run.build.learner_kwargs``: dtype, optimizer, LoRA,
    DDP/FSDP wrapping), except temperature 1 (no sampling temperature to undo) and no separate
    reference model (the reference is the initial policy: its logprobs are cached before step 1).
    """
    cfg = plan.settings
    kwargs = build.learner_kwargs(cfg, world, with_reference=False)
    kwargs["temperature"] = 1.0
    kwargs["model_loader"] = partial(load_reward_model, key="model.path") if cfg.algo.algorithm.reward_head else None
    return PolicyLearner(model_dir, **kwargs)


@torch.no_grad()
def reference_logps(
    learner: PolicyLearner, table: pa.Table, coll: Collective, pad_token_id: int, microbatch: int, *, with_kl: bool
) -> pa.Table:
    """Returns ``table`` with ref_chosen_logps and ref_rejected_logps (and ref_kl_logps) filled by the current policy.

    Each rank scores a contiguous share (the last one padded by repeating rows) and the shares are
    all-gathered, so every rank holds the whole column. Sequence logprobs are sums over response tokens
    (nats), at temperature 1, under the same autocast as training.
    """
    n = table.num_rows
    per = -(-n // coll.world)
    share = table.take([min(i, n - 1) for i in range(coll.rank * per, (coll.rank + 1) * per)])
    out = torch.zeros(3, per)
    for start in range(0, per, microbatch):
        batch = collate_pairs(share.slice(start, microbatch), pad_token_id, with_kl=with_kl)
        logps = _sequence_logps(learner, batch.inputs, batch.response_mask)
        p = logps.shape[0] // 2
        out[0, start : start + p], out[1, start : start + p] = logps[:p], logps[p:]
        if with_kl:
            out[2, start : start + p] = _sequence_logps(learner, batch.kl_inputs, batch.kl_response_mask)
    gathered = coll.all_gather(out.T.contiguous())[:n]
    names = ("ref_chosen_logps", "ref_rejected_logps", "ref_kl_logps")[: 3 if with_kl else 2]
    for i, name in enumerate(names):
        idx = table.schema.get_field_index(name)
        table = table.set_column(idx, table.schema.field(name), pa.array(gathered[:, i].tolist(), type=pa.float32()))
    return table


def _sequence_logps(learner: PolicyLearner, inputs: schema.ModelInputs, response_mask: torch.Tensor) -> torch.Tensor:
    lp = learner.logprobs(inputs, reference=False, batching=MicroBatching(sequences=10**9))
    return algos.sequence_logps(lp, response_mask)


def setup(plan: RunPlan, coll: Collective, *, model_dir: str, run_id: str | None) -> OfflineRun:
    """Builds the learner, the pair tables (with cached reference logprobs), the cursor and, on rank 0, the tracker.

    Raises:
        rlray.data.DataError: the pairs cannot be loaded (names the file and row).
    """
    cfg = plan.settings
    torch.set_num_threads(cfg.learner.torch_threads or max(1, len(os.sched_getaffinity(0)) // coll.world))
    build.seed_everything(cfg.run.seed + coll.rank)
    tokenizer = load_tokenizer(model_dir, cfg.model.chat_template)
    learner = build_learner(plan, model_dir, coll.world)
    off = cfg.offline
    pairs, skipped = load_preference_pairs(off.pairs_files, method=cfg.algo.name, max_pairs=off.max_pairs)
    train_rows, eval_rows = split_pairs(pairs, eval_fraction=off.eval_fraction, seed=cfg.run.seed)
    sizes = dict(max_prompt_tokens=off.max_prompt_tokens, max_response_tokens=off.max_response_tokens)
    train_tab, eval_tab = pairs_table(train_rows, tokenizer, **sizes), pairs_table(eval_rows, tokenizer, **sizes)
    t = time.perf_counter()
    algorithm = cfg.algo.algorithm
    if algorithm.reference_logps:
        ref = dict(coll=coll, pad_token_id=tokenizer.pad_token_id, microbatch=2 * off.pairs_per_microbatch,
                   with_kl=algorithm.kl_reference_point)  # fmt: skip
        train_tab = reference_logps(learner, train_tab, **ref)
        eval_tab = reference_logps(learner, eval_tab, **ref) if eval_rows else eval_tab
    a = cfg.algo
    spec = PreferenceSpec(
        beta=a.beta,
        dpo_loss=a.dpo_loss,
        label_smoothing=a.label_smoothing,
        kto_desirable_weight=a.kto_desirable_weight,
        kto_undesirable_weight=a.kto_undesirable_weight,
        simpo_gamma=a.simpo_gamma,
        rm_center_coef=a.rm_center_coef,
    )
    data_metrics = {
        "data/train_pairs": float(len(train_rows)),
        "data/eval_pairs": float(len(eval_rows)),
        "data/skipped_pairs": float(skipped),
        "timing/reference_s": time.perf_counter() - t,
    }
    tracker = None
    if coll.rank == 0:
        tracker = Tracker(cfg.tracking.mlflow_uri, cfg.tracking.experiment, run_id=run_id,
                          tensorboard_dir=cfg.tracking.tensorboard_dir)
    return OfflineRun(
        plan, coll, learner, tokenizer, tracker, stream=PromptStream(train_rows, seed=cfg.run.seed, shuffle=cfg.data.shuffle),
        spec=spec, train_pairs=train_tab, eval_pairs=eval_tab, row_of={p.prompt_id: i for i, p in enumerate(train_rows)},
        data_metrics=data_metrics,
    )


# --------------------------------------------------------------------------------------------
# Step
# --------------------------------------------------------------------------------------------
def take_pairs(ctx: OfflineRun) -> pa.Table:
    """Step stage 1: returns the step's pairs (every rank draws the same ones from the same cursor)."""
    rows = ctx.stream.next_batch(ctx.settings.offline.pairs_per_step)
    return ctx.train_pairs.take([ctx.row_of[r.prompt_id] for r in rows])


def kto_reference_point(ctx: OfflineRun, table: pa.Table) -> float:
    """Step stage 2 (``Algorithm.kl_reference_point``: kto): returns z_ref = max(0, mean KL log ratio) over the mismatched rows of ``table``.

    Each rank scores its share; the log ratios are gathered so the mean is the whole batch's, as TRL
    gathers them. Source: Ethayarajh et al. 2024 eq. 7 (``algos.kto_kl_estimate``).
    """
    share = _my_share(ctx, table)
    batch = collate_pairs(share, ctx.tokenizer.pad_token_id, with_kl=True)
    kl_logps = _sequence_logps(ctx.learner, batch.kl_inputs, batch.kl_response_mask)
    ref = torch.tensor(share.column("ref_kl_logps").to_pylist(), dtype=torch.float32)
    return float(algos.kto_kl_estimate(ctx.coll.all_gather(kl_logps), ctx.coll.all_gather(ref)))


def _my_share(ctx: OfflineRun, table: pa.Table) -> pa.Table:
    per = table.num_rows // ctx.coll.world
    return table.slice(ctx.coll.rank * per, per)


def _normaliser(ctx: OfflineRun, table: pa.Table, world: int, kl_estimate: float) -> PairNormaliser:
    chosen_tokens = sum(len(r) for r in table.column("chosen_token_ids").to_pylist())
    examples = 2 * table.num_rows - (table.num_rows - table.column("label").null_count)  # KTO: one per unpaired row
    return PairNormaliser(float(table.num_rows), float(chosen_tokens), world, kl_estimate, float(examples))


def update(ctx: OfflineRun, table: pa.Table) -> dict[str, float]:
    """Step stage 3: one optimizer step over this rank's share of ``table``; returns summed statistics (all ranks)."""
    algorithm = ctx.algorithm
    kl = kto_reference_point(ctx, table) if algorithm.kl_reference_point else 0.0
    norm = _normaliser(ctx, table, ctx.coll.world, kl)
    share, mbs = _my_share(ctx, table), ctx.settings.offline.pairs_per_microbatch
    pad = ctx.tokenizer.pad_token_id
    micro = [collate_pairs(share.slice(s, mbs), pad) for s in range(0, share.num_rows, mbs)]
    objective = PAIR_OBJECTIVES[algorithm.pair_objective]

    def loss_fn(model: torch.nn.Module, mb: schema.PairBatch):
        with autocast_context(ctx.learner.dtype):
            out = pair_outputs(model, mb, scores=algorithm.reward_head)
        return objective(out.float(), mb, ctx.spec, norm)

    stats = ctx.learner.optimizer_step(micro, loss_fn)
    summed = ctx.coll.all_reduce_sum({k: stats[k] for k in _SUM_KEYS})
    metrics = _pair_metrics(summed, "algo")
    # each rank's loss share is scaled by world_size for DDP's gradient average: the step's loss is the mean
    metrics["learner/loss"] = summed["loss"] / ctx.coll.world
    metrics.update({"learner/grad_norm": stats["grad_norm"], "learner/lr": stats["lr"]})
    if algorithm.kl_reference_point:
        metrics["algo/kto_kl"] = kl
    return metrics


_SUM_KEYS = ("loss", "pairs", "correct", "chosen_count", "chosen_reward_sum", "rejected_count", "rejected_reward_sum")


def _pair_metrics(summed: dict[str, float], section: str) -> dict[str, float]:
    """Returns the reward means; the accuracy only when the step has pairs (not for unpaired KTO rows alone).
    The margin is the chosen mean minus the rejected mean (over pairs: the mean pair margin; TRL KTO's
    rewards/margins)."""
    chosen = summed["chosen_reward_sum"] / max(summed["chosen_count"], 1.0)
    rejected = summed["rejected_reward_sum"] / max(summed["rejected_count"], 1.0)
    metrics = {f"{section}/reward_margin": chosen - rejected, f"{section}/chosen_reward": chosen,
               f"{section}/rejected_reward": rejected}  # fmt: skip
    if summed["pairs"]:
        metrics[f"{section}/pairwise_accuracy"] = summed["correct"] / summed["pairs"]
    return metrics


@torch.no_grad()
def evaluate(ctx: OfflineRun) -> dict[str, float]:
    """Returns eval/loss, eval/pairwise_accuracy and the eval reward means on the held-out pairs (all ranks).

    eval/pairwise_accuracy is the fraction of held-out pairs whose chosen response gets the higher
    (implicit) reward: the reward head's score for reward_model, see ``rlray.learner.preference``.
    """
    table = ctx.eval_pairs
    if table.num_rows < ctx.coll.world:
        return {}
    table = table.slice(0, table.num_rows - table.num_rows % ctx.coll.world)
    algorithm = ctx.algorithm
    kl = kto_reference_point(ctx, table) if algorithm.kl_reference_point else 0.0
    norm = _normaliser(ctx, table, 1, kl)
    model = ctx.learner.module
    was_training = model.training
    model.eval()
    totals = {k: 0.0 for k in _SUM_KEYS}
    share, mbs = _my_share(ctx, table), ctx.settings.offline.pairs_per_microbatch
    for start in range(0, share.num_rows, mbs):
        mb = collate_pairs(share.slice(start, mbs), ctx.tokenizer.pad_token_id)
        with autocast_context(ctx.learner.dtype):
            out = pair_outputs(model, mb, scores=algorithm.reward_head)
        loss, stats = PAIR_OBJECTIVES[algorithm.pair_objective](out.float(), mb, ctx.spec, norm)
        totals["loss"] += float(loss)
        for k in _SUM_KEYS[1:]:
            totals[k] += float(stats[k])
    model.train(was_training)
    summed = ctx.coll.all_reduce_sum(totals)
    return {"eval/loss": summed["loss"], **_pair_metrics(summed, "eval")}
