"""Learner options of the distributed topology: LoRA (merged export), the reference model on its
own, the 8-bit optimizer's CPU error, and truncated importance sampling in the objective."""

from __future__ import annotations

import dataclasses
import importlib.util
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlray import algos, schema
from rlray.learner import LossSpec, Normaliser, OptimizerSpec, PolicyLearner, policy_objective
from rlray.learner.batching import MicroBatching
from rlray.learner.policy import make_optimizer
from rlray.learner.reference import ReferenceModel
from rlray.rollout.engine import checkpoint_shapes
from tests.learner.batches import step_batch

LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear"}
SPEC = LossSpec(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.0, kl_estimator="k3", loss_agg="token-mean",
                max_response_tokens=16)


def _batch(pad_id: int) -> schema.StepBatch:
    g = torch.Generator().manual_seed(1)
    n = 4
    resp = [torch.randint(10, 900, (3 + i,), generator=g).tolist() for i in range(n)]
    table = schema.make_table({
        "prompt_id": ["p0"] * 2 + ["p1"] * 2, "group_id": [0, 0, 1, 1], "sample_index": [0, 1, 0, 1],
        "prompt_token_ids": [torch.randint(10, 900, (4 + i,), generator=g).tolist() for i in range(n)],
        "response_token_ids": resp, "response_mask": [[True] * len(r) for r in resp],
        "rollout_logprobs": [[-2.0] * len(r) for r in resp], "reward": [1.0, 0.0, 0.5, 0.0],
        "reward_components": [{}] * n, "policy_version": [0] * n, "finish_reason": ["length"] * n,
    })
    data = schema.collate(table, pad_id)
    data.advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None] * data.response_mask
    return data


def _learner(path: str, **kw) -> PolicyLearner:
    return PolicyLearner(path, dtype="float32", optim=OptimizerSpec(lr=5e-2, max_grad_norm=1e9),
                         temperature=1.0, use_reference=True, **kw)


def test_lora_trains_adapters_only_and_exports_merged_weights(tiny_model_path, tiny_tokenizer):
    learner = _learner(tiny_model_path, lora=LORA)
    trainable = [n for n, p in learner.module.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    data = _batch(tiny_tokenizer.pad_token_id)
    before = learner.logprobs(data.inputs, reference=False, batching=MicroBatching(4))
    learner.train_minibatch(data, SPEC, Normaliser(float(data.response_mask.sum()), 4.0), MicroBatching(2))
    learner.train_minibatch(data, SPEC, Normaliser(float(data.response_mask.sum()), 4.0), MicroBatching(2))
    after = learner.logprobs(data.inputs, reference=False, batching=MicroBatching(4))
    assert (after - before).abs().max() > 1e-3  # the adapters learned something

    merged = learner.export_weights(torch.float32)
    shapes = checkpoint_shapes(tiny_model_path)
    assert set(merged) - {"lm_head.weight"} == set(shapes) - {"lm_head.weight"}
    assert all(tuple(merged[k].shape) == shapes[k] for k in shapes if k in merged)
    # a plain transformers model with the merged weights scores exactly like the adapted policy
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    plain.load_state_dict(merged, strict=False)
    from rlray.learner.scoring import batched_logprobs

    via_merged = batched_logprobs(plain, data.inputs, dtype="float32", temperature=1.0, batching=MicroBatching(4))
    torch.testing.assert_close(via_merged, after, atol=1e-5, rtol=0)
    # the reference is the base model (adapters off): the initial policy's logprobs, no copy kept
    assert learner.reference is None
    torch.testing.assert_close(learner.logprobs(data.inputs, reference=True, batching=MicroBatching(4)), before, atol=1e-6, rtol=0)


def test_reference_model_equals_the_learner_reference(tiny_model_path, tiny_tokenizer):
    data = _batch(tiny_tokenizer.pad_token_id)
    learner = _learner(tiny_model_path)
    own = ReferenceModel(tiny_model_path, dtype="float32", temperature=0.7, torch_threads=torch.get_num_threads())
    learner.temperature = 0.7
    torch.testing.assert_close(own.logprobs(data.inputs, MicroBatching(3)), learner.logprobs(data.inputs, reference=True, batching=MicroBatching(3)),
                               atol=1e-6, rtol=0)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is not None, reason="bitsandbytes is installed")
def test_8bit_optimizer_without_bitsandbytes_names_the_key():
    with pytest.raises(ImportError, match="learner.optimizer=adamw_8bit needs bitsandbytes"):
        make_optimizer("adamw_8bit", [torch.nn.Parameter(torch.zeros(2))], lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)


