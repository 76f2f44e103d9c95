"""The metric registry: every metric key rlray logs, with its section, unit and meaning, and who shows which.

One registry, read by every consumer so that none keeps a list of its own:

- ``METRICS``: the fixed keys, step metrics then evaluation metrics (``METRIC_KEYS``, ``EVAL_KEYS``), each a
  ``Metric`` with its unit and a one-line meaning. The section is the key's first part (``reward/``, ``algo/``, ...).
- ``FAMILIES``: keys made from a name only known at run time, by prefix: one per episode stop reason, per number an
  environment reports, per pass@k.
- ``TERM_FAMILIES``: the keys of each reward term (``reward.functions[].name``, ``reward.judges[].name``): its mean and
  skipped count, per step
  and at evaluation (``term_keys``). ``TERMS`` holds the terms rlray itself adds (DAPO's ``overlong``).
- ``RENAMED_KEYS``: keys of earlier releases and what replaced them.
- ``CHARTS``: what the live page plots, grouped into charts (title, unit, keys). The monitor serves them as data
  (``GET /api/charts``, ``charts_document``) and the page's script draws whatever charts it is given.
- ``STEP_GAUGES``: the monitor's Prometheus gauges that show a step metric (``rlray.observe.monitor``).
- ``PROGRESS_FIELDS``: the figures of the driver's progress line (``rlray.launch.console``).
- ``sanitize_key`` and ``KeySanitizer``: a key as MLflow takes it (``rlray.observe.tracking`` logs through them).

Every key a chart, a gauge or a progress field names must be registered here with a unit and a meaning;
``check_names`` enforces it when this module is imported. Importing this module imports nothing else of rlray, and
no mlflow.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    """One metric key and what it holds.

    Attributes:
        key: ``section/name``, e.g. ``reward/mean``.
        unit: the unit of its value (``tokens``, ``s``, ``nats/token``, ``fraction`` for a share in [0, 1],
            ``count``, ``1`` for a dimensionless number).
        meaning: one line saying what is measured, over what, and when it is logged.
    """

    key: str
    unit: str
    meaning: str

    @property
    def section(self) -> str:
        """Returns the key's section, e.g. ``reward`` for ``reward/mean``."""
        return self.key.split("/", 1)[0]


@dataclass(frozen=True)
class Family:
    """Keys that share a pattern with one ``{placeholder}``, e.g. ``env/stop_reason/{reason}``.

    Attributes:
        pattern: the key with its run-time part in braces.
        unit: the unit of every key of the family.
        meaning: one line, as for ``Metric``.
    """

    pattern: str
    unit: str
    meaning: str

    @property
    def prefix(self) -> str:
        """Returns what every key of the family starts with (the pattern before its placeholder)."""
        return self.pattern.split("{", 1)[0]

    def key(self, name: str) -> str:
        """Returns the family's key for ``name``, e.g. ``env/stop_reason/max_turns``."""
        return self.prefix + name + self.pattern.split("}", 1)[1]


@dataclass(frozen=True)
class Chart:
    """One chart of the live page.

    Attributes:
        title: the chart's heading.
        unit: the unit of its y axis.
        keys: the registered keys it plots, in legend order (a key the run does not log is left out).
        reward_terms: also plot each reward term's mean (``reward/<term>``), after ``keys``, by name.
        guard_line: draw the KL guard's threshold (``guard.kl_threshold``) as a dashed line.
    """

    title: str
    unit: str
    keys: tuple[str, ...]
    reward_terms: bool = False
    guard_line: bool = False


@dataclass(frozen=True)
class StepGauge:
    """A Prometheus gauge of the monitor that shows a step metric's last value.

    Attributes:
        name: the gauge (``rlray_*`` on /metrics, ``ray_rlray_*`` in Ray's metrics).
        key: the step metric it shows.
        help: the gauge's help text.
    """

    name: str
    key: str
    help: str


@dataclass(frozen=True)
class ProgressField:
    """One figure of the driver's progress line, e.g. ``reward=0.412``.

    Attributes:
        key: the step metric shown.
        label: its name on the line.
        fmt: ``str.format`` pattern of its value.
    """

    key: str
    label: str
    fmt: str


