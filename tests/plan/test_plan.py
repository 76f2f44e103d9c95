"""The run plan (rlray.plan): each decision of shipped configs, by hand, and the readers that must agree with it
(the driver's engine context length, ``rlray plan``'s micro-batch and roles, the placement requests, the learner's
FSDP micro-batching)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from rlray.config import ConfigError, load_config
from rlray.launch.driver import max_model_len
from rlray.launch.placement import role_requests
from rlray.launch.plan import plan_run
from rlray.launch.plan_roles import Models, microbatch
from rlray.learner import PolicyLearner
from rlray.learner.batching import MicroBatching
from rlray.learner.parallel import FSDP2 as FSDP2Strategy
from rlray.models.memory import ModelShape
from rlray.plan import RunPlan, resolve_plan
from rlray.plan.records import Roles
from rlray.rollout import SamplingSpec
from rlray.run import build

TINY = "configs/grpo_gsm8k_tiny.yaml"  # prompt 256, max_new_tokens 16, 2 prompts x 4 samples, minibatch 8, micro 4
HAND = ModelShape(hidden_size=8, intermediate_size=12, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                  vocab_size=16, tied_embeddings=True)  # fmt: skip
FSDP2 = ["resources.learner.num_workers=2", "resources.learner.strategy=fsdp"]


def _plan(path: str, *overrides: str) -> RunPlan:
    return resolve_plan(load_config(path, list(overrides)))


@pytest.mark.parametrize(("path", "context", "response"), [
    (TINY, 256 + 16, 16),  # data.max_prompt_tokens + rollout.max_new_tokens (eval takes the same cap)
    ("configs/distill_tiny.yaml", 256 + 16, 16),
    ("configs/algos/dpo.yaml", 256 + 160, 160),
    ("configs/grpo_gsm8k_smollm2.yaml", 256 + 160, 160),
    # env: the longest episode, 512 prompt + 2 turns x 12 + (2 - 1) x 32 observation = 568 > 512 + 12
    ("configs/envs/calculator_tiny.yaml", 568, 568 - 512),
    ("configs/envs/agent_smollm2.yaml", 384 + 4 * 64 + 3 * 64, 4 * 64 + 3 * 64),  # 4 turns of 64, 3 observations of 64
])  # fmt: skip
def test_context_length_is_what_the_driver_gives_the_engines_and_the_planner_sizes(path, context, response):
    cfg = load_config(path)
    plan = resolve_plan(cfg)
    assert plan.lengths.context_tokens == context == max_model_len(cfg)
    assert plan.lengths.response_tokens == response
    if plan.roles.online:  # rlray plan's KV cache is sized for the same context
        engine = plan_run(resolve_plan(cfg), models=Models(HAND, "hand")).roles[1]
        assert any(f"x {context} tokens" in t.name for t in engine.terms)


def test_placements_of_shipped_configs():
    tiny = _plan(TINY)  # algo.kl_coef 0.04 and the reference on the learner, no LoRA
    assert (tiny.roles.online, tiny.roles.reference, tiny.roles.teacher, tiny.roles.critic) == (True, "learner", "off", False)
    assert tiny.roles.reference_on_learner and not tiny.roles.reward_server and tiny.roles.judges == ()
    distill = _plan("configs/distill_tiny.yaml")  # kl_coef 0 and no KL guard: no reference; the teacher on the learner
    assert (distill.roles.reference, distill.roles.teacher) == ("off", "learner")
    dpo = _plan("configs/algos/dpo.yaml")  # offline: no rollout-side roles
    assert (dpo.roles.online, dpo.roles.reference, dpo.roles.env_hosts, dpo.roles.judges) == (False, "off", False, ())
    assert _plan("configs/algos/ppo.yaml").roles.critic
    judged = _plan("configs/judge_gsm8k_smollm2.yaml")
    assert judged.roles.judges == ("rlray-judge-judge",) and [j.name for j in judged.reward.judges] == ["judge"]
    agent = _plan("configs/envs/agent_smollm2.yaml")
    assert agent.roles.env_hosts and [n for n, _ in agent.episodes.agents] == ["speller"]
    assert [t.name for t in agent.episodes.tools] == ["words"]
    assert (agent.episodes.limits.max_turns, agent.episodes.limits.max_episode_tokens) == (4, 832)


def test_reference_placement_one_rule_for_driver_placement_and_planner():
    actor = _plan(TINY, "resources.reference.placement=actor", "watchdog.reference_call_s=90")
    assert actor.roles.reference == "actor"
    assert actor.deadlines.reference_call_s == 90.0  # every rank's wait on the actor (rlray.run.frozen_calls)
    assert [r.role for r in role_requests(actor)] == ["rollout", "learner", "reference"]
    # the KL guard alone (kl_coef 0) keeps the reference on the learner even with placement actor: no actor starts
    guard = load_config(TINY, ["resources.reference.placement=actor", "algo.kl_coef=0", "guard.kl_threshold=1.0"])
    assert resolve_plan(guard).roles.reference == "learner"
    assert [r.role for r in role_requests(resolve_plan(guard))] == ["rollout", "learner"]
    planned = plan_run(resolve_plan(guard), models=Models(HAND, "hand"))
    assert [r.role for r in planned.roles] == ["learner rank", "rollout engine"]
    assert any(t.name.startswith("reference: frozen copy") for t in planned.roles[0].terms)
    assert build.learner_kwargs(guard, 1)["use_reference"]
    lora = _plan(TINY, "model.lora.rank=8")  # the reference is the base with the adapters off: no copy
    assert lora.roles.reference == "lora_base" and not lora.roles.reference_on_learner


def test_fsdp_learner_cuts_by_sequences_in_the_plan_the_planner_and_the_learner():
    cfg = load_config(TINY, [*FSDP2, "learner.tokens_per_microbatch=1000", "learner.sequences_per_microbatch=2"])
    par = resolve_plan(cfg).parallelism
    assert (par.strategy, par.world_size, par.sharded, par.rows_per_minibatch) == ("fsdp", 2, True, 8 // 2)
    assert par.micro_batching == MicroBatching(sequences=2, tokens=None, packing="auto", share_prefixes=True)
    assert par.frozen_micro_batching.tokens == 1000  # a reference or teacher actor is not sharded: the budget holds
    assert build.update_spec(cfg, 2).batching == par.micro_batching == build.micro_batching(cfg)
    # the learner's own rule (PolicyLearner.micro_batching on a sharded learner) gives the same micro-batching
    sharded = SimpleNamespace(parallel=FSDP2Strategy(mixed_precision=False, gpu=False))
    assert PolicyLearner.micro_batching(sharded, par.frozen_micro_batching) == par.micro_batching
    # rlray plan: 2 sequences x (256 + 16) tokens, not ceil(1000 / 272) = 4 sequences
    mb = microbatch(resolve_plan(cfg))
    assert (mb.sequences, mb.tokens) == (2, 2 * 272) and "unused" in mb.source
    ddp = load_config(TINY, ["resources.learner.num_workers=2", "learner.tokens_per_microbatch=1000",
                             "learner.sequences_per_microbatch=2"])
    assert resolve_plan(ddp).parallelism.micro_batching.tokens == 1000
    assert (microbatch(resolve_plan(ddp)).sequences, microbatch(resolve_plan(ddp)).tokens) == (4, 4 * 272)  # ceil(1000 / 272) = 4 rows


def test_fsdp_with_a_budget_still_needs_the_sequences_to_divide():
    cfg = load_config(TINY, [*FSDP2, "learner.tokens_per_microbatch=1000", "learner.sequences_per_microbatch=3"])
    with pytest.raises(ConfigError, match=r"sequences_per_microbatch=3 x 2 learner worker\(s\) does not divide"):
        resolve_plan(cfg)  # 8 sequences per mini-batch; the validator skips the check because a budget is set


def test_one_rank_is_single_whatever_the_strategy():
    par = _plan(TINY, "resources.learner.strategy=fsdp", "learner.tokens_per_microbatch=1000").parallelism
    assert (par.strategy, par.sharded, par.micro_batching.tokens) == ("single", False, 1000)


def test_sampling_specs_by_hand():
    plan = _plan(TINY, "run.seed=3", "eval.pass_k=4")
    step = plan.sampling.for_step(5)
    assert step.seed == 3 * 1_000_003 + 5 and (step.n, step.max_new_tokens) == (4, 16)
    assert build.sampling_for_step(load_config(TINY, ["run.seed=3"]), 5) == step
    assert plan.sampling.eval == SamplingSpec(n=1, max_new_tokens=16, temperature=0.0, top_p=1.0, stop=step.stop)
    pass_k = plan.sampling.pass_at_k()
    assert (pass_k.n, pass_k.seed, pass_k.max_new_tokens, pass_k.temperature) == (4, 3, 16, step.temperature)
    assert _plan(TINY).sampling.pass_at_k() is None


def test_the_plan_is_frozen():
    plan = _plan(TINY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.roles.reference = "actor"  # type: ignore[misc]
    assert isinstance(plan.roles, Roles)


def test_rlray_plan_prints_the_runs_own_decisions_for_an_fsdp_learner_with_a_token_budget(capsys):
    # Issue 38: `rlray plan` prints from the plan the run uses (resolve_plan, as rlray.launch.driver.run_training
    # resolves it), so the printed reference placement, context length and micro-batch cannot differ from the run's.
    # FSDP cuts by sequences: the 1000-token budget would give ceil(1000 / (256 + 160)) = 3 rows; the run takes 2.
    from rlray.cli import main
    from rlray.launch.driver import max_model_len
    from rlray.plan.settings import Settings

    overrides = ["model.path=configs/models/qwen2.5-1.5b", *FSDP2, "learner.tokens_per_microbatch=1000",
                 "learner.sequences_per_microbatch=2", "algo.kl_coef=0.05"]
    cfg = load_config("configs/grpo_gsm8k_smollm2.yaml", overrides)
    run = resolve_plan(cfg)
    assert isinstance(run.settings, Settings) and run.settings is cfg
    assert (run.roles.reference, run.parallelism.sharded, run.parallelism.micro_batching.tokens) == ("learner", True, None)
    main(["plan", "configs/grpo_gsm8k_smollm2.yaml", *overrides])
    out = capsys.readouterr().out
    lengths, batching = run.lengths, run.parallelism.micro_batching
    assert (f"micro-batch per learner rank: {batching.sequences} sequences x ({lengths.prompt_tokens} + "
            f"{lengths.response_tokens} tokens)") in out
    assert batching.sequences == 2 and "learner.tokens_per_microbatch unused" in out
    assert f"context length: {lengths.context_tokens:,} tokens" in out and lengths.context_tokens == max_model_len(cfg)
    assert lengths.context_tokens == 256 + 160
    assert f"reference: a frozen copy sharded over the {run.parallelism.world_size} learner ranks" in out
    # the learner rank's memory holds the reference as a 1/2 shard, as FSDP2.frozen places it
    assert "reference: frozen copy, bfloat16, 1/2 shard" in out or "reference: frozen copy, float32, 1/2 shard" in out


def test_engines_by_hand():
    e = _plan(TINY, "model.dtype=float32", "run.seed=7", "rollout.kv_cache_gib=0.25").engines
    assert (e.backend, e.dtype, e.seed, e.kv_cache_gib, e.tensor_parallel_size) == ("vllm", "float32", 7, 0.25, 1)
    assert (e.weight_transfer, e.lora_slots, e.lora_rank, e.adapter_path) == (None, 0, 0, None)  # CPU: object store
    # an adapter-only sync keeps max_staleness + 2 = 4 adapter versions of the LoRA rank
    lora = _plan(TINY, "model.lora.rank=16", "rollout.max_staleness=2", "rollout.lora_sync=adapter").engines
    assert (lora.lora_slots, lora.lora_rank, lora.weight_transfer) == (4, 16, None)
    gpus = _plan(TINY, "resources.learner.gpus=1", "resources.rollout.gpus=1", "resources.rollout.tensor_parallel_size=2")
    assert (gpus.engines.weight_transfer, gpus.engines.tensor_parallel_size, gpus.roles.rollout.gpus) == ("nccl", 2, 2)
    assert _plan(TINY, "resources.learner.gpus=1", "resources.rollout.gpus=1",
                 "resources.colocate=true").engines.weight_transfer == "ipc"


def test_judges_carry_their_definition_as_configured():
    judge = ("{name: j, path: tiny-random, dtype: auto, weight: 0.5, logprobs: true, prefill: 'Verdict:', "
             "parse: {labels: {good: 1.0, bad: 0.0}}}")
    plan = _plan(TINY, f"reward.judges=[{judge}]", "run.seed=3", "resources.judge.cpu_threads=0-1")
    (j,) = plan.reward.judges
    assert (j.name, j.mode, j.weight, j.app_name, j.path, j.revision) == ("j", "pointwise", 0.5, "rlray-judge-j",
                                                                           "tiny-random", None)
    s = j.spec
    assert (s.model_path, s.seed, s.cpu_threads, s.labels, s.logprobs, s.prefill) == (
        "tiny-random", 3, "0-1", (("good", 1.0), ("bad", 0.0)), True, "Verdict:")
    assert s.dtype in ("bfloat16", "float32")  # auto, resolved on this machine for resources.judge.gpus=0
