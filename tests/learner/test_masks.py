"""Masks through the real learner: truncated responses, pad == eos, and masks that never come from token values."""

import dataclasses

import pytest
import torch

from rlray import schema
from rlray.data import PromptRow
from rlray.learner import LossSpec, Normaliser, OptimizerSpec, PolicyLearner
from rlray.learner.batching import MicroBatching
from rlray.rollout import Completion
from rlray.run.experience import build_experience


def _learner(path):
    return PolicyLearner(path, dtype="float32", optim=OptimizerSpec(lr=1e-3, max_grad_norm=1e9),
                         temperature=1.0, use_reference=True)  # fmt: skip


def _experience(eos: int):
    """Two prompts x 2 samples: a truncated response (no EOS), EOS-terminated ones, and one with EOS inside."""
    rows = [PromptRow("p0", "q0", {"answer": "1"}), PromptRow("p1", "q1", {"answer": "2"})]
    prompt_ids = [[11, 12, 13], [21, 22, 23, 24, 25]]
    completions = [
        Completion(0, 0, [101, 102, 103, 104, 105, 106], [-1.0] * 6, "length", 0),  # hit max_new_tokens: no EOS
        Completion(0, 1, [201, eos], [-1.0] * 2, "stop", 0),
        Completion(1, 0, [301, eos, 302, eos], [-1.0] * 4, "stop", 0),  # a generated EOS mid-response counts
        Completion(1, 1, [eos], [-1.0], "stop", 0),  # only EOS
    ]
    rewards = {"reward": [1.0, 0.0, 0.5, 0.2], "accuracy": [0.0] * 4, "format": [0.0] * 4}
    return build_experience(rows, prompt_ids, completions, rewards), [len(c.response_token_ids) for c in completions]


def test_response_mask_covers_exactly_the_generated_tokens(tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    assert tiny_tokenizer.pad_token_id == eos  # SmolLM2's tokenizer: pad == eos
    table, lengths = _experience(eos)
    batch = schema.collate(table, tiny_tokenizer.pad_token_id)
    t = max(lengths)
    expected = torch.tensor([[i < n for i in range(t)] for n in lengths])
    assert torch.equal(batch.response_mask, expected)
    # the truncated row (no EOS) is masked exactly over its 6 generated tokens; the EOS-only row over its 1
    assert batch.response_mask[0].sum() == 6 and batch.response_mask[3].tolist() == [True] + [False] * 5
    # attention covers prompt + response; every EOS == pad inside a response is attended to
    assert batch.inputs.attention_mask.sum(1).tolist() == [3 + 6, 3 + 2, 5 + 4, 5 + 1]


def _loss_and_grads(learner, batch):
    spec = LossSpec(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.05, kl_estimator="k3", loss_agg="token-mean",
                    max_response_tokens=8)
    batch = dataclasses.replace(batch)
    batch.ref_logprobs = learner.logprobs(batch.inputs, reference=True, batching=MicroBatching(4))
    batch.advantages = torch.where(batch.response_mask, batch.reward[:, None] - 0.4, 0.0)
    norm = Normaliser(float(batch.response_mask.sum()), 4.0)
    stats = learner.train_minibatch(batch, spec, norm, batching=MicroBatching(2))
    grads = {n: p.grad.clone() for n, p in learner.module.named_parameters() if p.grad is not None}
    return stats, grads


def test_masks_never_come_from_token_values(tiny_model_path, tiny_tokenizer):
    """Padding the same experience with EOS (== pad) or with an unrelated token gives the same loss and gradient."""
    eos = tiny_tokenizer.eos_token_id
    table, _ = _experience(eos)
    with_eos = schema.collate(table, eos)
    with_other = schema.collate(table, 777)
    assert not torch.equal(with_eos.inputs.input_ids, with_other.inputs.input_ids)  # the pads really differ
    assert torch.equal(with_eos.response_mask, with_other.response_mask)
    assert torch.equal(with_eos.inputs.attention_mask, with_other.inputs.attention_mask)
    s1, g1 = _loss_and_grads(_learner(tiny_model_path), with_eos)
    s2, g2 = _loss_and_grads(_learner(tiny_model_path), with_other)
    assert s1["tokens"] == s2["tokens"] == 13.0  # 6 + 2 + 4 + 1 generated tokens, EOS included
    assert s1["loss"] == pytest.approx(s2["loss"], abs=1e-6)
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], atol=1e-6, rtol=1e-5, msg=name)


def test_eos_tokens_inside_responses_get_logprobs(tiny_model_path, tiny_tokenizer):
    """With pad == eos, a generated EOS still gets its logprob (it is a real, attended token)."""
    eos = tiny_tokenizer.eos_token_id
    table, _ = _experience(eos)
    batch = schema.collate(table, eos)
    lp = _learner(tiny_model_path).logprobs(batch.inputs, reference=False, batching=MicroBatching(4))
    model = _learner(tiny_model_path).module.eval()
    ids = torch.tensor([[21, 22, 23, 24, 25, 301, eos, 302, eos]])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    expect = torch.log_softmax(logits[4:8], -1).gather(-1, ids[0, 5:, None])[:, 0]  # row 2's 4 response tokens
    torch.testing.assert_close(lp[2, :4], expect, atol=1e-5, rtol=0)