# Stages of a step, each timed as timing/<stage>_s: the online step's (offline runs time update, eval, step and
# snapshot), then rank 0's algorithm extras (DAPO/ReMax sampling) and the offline reference logprobs (once).
STAGES: dict[str, str] = {
    "rollout": "take prompts and generate (or run the episodes)",
    "reward": "score the samples",
    "logprobs": "reference, teacher and old logprobs",
    "advantages": "advantages (and the teacher's reverse KL)",
    "update": "the learner's optimizer steps",
    "weight_sync": "push the policy to the rollout actors",
    "eval": "evaluation, on the steps that evaluate",
    "step": "the whole step",
    "snapshot": "write a snapshot, on the steps that write one",
}
ALGO_STAGES: dict[str, str] = {
    "algo_sampling": "DAPO refill and overlong shaping, ReMax's greedy baseline (rank 0)",
    "reference": "offline reference logprobs of every pair (once, at step 1)",
}


def _timing(stages: dict[str, str]) -> tuple[Metric, ...]:
    """Returns the timing/<stage>_s keys of ``stages`` (stage -> what it does)."""
    return tuple(Metric(f"timing/{s}_s", "s", f"wall time of {what}") for s, what in stages.items())


_STEP_METRICS: tuple[Metric, ...] = (
    Metric("reward/mean", "reward", "mean reward (weighted sum of the terms) of the step's samples that have one"),
    Metric("reward/std", "reward", "standard deviation of the step's rewards (samples that have one)"),
    Metric("reward/failed", "count", "samples without a reward (a function raised, timed out or gave NaN); not trained on"),
    Metric("algo/kl", "nats/token", "token mean of the KL estimate to the reference (algo.kl_estimator), first epoch"),
    Metric("algo/advantage_abs_mean", "advantage", "token mean of |advantage| over the response tokens"),
    Metric("algo/clip_fraction", "fraction", "response tokens whose probability ratio was clipped, first epoch"),
    Metric("algo/groups_without_signal", "fraction", "prompt groups with under 2 trained samples or all rewards equal"),
    Metric("learner/pg_loss", "loss", "token mean of the policy-gradient loss, first epoch"),
    Metric("learner/loss", "loss", "the optimized loss, mean over the step's optimizer steps"),
    Metric("learner/grad_norm", "L2 norm", "policy gradient norm before clipping, mean over the optimizer steps"),
    Metric("learner/lr", "1", "learning rate, mean over the step's optimizer steps"),
    Metric("rollout/response_tokens_mean", "tokens", "mean response length of the step's samples"),
    Metric("rollout/truncated_rate", "fraction", "samples that hit rollout.max_new_tokens (finish_reason length)"),
    Metric("rollout/logprob_abs_diff", "nats", "token mean of |engine logprob - learner old logprob|"),
    Metric("algo/rollout_kl", "nats/token", "token mean of the k3 KL(pi_rollout || pi_old): engine/learner mismatch"),
    Metric("algo/rollout_ratio_max", "1", "largest token probability ratio pi_old / pi_rollout of the step"),
    Metric("rollout/policy_version", "version", "oldest policy version that generated the step's samples"),
    Metric("rollout/staleness_mean", "versions", "mean of the learner's version minus each sample's version"),
    Metric("rollout/staleness_max", "versions", "largest learner version minus sample version of the step"),
    Metric("rollout/partial_samples_frac", "fraction", "samples whose tokens come from more than one policy version "
           "(a generation that took a weight update: rollout.partial); 0 without partial rollouts"),
    Metric("rollout/token_staleness_mean", "versions", "token mean of the learner's version minus each sampled "
           "response token's version (response_mask; rollout.partial: a sample's later tokens can be newer than its first)"),
    Metric("rollout/token_staleness_max", "versions", "largest learner version minus sampled response token version of the step"),
    Metric("reward/version", "version", "version of the reward service that scored the step"),
    Metric("rollout/generated_tokens", "tokens", "response tokens generated in the step"),
    Metric("data/epoch", "epochs", "epoch of the training data cursor"),
    Metric("data/skipped_long_prompts", "count", "training prompts left out for exceeding data.max_prompt_tokens"),
    Metric("perf/tokens_per_s", "tokens/s", "generated tokens per second of the step's wall time"),
    Metric("perf/generated_tokens_per_s", "tokens/s", "generated tokens per second of the rollout stage"),
    Metric("perf/learner_tokens_real", "tokens", "real tokens the learner's forwards computed in the step (stages 4 "
           "and 6 on the learner, critic included; every rank)"),
    Metric("perf/learner_tokens_padding", "tokens", "padding positions the learner's forwards computed in the step "
           "(0 with learner.sequence_packing)"),
    Metric("perf/learner_tokens_shared", "tokens", "tokens of the step's rows the learner did not compute because a "
           "shared prefix was computed once (learner.share_prefixes)"),
    *_timing(STAGES),
    # online algorithm options (logged when the option is on)
    Metric("algo/entropy", "nats/token", "token mean of the policy's entropy (algo.entropy_coef > 0), first epoch"),
    Metric("algo/dual_clip_fraction", "fraction", "response tokens bounded by the dual clip (algo.dual_clip)"),
    Metric("algo/rollout_is_weight_mean", "1", "token mean of the rollout-correction weight (algo.rollout_correction)"),
    Metric("algo/rollout_corrected_token_fraction", "fraction", "response tokens the rollout correction changed"),
    Metric("algo/rollout_corrected_sequence_fraction", "fraction", "sequences the rollout correction changed"),
    Metric("algo/distill_reverse_kl", "nats/token", "token mean of log pi_old - log pi_teacher (teacher.divergence=reverse_kl)"),
    Metric("algo/distill_jsd", "nats/token", "token mean of the generalized JSD to the teacher (teacher.divergence=jsd)"),
    Metric("algo/dynamic_sampling_rounds", "count", "DAPO rollout rounds it took to fill the step's groups"),
    Metric("reward/baseline_mean", "reward", "mean reward of ReMax's greedy baseline completions"),
    Metric("reward/overlong_penalty_mean", "reward", "mean DAPO overlong penalty (<= 0) over the step's samples"),
    Metric("rollout/truncated_masked", "count", "truncated samples left out of the loss (algo.mask_truncated)"),
    Metric("reward/model_score", "reward", "mean raw score of the reward model term"),
    # judges (reward.judges; all judges together, every call since the previous step's metrics, evaluation's too)
    Metric("reward/judge_requests", "count", "judgements asked of the judges (samples; groups in group mode), cached ones included"),
    Metric("reward/judge_cache_hits", "count", "judgements answered from the run's judge cache (or asked twice in one batch)"),
    Metric("reward/judge_calls", "count", "requests sent to judge replicas (one chunk of judgements each, retries included)"),
    Metric("reward/judge_retries", "count", "judge requests sent again after a time-out or an error"),
    Metric("reward/judge_latency_s", "s", "mean wall time of a judge request (a chunk), when one was sent"),
    Metric("reward/judge_parse_failures", "count", "samples whose judge output did not parse: failed rewards, not trained on"),
    Metric("reward/judge_errors", "count", "samples a judge failed otherwise (no answer after its tries, prompt too long)"),
    Metric("reward/judge_prompt_tokens", "tokens", "tokens the judges read (judge prompts sent, not cached)"),
    Metric("reward/judge_output_tokens", "tokens", "tokens the judges wrote"),
    Metric("reward/judge_version", "version", "lowest judge version that answered (reward.version at its deployment)"),
    # PPO's critic
    Metric("learner/value_loss", "loss", "token mean of the critic's value loss, first epoch"),
    Metric("learner/critic_grad_norm", "L2 norm", "critic gradient norm before clipping, mean over the optimizer steps"),
    Metric("algo/value_clip_fraction", "fraction", "response tokens whose value prediction was clipped"),
    # offline methods: (implicit) rewards of chosen and rejected responses
    Metric("algo/pairwise_accuracy", "fraction", "pairs whose chosen response gets the higher (implicit) reward "
           "(not logged for unpaired KTO rows alone)"),
    Metric("algo/reward_margin", "reward", "mean chosen minus mean rejected (implicit) reward of the step"),
    Metric("algo/chosen_reward", "reward", "mean (implicit) reward of the chosen responses (KTO: desirable examples)"),
    Metric("algo/rejected_reward", "reward", "mean (implicit) reward of the rejected responses (KTO: undesirable examples)"),
    Metric("algo/kto_kl", "nats", "KTO's reference point: clamped mean policy-reference logprob gap of mismatched pairs"),
    Metric("data/train_pairs", "count", "preference pairs trained on (logged at start)"),
    Metric("data/eval_pairs", "count", "preference pairs held out for evaluation (logged at start)"),
    Metric("data/skipped_pairs", "count", "preference rows that cannot form a pair, left out (logged at start)"),
    *_timing(ALGO_STAGES),
    # operations (guards, rollback, restore, snapshots, heartbeat)
    Metric("guard/nonfinite_in_row", "count", "steps in a row with a non-finite loss or gradient norm"),
    Metric("run/rollbacks", "count", "rollbacks to an earlier snapshot so far"),
    Metric("run/restored_step", "step", "the step a (re)start restored from its snapshot"),
    Metric("run/hangs", "count", "remote calls reported past their watchdog.* deadline so far (rank 0's, and every "
                                 "rank's reference and teacher calls; rlray.hangs)"),
    Metric("run/hang_restarts", "count", "actors restarted for a hang so far (watchdog.on_hang=restart)"),
    Metric("checkpoint/failures", "count", "a snapshot that failed to write (1 at its step)"),
    Metric("monitor/heartbeat_s", "s", "seconds since this learner start, at each heartbeat"),
    Metric("monitor/rss_gib", "GiB", "resident memory of learner rank 0, at each heartbeat"),
    Metric("monitor/mlflow_outages", "count", "MLflow store outages that began since the previous step was logged"),
    Metric("rollout/actor_failures", "count", "rollout actor failures the fleet saw since the previous step (rank 0)"),
    Metric("rollout/rerun_prompts", "count", "prompts the fleet sent again (a failed actor's), or whose rollout the "
           "async pipeline sampled again (it failed before its step asked), since the previous step"),
    Metric("rollout/stale_rerun_prompts", "count", "of rollout/rerun_prompts, prompts the async pipeline sampled again "
           "with newer weights than their rollout was submitted at (those weights gone): their samples differ from a "
           "run without the fault"),
    Metric("rollout/actors_alive", "count", "rollout actors in use after the step (fewer after a node loss)"),
    Metric("rollout/engine_calls", "count", "generate calls rank 0's rollout fleet sent to the rollout actors since the "
           "previous step's metrics (a chunk of prompts or of episode turns each, re-sent ones and evaluation's "
           "included; agents' calls are env/gateway_calls)"),
    # the step's weight sync (rank 0)
    Metric("rollout/weight_sync_bytes", "bytes", "bytes of tensor data the step's weight sync sent (the object store's "
           "payload, a delta's encoding, or what NCCL/ipc moved)"),
    Metric("rollout/weight_sync_changed_fraction", "fraction",
           "values whose engine-dtype bits changed since the previous sync (rollout.weight_payload=delta)"),
    Metric("rollout/weight_sync_full_resyncs", "count",
           "rollout actors sent the full weights after refusing a delta (another version held, or a checksum failed)"),
    # environments (multi-turn episodes; logged when env.environments is set)
    Metric("env/episodes", "count", "episodes of the step"),
    Metric("env/steps", "count", "environment step calls of the step (one per episode turn the environment was asked "
           "about; agents' calls are env/gateway_calls)"),
    Metric("env/turns_mean", "turns", "mean assistant turns per episode"),
    Metric("env/tool_calls_mean", "calls", "mean tool calls per episode"),
    Metric("env/tool_errors", "count", "tool calls that failed (unparsable, unknown tool, bad arguments, the tool raised)"),
    Metric("env/failed", "count", "episodes whose environment failed (counted, not trained on)"),
    Metric("env/observation_tokens_mean", "tokens", "mean observation tokens per episode"),
    Metric("env/observations_truncated", "count", "observation messages cut to env.max_observation_tokens"),
    Metric("env/episodes_rerun", "count", "episodes run again from their reset: a rollout actor or environment host died under their step's rollout"),
    # agents behind the gateway (logged when env.agents is set)
    Metric("env/template_drift", "count", "agent history rewrites of the step: each cuts its episode into one more "
           "segment, trained as a sequence of its own (0 while agents only extend their conversations)"),
    Metric("env/gateway_calls", "count", "chat or completion calls the gateway answered in the step's agent episodes"),
    Metric("env/gateway_calls_mean", "calls", "mean chat or completion calls the gateway answered per agent episode"),
    Metric("env/agent_engine_calls", "count", "engine calls the agent hosts' batchers sent for the step's agent "
           "episodes (each carries waiting gateway calls to one rollout actor), summed over the hosts"),
    Metric("env/agent_prompts_per_engine_call", "prompts", "gateway calls per engine call of env/agent_engine_calls "
           "(how well env.agent_batching batched them; 0 without an engine call)"),
    Metric("env/agent_parallel_calls", "count", "gateway calls of the step's agent episodes that came while another "
           "call of their episode was being answered (an agent calling at once); their order, and so a seeded run's "
           "samples, depends on timing (0: the step's agent samples repeat bit for bit under lockstep)"),
    Metric("timing/agent_batch_wait_s", "s", "seconds the engine calls of env/agent_engine_calls waited for their "
           "batch (from a call's first request to its send), summed over the calls and hosts (logged with agents)"),
)
_EVAL_METRICS: tuple[Metric, ...] = (
    Metric("eval/reward_mean", "reward", "mean reward of the greedy evaluation completions that have one"),
    Metric("eval/num_problems", "count", "evaluation prompts"),
    Metric("eval/response_tokens_mean", "tokens", "mean response length at evaluation"),
    Metric("eval/loss", "loss", "offline: the objective's loss on the held-out pairs"),
    Metric("eval/pairwise_accuracy", "fraction", "held-out pairs whose chosen response gets the higher reward "
           "(not logged for unpaired KTO rows alone)"),
    Metric("eval/reward_margin", "reward", "mean chosen minus mean rejected reward of the held-out records"),
    Metric("eval/chosen_reward", "reward", "mean reward of the held-out chosen responses"),
    Metric("eval/rejected_reward", "reward", "mean reward of the held-out rejected responses"),
    Metric("eval/env_success", "fraction", "evaluation episodes with a positive environment reward and no failure"),
    Metric("eval/env_turns_mean", "turns", "mean assistant turns per evaluation episode"),
    Metric("eval/env_failed", "count", "evaluation episodes whose environment failed"),
)
METRICS: tuple[Metric, ...] = _STEP_METRICS + _EVAL_METRICS
METRIC_KEYS: tuple[str, ...] = tuple(m.key for m in _STEP_METRICS)  # the per-step keys (sweeps rank trials by one)
EVAL_KEYS: tuple[str, ...] = tuple(m.key for m in _EVAL_METRICS)
BY_KEY: dict[str, Metric] = {m.key: m for m in METRICS}

