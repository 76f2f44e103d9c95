"""On-policy distillation on the learner: the reverse-KL advantage, teacher logprobs, the JSD loss term, the specs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlray import algos, schema
from rlray.algos import get_algorithm
from rlray.config import config_from_dict
from rlray.learner import LossSpec, Normaliser, policy_objective
from rlray.learner import online as learner_online
from rlray.learner.batching import MicroBatching
from rlray.learner.logprobs import response_logits
from rlray.learner.packing import TokenCounts
from rlray.models import resolve_model_path
from rlray.run.build import update_spec
from tests.learner.batches import step_batch
from tests.learner.test_policy import _learner, _table

GRPO = get_algorithm("grpo").advantage


def _loss(**options) -> LossSpec:
    return LossSpec(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.0, kl_estimator="k3", loss_agg="token-mean",
                    **{"max_response_tokens": 16, **options})


def test_reverse_kl_added_to_advantages_hand_computed():
    mask = torch.tensor([[True, True, True], [True, False, False]])  # row 1: an observation token, then padding
    data = step_batch(
        mask,
        advantages=torch.tensor([[0.5, 0.5, 0.5], [-1.0, -1.0, 0.0]]),
        old_logprobs=torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.0, -9.0]]),
        teacher_logprobs=torch.tensor([[-1.5, -1.0, -3.0], [-1.25, -7.0, 0.0]]),
    )
    out = learner_online.add_reverse_kl(data, 2.0, dict)
    # old - teacher on loss tokens: [0.5, -1, 0], [0.75]; advantage += -2 * that: [-1, 2, 0], [-1.5]
    expect = torch.tensor([[-0.5, 2.5, 0.5], [-2.5, -1.0, 0.0]])  # response_mask False positions keep -1.0 and 0.0
    torch.testing.assert_close(data.advantages, expect, atol=1e-6, rtol=0)
    # token mean over the 4 loss tokens: (0.5 - 1 + 0 + 0.75) / 4 = 0.0625 nats
    assert out == {"algo/distill_reverse_kl": pytest.approx(0.0625, abs=1e-7)}


def test_reverse_kl_metric_is_a_token_mean_over_ranks():
    data = step_batch(torch.tensor([[True, False]]), advantages=torch.zeros(1, 2),
                      old_logprobs=torch.tensor([[-1.0, 0.0]]), teacher_logprobs=torch.tensor([[-2.0, 0.0]]))

    def with_other_rank(values):  # the other rank holds 3 tokens of summed difference -1.0
        return {"kl_sum": values["kl_sum"] - 1.0, "tokens": values["tokens"] + 3.0}

    out = learner_online.add_reverse_kl(data, 1.0, with_other_rank)
    assert out["algo/distill_reverse_kl"] == pytest.approx((1.0 - 1.0) / 4)
    assert data.advantages.tolist() == [[-1.0, 0.0]]


@pytest.fixture(scope="module")
def teacher_path() -> str:
    return resolve_model_path("tiny-random@1")


def test_stage4_takes_teacher_and_old_logprobs(tiny_model_path, tiny_tokenizer, teacher_path):
    pad = tiny_tokenizer.pad_token_id
    batch = schema.collate(_table(pad), pad)
    spec = learner_online.UpdateSpec(estimator=GRPO, loss=_loss(), advantage=None, epochs=1, rows_per_minibatch=8,
                                     batching=MicroBatching(4), old_logprobs_before_update=True, distill_weight=1.0)
    same = _learner(tiny_model_path, use_reference=False, teacher_path=tiny_model_path)
    data = learner_online.reference_and_old(same, dataclasses.replace(batch), spec)
    assert torch.equal(data.teacher_logprobs, data.old_logprobs)  # a teacher equal to the student: KL exactly 0
    assert learner_online.add_reverse_kl(dataclasses.replace(data, advantages=torch.zeros_like(data.old_logprobs)), 1.0,
                                         dict)["algo/distill_reverse_kl"] == 0.0
    other = _learner(tiny_model_path, use_reference=False, teacher_path=teacher_path)
    data = learner_online.reference_and_old(other, dataclasses.replace(batch), spec)
    mask = batch.response_mask
    assert float((data.teacher_logprobs - data.old_logprobs).abs()[mask].min()) > 0  # another model
    filled = dataclasses.replace(batch, teacher_logprobs=torch.full(mask.shape, -3.0))  # a teacher actor's values stay
    assert torch.equal(learner_online.reference_and_old(other, filled, spec).teacher_logprobs, torch.full(mask.shape, -3.0))


def test_teacher_logprobs_need_a_teacher(tiny_model_path, tiny_tokenizer):
    pad = tiny_tokenizer.pad_token_id
    learner = _learner(tiny_model_path, use_reference=False)
    with pytest.raises(ValueError, match="this learner holds no teacher"):
        learner.teacher_logprobs(schema.collate(_table(pad), pad).inputs, batching=MicroBatching(8))
    with pytest.raises(ValueError, match="needs a teacher on this learner"):
        learner.train_minibatch(schema.collate(_table(pad), pad), _loss(jsd_weight=1.0), Normaliser(1.0, 1.0), MicroBatching(8))


def test_jsd_term_in_the_loss_equals_the_hand_composed_one(tiny_model_path, tiny_tokenizer, teacher_path):
    pad = tiny_tokenizer.pad_token_id
    batch = schema.collate(_table(pad), pad)
    batch.advantages = torch.zeros(batch.inputs.response_ids.shape)  # pure distillation: the loss is the JSD alone
    mask = batch.response_mask
    norm = Normaliser(float(mask.sum()), 8.0, 1)
    spec = _loss(jsd_weight=0.5, jsd_beta=0.3)
    learner = _learner(tiny_model_path, use_reference=False, teacher_path=teacher_path)
    with torch.no_grad():  # expected: 0.5 * token mean of JSD_0.3 over the 7 unmasked rows' tokens
        student = response_logits(learner.module.eval(), batch.inputs)
        teacher = response_logits(learner.teacher.module, batch.inputs)
        jsd = algos.generalized_jsd(student, teacher, beta=0.3)
    learner.module.train()
    expect_sum = float(jsd[mask].sum())
    stats = learner.train_minibatch(batch, spec, norm, MicroBatching(3))
    assert stats["jsd_sum"] == pytest.approx(expect_sum, rel=1e-5)
    assert stats["loss"] == pytest.approx(0.5 * expect_sum / norm.num_tokens, rel=1e-5)
    assert stats["grad_norm"] > 0  # the JSD alone moves the student
    update = learner_online.UpdateSpec(estimator=GRPO, loss=spec, advantage=None, epochs=1, rows_per_minibatch=8,
                                       batching=MicroBatching(3), old_logprobs_before_update=False)
    out = learner_online._update_metrics(stats, 1, update, False, dict, dict, TokenCounts())
    assert out["algo/distill_jsd"] == pytest.approx(expect_sum / norm.num_tokens, rel=1e-5)


def test_jsd_at_masked_positions_does_not_matter():
    mb = step_batch(torch.tensor([[True, False]]), old_logprobs=torch.tensor([[-1.0, -1.0]]), advantages=torch.zeros(1, 2))
    spec = _loss(max_response_tokens=2, jsd_weight=2.0)
    lp = mb.old_logprobs.clone()
    a, stats = policy_objective(lp, mb, spec, Normaliser(1.0, 1.0), jsd=torch.tensor([[0.25, 1e6]]))
    b, _ = policy_objective(lp, mb, spec, Normaliser(1.0, 1.0), jsd=torch.tensor([[0.25, -3.0]]))
    assert float(a) == float(b) == pytest.approx(2.0 * 0.25)  # policy loss 0 (zero advantages) + 2 * 0.25
    assert float(stats["jsd_sum"]) == 0.25
    with pytest.raises(ValueError, match="jsd_weight > 0 needs the per-token JSD"):
        policy_objective(lp, mb, spec, Normaliser(1.0, 1.0))


def test_update_spec_from_the_teacher_section():
    base = {"teacher": {"path": "tiny-random@1", "weight": 0.7}}
    rkl = update_spec(config_from_dict(base), 1)
    assert rkl.distill_weight == 0.7 and rkl.old_logprobs_before_update and rkl.loss.jsd_weight == 0.0
    jsd = update_spec(config_from_dict({"teacher": {"path": "tiny-random@1", "weight": 0.7, "divergence": "jsd",
                                                    "beta": 0.2}}), 1)
    assert (jsd.distill_weight, jsd.loss.jsd_weight, jsd.loss.jsd_beta) == (0.0, 0.7, 0.2)
    assert not jsd.old_logprobs_before_update  # JSD needs no stage-4 forward of the student
    off = update_spec(config_from_dict({}), 1)
    assert (off.distill_weight, off.loss.jsd_weight) == (0.0, 0.0)


def test_learner_kwargs_hold_the_teacher_only_on_the_learner():
    from rlray.run.build import learner_kwargs

    on = config_from_dict({"teacher": {"path": "tiny-random@1"}})
    assert learner_kwargs(on, 1, teacher_dir="/t")["teacher_path"] == "/t"
    actor = config_from_dict({"teacher": {"path": "tiny-random@1"}, "resources": {"teacher": {"placement": "actor"}}})
    assert learner_kwargs(actor, 1, teacher_dir="/t")["teacher_path"] is None
    assert learner_kwargs(config_from_dict({}), 1, teacher_dir=None)["teacher_path"] is None