def test_truncated_importance_weights_scale_the_policy_loss():
    # one sequence, 2 tokens; on-policy ratio 1; advantages 1; old - rollout = [ln 1.5, ln 3]
    # weights min(1.5, 2) = 1.5 and min(3, 2) = 2; token-mean pg loss = -(1.5 + 2) / 2 = -1.75
    lp = torch.zeros(1, 2, requires_grad=True)
    mb = step_batch(torch.ones(1, 2, dtype=torch.bool), old_logprobs=torch.zeros(1, 2), advantages=torch.ones(1, 2),
                    rollout_logprobs=torch.tensor([[-math.log(1.5), -math.log(3.0)]]))
    norm = Normaliser(2.0, 1.0)
    off, _ = policy_objective(lp, mb, SPEC, norm)
    on, _ = policy_objective(lp, mb, dataclasses.replace(SPEC, correction="token_truncate", correction_max=2.0), norm)
    assert off.item() == pytest.approx(-1.0, abs=1e-6)
    assert on.item() == pytest.approx(-1.75, abs=1e-6)
    w, _ = algos.rollout_correction_weights(
        mb.old_logprobs, mb.rollout_logprobs, mb.response_mask, mode="token_truncate", ratio_max=2.0
    )
    assert w[0].tolist() == pytest.approx([1.5, 2.0])


def test_logged_kl_is_k3_whatever_the_loss_estimator():
    # ref - logprobs = d = [0.5, -0.2]; k3 = exp(d) - 1 - d = [0.148721, 0.018731]; k1 = -d = [-0.5, 0.2]
    lp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    mb = step_batch(torch.ones(1, 2, dtype=torch.bool), old_logprobs=torch.zeros(1, 2), advantages=torch.zeros(1, 2),
                    ref_logprobs=torch.tensor([[0.5, -0.2]]))
    norm = Normaliser(2.0, 1.0)
    k1_loss = dataclasses.replace(SPEC, kl_coef=1.0, kl_estimator="k1")
    loss, stats = policy_objective(lp, mb, k1_loss, norm)
    assert loss.item() == pytest.approx((-0.5 + 0.2) / 2, abs=1e-6)  # the loss uses k1 (advantages are 0)
    expect_k3 = (math.exp(0.5) - 1 - 0.5) + (math.exp(-0.2) - 1 + 0.2)
    assert stats["kl_sum"].item() == pytest.approx(expect_k3, abs=1e-6)  # the logged KL is k3


def test_an_existing_adapter_trains_from_its_saved_weights(tiny_model_path, tiny_tokenizer, tmp_path):
    from peft import LoraConfig, get_peft_model

    from rlray.models import load_causal_lm

    start = get_peft_model(load_causal_lm(tiny_model_path), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    with torch.no_grad():
        for name, param in start.named_parameters():
            if "lora_B" in name:
                param.fill_(0.01)  # non-zero, so the adapter changes the policy
    start.save_pretrained(tmp_path / "adapter")
    data = _batch(tiny_tokenizer.pad_token_id)
    expected = start.eval()
    learner = _learner(tiny_model_path, adapter_path=str(tmp_path / "adapter"))
    trainable = [n for n, p in learner.module.named_parameters() if p.requires_grad]
    assert len(trainable) == 4 and all("lora_" in n for n in trainable)  # 2 layers x q_proj x (A, B)
    from rlray.learner.scoring import batched_logprobs

    before = learner.logprobs(data.inputs, reference=False, batching=MicroBatching(4))
    torch.testing.assert_close(before, batched_logprobs(expected, data.inputs, dtype="float32", temperature=1.0,
                                                        batching=MicroBatching(4)), atol=1e-6, rtol=0)  # fmt: skip
    base = learner.logprobs(data.inputs, reference=True, batching=MicroBatching(4))  # the reference is model.path without the adapter
    assert (before - base).abs().max() > 1e-4
    learner.train_minibatch(data, SPEC, Normaliser(float(data.response_mask.sum()), 4.0), MicroBatching(2))
    after = learner.logprobs(data.inputs, reference=False, batching=MicroBatching(4))
    assert (after - before).abs().max() > 1e-3  # it trains


def test_lora_and_adapter_path_together_are_refused(tiny_model_path):
    with pytest.raises(ValueError, match="pass lora or adapter_path, not both"):
        _learner(tiny_model_path, lora=LORA, adapter_path="/nonexistent")


def test_a_lora_snapshot_restores_the_trained_adapter(tiny_model_path, tiny_tokenizer, tmp_path):
    from rlray.checkpoint.contents import load_model_weights

    data = _batch(tiny_tokenizer.pad_token_id)
    trained = _learner(tiny_model_path, lora=LORA)
    trained.train_minibatch(data, SPEC, Normaliser(float(data.response_mask.sum()), 4.0), MicroBatching(2))
    trained.module.save_pretrained(tmp_path / "model", safe_serialization=True)  # what a snapshot's model/ holds
    want = trained.logprobs(data.inputs, reference=False, batching=MicroBatching(4))
    fresh = _learner(tiny_model_path, lora=LORA)
    assert (fresh.logprobs(data.inputs, reference=False, batching=MicroBatching(4)) - want).abs().max() > 1e-3
    load_model_weights(fresh.module, tmp_path / "model")
    torch.testing.assert_close(fresh.logprobs(data.inputs, reference=False, batching=MicroBatching(4)), want, atol=1e-6, rtol=0)
    with pytest.raises(RuntimeError, match="the snapshot holds a LoRA adapter but the policy has none"):
        load_model_weights(_learner(tiny_model_path).module, tmp_path / "model")