# Keys by prefix: one per episode stop reason (rlray.envs.episode.STOP_REASONS), of all and of failed episodes, one per
# number an environment reports in EnvStep.metrics (its mean over the episodes that reported it), one per environment
# server, one per pass@k.
FAMILIES: tuple[Family, ...] = (
    Family("env/stop_reason/{reason}", "count", "episodes of the step that ended for this stop reason"),
    Family("env/failed/{reason}", "count", "failed episodes of the step by stop reason (env_error, timeout, ..., or "
           "the limit after which get_reward/reward_at_limit or close raised)"),
    Family("env/metric/{name}", "as reported", "mean over the step's episodes of a number the environment reports"),
    Family("env/server_restarts/{server}", "count", "restarts so far of an environment server (env.servers, an agent's "
           "verifiers bridge), summed over the environment hosts (logged when env.servers or env.agents is set)"),
    Family("eval/env_metric/{name}", "as reported", "mean over the evaluation episodes of a number the environment reports"),
    Family("eval/pass@{k}", "fraction", "evaluation problems solved by at least one of k samples (eval.pass_k)"),
)
# Per reward term (reward.functions[].name, or the function's own name; reward.judges[].name): its mean over the samples it scored and the
# count it skipped (returned None for), per step and at evaluation.
TERM_FAMILIES: tuple[Family, ...] = (
    Family("reward/{term}", "reward", "mean of a reward term over the step's samples it scored"),
    Family("reward/{term}_skipped", "count", "the step's samples a reward term skipped (returned None for)"),
    Family("eval/{term}", "reward", "mean of a reward term over the evaluation samples it scored"),
    Family("eval/{term}_skipped", "count", "evaluation samples a reward term skipped"),
)
# Reward terms rlray adds itself (besides reward.functions), term -> what it holds.
TERMS: dict[str, str] = {
    "overlong": "DAPO's soft overlong penalty (<= 0) added to the reward (algo.overlong_cache_tokens > 0)",
}
# Metric keys of earlier releases and what replaced them (GSM8K's terms became reward functions).
RENAMED_KEYS: dict[str, str] = {
    "reward/accuracy": "reward/gsm8k_correct",
    "reward/format_rate": "reward/gsm8k_format",
    "eval/accuracy": "eval/gsm8k_correct",
    "eval/format_rate": "eval/gsm8k_format",
}

