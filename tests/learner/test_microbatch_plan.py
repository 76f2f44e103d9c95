"""Micro-batches by sequences or by a token budget (``batching.plan_microbatches``), and what must not depend on them:
the loss and gradient of every aggregation mode and every online algorithm (PPO's critic included), cut three ways and
run padded or packed, and the stage-4 logprobs (reference, old, teacher)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlray.algos import AGGREGATION_MODES, algorithm_names
from rlray.config import config_from_dict
from rlray.learner import LossSpec, Normaliser, OptimizerSpec, PolicyLearner
from rlray.learner import online as learner_online
from rlray.learner.batching import MicroBatching, plan_microbatches
from rlray.learner.packing import TokenCounts
from rlray.learner.parallel import FSDP2
from rlray.run.build import ppo_critic, update_spec
from rlray.schema import pack_sequences
from tests.learner.packed_rows import assert_grads_close, grads, group_batch, real_tokens

# Two float32 computations of the same sums in other orders, compared with each other (a float64 learner is not built
# here; tests/learner/test_packing.py holds the layouts exact in float64). Each errs by <= ~1.1e-6 of the gradient
# against the float64 truth (test_packing.py's measurements), so their difference by <= ~2.2e-6: the bounds below,
# 1e-4 of each parameter's norm plus 1e-4 of the whole gradient's (a parameter whose exact gradient is zero or tiny
# gets only noise), leave room for any float32 backend's kernels. A wrong cut (a row of the 9 counted twice or
# dropped, a normaliser off) moves the gradient by about a ninth of its norm.
GRAD_REL = GRAD_FLOOR = 1e-4
# Scalars summed over <= ~100 token terms of magnitude <= ~1 in another order: <= 100 * 2^-24 = 6e-6 absolute each
# path; relative 1e-4 for the large ones.
SUM_REL, SUM_ABS = 1e-4, 2e-5
# Logprobs of two float32 layouts: each within 1e-4 nats of the float64 truth (test_packing.py's F32_ATOL, seen
# <= 1.6e-6), so within 2e-4 of each other; a row scored under another row's tokens moves by nats.
LOGPROB_ATOL = 2e-4
# the reference layout, then three other cuts of the same mini-batch
PADDED = MicroBatching(sequences=8, packing="off", share_prefixes=False)
CUTS = {
    "3 rows, padded": MicroBatching(sequences=3, packing="off", share_prefixes=False),
    "60 tokens, packed": MicroBatching(sequences=1, tokens=60, packing="on", share_prefixes=False),
    "50 tokens, packed, shared": MicroBatching(sequences=1, tokens=50, packing="on"),
    "70 tokens, padded, shared": MicroBatching(sequences=1, tokens=70, packing="off"),
}


def _inputs(prompts: list[int], responses: list[int]):
    return pack_sequences([[7] * p for p in prompts], [[9] * r for r in responses], pad_token_id=0)


def test_by_sequences_the_rows_come_in_runs():
    plan = plan_microbatches(_inputs([2] * 5, [3] * 5), MicroBatching(sequences=2), packed=True)
    assert [p.tolist() for p in plan] == [[0, 1], [2, 3], [4]]


def test_packed_budget_bins_groups_whole_with_their_prompt_once():
    # two groups of 3 rows (prompt 10, responses 5) cost 10 + 15 = 25 each; a lone row of 2 + 20 = 22
    inputs = pack_sequences([[1] * 10] * 3 + [[2] * 10] * 3 + [[3] * 2], [[9] * 5] * 6 + [[9] * 20], pad_token_id=0)
    plan = plan_microbatches(inputs, MicroBatching(sequences=1, tokens=50), packed=True)
    assert [p.tolist() for p in plan] == [[0, 1, 2, 3, 4, 5], [6]]  # first fit by decreasing size: 25 + 25, then 22
    unshared = plan_microbatches(inputs, MicroBatching(sequences=1, tokens=50, share_prefixes=False), packed=True)
    # 15 tokens a row: the lone row (22) takes one more (37), then 3 rows (45) and 2 (30)
    assert [p.tolist() for p in unshared] == [[0, 6], [1, 2, 3], [4, 5]]
    # a group over the budget is cut into parts that each repeat its prompt: 10 + 5 + 5 = 20 <= 22
    cut = plan_microbatches(inputs, MicroBatching(sequences=1, tokens=22), packed=True)
    assert sorted(p.tolist() for p in cut) == [[0, 1], [2], [3, 4], [5], [6]]


def test_padded_budget_bins_rows_of_similar_length():
    # lengths 2+10, 2+1, 2+9, 2+2: sorted 12, 11, 4, 3; two rows of width 2+10 fill 24
    plan = plan_microbatches(_inputs([2] * 4, [10, 1, 9, 2]), MicroBatching(sequences=1, tokens=24), packed=False)
    assert [p.tolist() for p in plan] == [[0, 2], [1, 3]]


@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.integers(1, 30), min_size=1, max_size=12), budget=st.integers(16, 200),
       packed=st.booleans(), share=st.booleans(), seed=st.integers(0, 1000))
def test_every_row_lands_in_exactly_one_microbatch_within_the_budget(prompts, budget, packed, share, seed):
    gen = torch.Generator().manual_seed(seed)
    responses = torch.randint(1, 40, (len(prompts),), generator=gen).tolist()
    groups = torch.randint(0, 3, (len(prompts),), generator=gen).tolist()  # rows of one group share a prompt
    lengths = [prompts[g % len(prompts)] for g in groups]
    inputs = pack_sequences([[g + 1] * p for g, p in zip(groups, lengths, strict=True)], [[9] * r for r in responses], 0)
    plan = plan_microbatches(inputs, MicroBatching(sequences=1, tokens=budget, share_prefixes=share), packed=packed)
    assert sorted(torch.cat(plan).tolist()) == list(range(len(prompts)))
    for rows in plan:
        rows = rows.tolist()
        cost = sum(lengths[r] + responses[r] for r in rows)  # packed, every row its own prompt
        once = cost - sum(lengths[r] for r in rows) + sum(prompts[g % len(prompts)] for g in {groups[r] for r in rows})
        padded = len(rows) * (max(lengths[r] for r in rows) + max(responses[r] for r in rows))
        within = (once if share else cost) if packed else padded  # what the bin computes, in its layout
        assert len(rows) == 1 or within <= budget, (rows, within)  # only a lone row may exceed the budget
        assert len(rows) == 1 or min(cost, padded) <= budget or share
    if packed and share:  # a group that fits the budget (its prompt once) is never cut
        for g in set(groups):
            members = [r for r in range(len(prompts)) if groups[r] == g]
            if lengths[members[0]] + sum(responses[r] for r in members) <= budget:
                assert any(set(members) <= set(rows.tolist()) for rows in plan), (g, members)


def _learner(path: str, **kw) -> PolicyLearner:
    args = dict(dtype="float32", optim=OptimizerSpec(lr=1e-12, max_grad_norm=1e9),
                temperature=0.8, use_reference=True)
    return PolicyLearner(path, **{**args, **kw})


def _minibatch():
    batch = group_batch([14, 6, 9], [[5, 17, 2], [11, 11, 3], [25]], seed=4, shared_start=1)
    return batch, Normaliser(float(batch.response_mask.sum()), float(batch.num_rows))


@pytest.mark.parametrize("agg", AGGREGATION_MODES)
def test_the_loss_of_every_aggregation_does_not_depend_on_the_cut(tiny_model_path, agg):
    batch, norm = _minibatch()
    batch.ref_logprobs = batch.old_logprobs - 0.1
    spec = LossSpec(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.05, kl_estimator="k3", loss_agg=agg,
                    max_response_tokens=32, entropy_coef=0.01, correction="token_truncate", correction_max=2.0)
    learner = _learner(tiny_model_path)
    want = learner.train_minibatch(batch, spec, norm, PADDED)
    want_grads = grads(learner.module)
    for name, cut in CUTS.items():
        got = learner.train_minibatch(batch, spec, norm, cut)
        for key in ("loss", "pg_loss_sum", "kl_sum", "entropy_sum", "rollout_diff_sum", "tokens", "sequences"):
            assert got[key] == pytest.approx(want[key], rel=SUM_REL, abs=SUM_ABS), (name, key)
        assert_grads_close(grads(learner.module), want_grads, rel=GRAD_REL, floor=GRAD_FLOOR)
    assert want["loss"] != 0.0 and want["tokens"] == float(batch.response_mask.sum())


def test_the_jsd_distillation_loss_does_not_depend_on_the_cut(tiny_model_path, teacher_path):
    # on-policy distillation's JSD term (teacher.divergence=jsd): the teacher's full distributions are computed in
    # each micro-batch at the student's positions, packed or padded, so the loss, its JSD sum and the gradient match
    batch, norm = _minibatch()
    spec = LossSpec(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.0, kl_estimator="k3", loss_agg="token-mean",
                    max_response_tokens=32, jsd_weight=0.5, jsd_beta=0.3)
    learner = _learner(tiny_model_path, use_reference=False, teacher_path=teacher_path)
    want = learner.train_minibatch(batch, spec, norm, PADDED)
    want_grads = grads(learner.module)
    for name, cut in CUTS.items():
        got = learner.train_minibatch(batch, spec, norm, cut)
        for key in ("loss", "pg_loss_sum", "jsd_sum", "tokens"):
            assert got[key] == pytest.approx(want[key], rel=SUM_REL, abs=SUM_ABS), (name, key)
        # the mixture's log goes through both models' softmax: the small q/k gradients of the cache path ("70 tokens,
        # padded, shared") differ by 1.1e-5 of their norm on an AVX2 EPYC (3.6e-6 packed; 1.5e-6 between two
        # identical padded passes), float32 sums in another order: inside GRAD_REL's room
        assert_grads_close(grads(learner.module), want_grads, rel=GRAD_REL, floor=GRAD_FLOOR)
    assert want["jsd_sum"] > 0.0  # a differently seeded teacher (tiny-random@1): the term is not trivially 0


def test_the_learner_counts_the_tokens_it_computed(tiny_model_path):
    batch, norm = _minibatch()
    learner = _learner(tiny_model_path, use_reference=False)
    spec = LossSpec(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.0, kl_estimator="k3", loss_agg="token-mean",
                    max_response_tokens=32)
    rows = int(batch.inputs.attention_mask.sum())  # 3 groups: prompts 14 x 3, 6 x 3, 9 x 1 plus every response
    learner.train_minibatch(batch, spec, norm, MicroBatching(sequences=8, packing="on", share_prefixes=False))
    assert learner.take_tokens() == TokenCounts(real=rows, padding=0, shared=0)
    learner.train_minibatch(batch, spec, norm, MicroBatching(sequences=8, packing="on"))
    got = learner.take_tokens()  # each group's prompt once (and the first sampled token the group shares)
    assert got.shared == 2 * (14 + 1) + 2 * (6 + 1) and got.real + got.shared == rows and got.padding == 0
    learner.logprobs(batch.inputs, reference=False, batching=PADDED)
    padded = learner.take_tokens()
    assert padded.real == rows and padded.padding == batch.inputs.attention_mask.numel() - rows
    assert learner.take_tokens() == TokenCounts()


def test_an_fsdp_learner_cuts_by_sequences(tiny_model_path):
    learner = _learner(tiny_model_path, use_reference=False)
    budget = MicroBatching(sequences=4, tokens=100, packing="auto")
    assert learner.micro_batching(budget) == budget
    learner.parallel = FSDP2(mixed_precision=False)  # every rank must run as many forwards (each gathers the weights)
    assert learner.micro_batching(budget) == dataclasses.replace(budget, tokens=None)


def test_stage4_logprobs_packed_equal_padded(tiny_model_path, teacher_path):
    batch, _ = _minibatch()
    learner = _learner(tiny_model_path, teacher_path=teacher_path)
    real = real_tokens(batch)
    for reference in (False, True):
        want = learner.logprobs(batch.inputs, reference=reference, batching=PADDED)
        for cut in CUTS.values():
            got = learner.logprobs(batch.inputs, reference=reference, batching=cut)
            torch.testing.assert_close(got[real], want[real], atol=LOGPROB_ATOL, rtol=0)
    want = learner.teacher_logprobs(batch.inputs, batching=PADDED)
    got = learner.teacher_logprobs(batch.inputs, batching=CUTS["50 tokens, packed, shared"])
    torch.testing.assert_close(got[real], want[real], atol=LOGPROB_ATOL, rtol=0)


@pytest.fixture(scope="module")
def teacher_path():
    from rlray.models import resolve_model_path

    return resolve_model_path("tiny-random@1")


def _online_run(name: str, tiny_model_path: str, batching: MicroBatching) -> tuple[dict, dict, dict]:
    cfg = config_from_dict({}, [f"algo.name={name}", "model.path=tiny-random", "model.dtype=float32",
                                "rollout.samples_per_prompt=3", "learner.prompts_per_step=3",
                                "learner.sequences_per_minibatch=9", "learner.sequences_per_microbatch=3",
                                "learner.lr=1e-12", "critic.lr=1e-12", "algo.kl_coef=0.05", "algo.entropy_coef=0.01"])
    spec = dataclasses.replace(update_spec(cfg, 1), batching=batching)
    torch.manual_seed(0)  # the critic's fresh value head
    critic = ppo_critic(cfg, tiny_model_path, None) if cfg.algo.algorithm.needs_critic else None
    learner = _learner(tiny_model_path, critic=critic, temperature=cfg.rollout.temperature)
    batch = group_batch([14, 6, 9], [[5, 17, 2], [11, 11, 3], [25, 4, 9]], seed=8, shared_start=1)
    batch.old_logprobs = None
    batch.baseline_reward = batch.reward - 0.5  # ReMax's greedy baseline
    batch = learner_online.reference_and_old(learner, batch, spec)
    batch = learner_online.advantages(batch, spec, lambda d: d)
    norms = [Normaliser(float(batch.response_mask.sum()), 9.0)]
    metrics = learner_online.update(learner, batch, norms, spec, lambda d: d)
    return metrics, grads(learner.module), grads(critic.module) if critic else {}


@pytest.mark.parametrize("name", algorithm_names("online"))
def test_every_online_algorithm_updates_the_same_packed_and_shared(tiny_model_path, name):
    want, want_grads, want_critic = _online_run(name, tiny_model_path, PADDED)
    got, got_grads, got_critic = _online_run(name, tiny_model_path, CUTS["50 tokens, packed, shared"])
    for key, value in want.items():
        if not key.startswith(("perf/", "learner/lr")):
            assert got[key] == pytest.approx(value, rel=SUM_REL, abs=SUM_ABS), key
    assert got["rollout/logprob_abs_diff"] == pytest.approx(want["rollout/logprob_abs_diff"], rel=SUM_REL, abs=SUM_ABS)
    assert_grads_close(got_grads, want_grads, rel=GRAD_REL, floor=GRAD_FLOOR)
    assert_grads_close(got_critic, want_critic, rel=GRAD_REL, floor=GRAD_FLOOR)
    assert (name == "ppo") == bool(want_critic) == ("learner/value_loss" in want)
    assert got["perf/learner_tokens_padding"] == 0 < want["perf/learner_tokens_padding"]
    assert got["perf/learner_tokens_shared"] > 0 == want["perf/learner_tokens_shared"]
    assert got["perf/learner_tokens_real"] < want["perf/learner_tokens_real"]