# The live page's charts, in page order.
CHARTS: tuple[Chart, ...] = (
    Chart("Reward (mean, each term, eval)", "reward", ("reward/mean", "eval/reward_mean"), reward_terms=True),
    Chart("Policy loss", "loss", ("learner/pg_loss", "learner/value_loss")),
    Chart("KL to the reference (nats/token)", "nats/token", ("algo/kl",), guard_line=True),
    Chart("Entropy (nats/token)", "nats/token", ("algo/entropy",)),
    Chart("Gradient norm", "L2 norm", ("learner/grad_norm",)),
    Chart("Response length (tokens)", "tokens", ("rollout/response_tokens_mean",)),
    Chart("Truncation rate", "fraction", ("rollout/truncated_rate",)),
    Chart("Throughput (tokens/s)", "tokens/s", ("perf/tokens_per_s", "perf/generated_tokens_per_s")),
    Chart("Step time by stage (s)", "s", tuple(f"timing/{s}_s" for s in STAGES)),
)
CHARTED_KEYS: frozenset[str] = frozenset(k for c in CHARTS for k in c.keys)

STEP_GAUGES: tuple[StepGauge, ...] = (
    StepGauge("rlray_reward_mean", "reward/mean", "mean reward of the last step"),
    StepGauge("rlray_kl", "algo/kl", "mean per-token KL to the reference of the last step (nats)"),
    StepGauge("rlray_tokens_per_s", "perf/tokens_per_s", "generated tokens per second of wall time in the last step"),
    StepGauge("rlray_staleness", "rollout/staleness_mean", "policy versions between the learner and the rollouts of the last step"),
)

# The progress line's figures, in order; a key the step did not log is left out.
PROGRESS_FIELDS: tuple[ProgressField, ...] = (
    ProgressField("reward/mean", "reward", "{:.3f}"),
    ProgressField("algo/kl", "kl", "{:.4f}"),
    ProgressField("learner/loss", "loss", "{:.4f}"),
    ProgressField("perf/tokens_per_s", "tokens/s", "{:.0f}"),
    ProgressField("timing/step_s", "step", "{:.1f}s"),
)


def term_keys(terms: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """Returns the metric keys of reward terms ``terms`` (``TERM_FAMILIES`` filled in), e.g. reward/gsm8k_correct."""
    return tuple(f.key(t) for t in terms for f in TERM_FAMILIES)


def is_metric_key(key: str, terms: list[str] | tuple[str, ...] = ()) -> bool:
    """Returns True when ``key`` is registered: a key of ``METRICS``, a key of one of ``FAMILIES``, or a key of reward
    term ``terms`` (the run's ``reward.term_names``: functions and judges) or of ``TERMS`` (``term_keys``)."""
    if key in BY_KEY or key.startswith(tuple(f.prefix for f in FAMILIES)):
        return True
    return key in term_keys((*terms, *TERMS))


def is_term_mean(key: str) -> bool:
    """Returns True for a reward term's mean per step, ``reward/<term>``: a ``reward/`` key that is not one of
    ``METRICS`` and not a term's skipped count (``reward/<term>_skipped``)."""
    return key.startswith("reward/") and key not in BY_KEY and not key.endswith("_skipped")


def is_charted(key: str) -> bool:
    """Returns True for a step metric the live page plots: a key of ``CHARTS``, or a reward term's mean when a chart
    plots the terms (``is_term_mean``)."""
    return key in CHARTED_KEYS or (is_term_mean(key) and any(c.reward_terms for c in CHARTS))


def describe(key: str) -> Metric:
    """Returns the ``Metric`` of ``key``: its own, or (for a key of a family) one with the family's unit and meaning.

    Raises:
        KeyError: ``key`` is neither registered nor of a family; the message names the registry.
    """
    if key in BY_KEY:
        return BY_KEY[key]
    family = next((f for f in FAMILIES if key.startswith(f.prefix)), None)
    if family is None:
        raise KeyError(f"metric key {key!r} is not in rlray.observe.metrics (METRICS or FAMILIES); register it there")
    return Metric(key, family.unit, family.meaning)


def check_names(charts: tuple[Chart, ...], gauges: tuple[StepGauge, ...], fields: tuple[ProgressField, ...]) -> None:
    """Checks that every key a chart, a gauge or a progress field names is registered with a unit and a meaning.

    Raises:
        ValueError: names the chart, gauge or field and the key, and says to register it in ``METRICS``.
    """
    named = [(f"chart {c.title!r}", k) for c in charts for k in c.keys]
    named += [(f"gauge {g.name}", g.key) for g in gauges] + [(f"progress field {f.label!r}", f.key) for f in fields]
    for who, key in named:
        metric = BY_KEY.get(key)
        if metric is None:
            raise ValueError(f"{who} names {key!r}, which is not registered; add it to METRICS in rlray.observe.metrics")
        if not metric.unit.strip() or not metric.meaning.strip():
            raise ValueError(f"{who} names {key!r}, which has no unit or meaning; give it both in METRICS")


def charts_document() -> dict[str, object]:
    """Returns the ``GET /api/charts`` document the page draws its charts from: {charts: [{title, unit, keys,
    reward_terms, guard_line}], meanings: {key: "meaning (unit)"} of every charted key, term: the meaning of a reward
    term's mean}."""
    term = TERM_FAMILIES[0]
    return {
        "charts": [{"title": c.title, "unit": c.unit, "keys": list(c.keys), "reward_terms": c.reward_terms,
                    "guard_line": c.guard_line} for c in CHARTS],
        "meanings": {k: f"{BY_KEY[k].meaning} ({BY_KEY[k].unit})" for c in CHARTS for k in c.keys},
        "term": f"{term.meaning} ({term.unit})",
    }


# What MLflow 3 accepts in a metric name on Linux and macOS (mlflow/utils/validation.py,
# validate_param_and_metric_name: r"^[/\w.\- :]*$"): alphanumerics and underscores (\w, Unicode), dashes,
# periods, spaces, colons and slashes. Everything else becomes "_".
_BAD = re.compile(r"[^\w\-. :/]")


def sanitize_key(key: str) -> str:
    """Returns ``key`` with each character MLflow rejects in a metric name replaced by '_'.

    Kept: what MLflow allows (alphanumerics, underscores, dashes, periods, spaces, colons, slashes). Two keys
    that differ only in replaced characters ("loss@0", "loss#0") become one; ``KeySanitizer`` refuses that.
    """
    return _BAD.sub("_", key)


class KeySanitizer:
    """Sanitises metric keys (``sanitize_key``) and refuses two different keys that would become one.

    It remembers every key it has seen, so a collision is caught across calls as well as within one.
    """

    def __init__(self) -> None:
        self._source: dict[str, str] = {}  # sanitised key -> the original key that took it

    def __call__(self, key: str) -> str:
        """Returns the MLflow key of ``key``.

        Raises:
            ValueError: another key already became the same MLflow key; names both keys and the shared one.
        """
        clean = sanitize_key(key)
        first = self._source.setdefault(clean, key)
        if first != key:
            raise ValueError(
                f"metric keys {first!r} and {key!r} both become the MLflow key {clean!r} (MLflow allows only "
                "alphanumerics, '_', '-', '.', ' ', ':' and '/'; the rest become '_'); rename one of them"
            )
        return clean


check_names(CHARTS, STEP_GAUGES, PROGRESS_FIELDS)
