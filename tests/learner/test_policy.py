"""Learner: logprobs under padding, gradient accumulation with global normalisers, weight export."""

import dataclasses

import pytest
import torch

from rlray import schema
from rlray.learner import LossSpec, Normaliser, OptimizerSpec, PolicyLearner, split_microbatches
from rlray.learner.batching import MicroBatching


def _table(pad_id: int):
    g = torch.Generator().manual_seed(0)
    rows = {k: [] for k in ("prompt_id", "group_id", "sample_index", "prompt_token_ids", "response_token_ids",
                            "response_mask", "rollout_logprobs", "reward", "reward_components", "policy_version",
                            "finish_reason")}
    # ragged prompts (3..9 tokens) and responses (1..12 tokens); the last row's response is fully masked
    for i in range(8):
        p_len, r_len = 3 + (i * 5) % 7, 1 + (i * 7) % 12
        rows["prompt_id"].append(f"p{i // 4}")
        rows["group_id"].append(i // 4)
        rows["sample_index"].append(i % 4)
        rows["prompt_token_ids"].append(torch.randint(10, 1000, (p_len,), generator=g).tolist())
        resp = torch.randint(10, 1000, (r_len,), generator=g).tolist()
        resp[-1] = pad_id  # responses end in EOS == pad: masks must not come from token values
        rows["response_token_ids"].append(resp)
        rows["response_mask"].append([i != 7] * r_len)
        rows["rollout_logprobs"].append([-1.0] * r_len)
        rows["reward"].append(float(i % 3))
        rows["reward_components"].append({})
        rows["policy_version"].append(0)
        rows["finish_reason"].append("stop")
    return schema.make_table(rows)


def _learner(path, **kw):
    args = dict(dtype="float32", optim=OptimizerSpec(lr=1e-3, max_grad_norm=1e9),
                temperature=1.0, use_reference=True)
    args.update(kw)
    return PolicyLearner(path, **args)


def test_logprobs_match_unpadded_forward(tiny_model_path, tiny_tokenizer):
    learner = _learner(tiny_model_path)
    table = _table(tiny_tokenizer.pad_token_id)
    batch = schema.collate(table, tiny_tokenizer.pad_token_id)
    lp = learner.logprobs(batch.inputs, reference=False, batching=MicroBatching(3))
    model = learner.module.eval()
    for b in (0, 3, 6):  # padded batch forward == each row alone, without padding
        ids = torch.tensor([table.column("prompt_token_ids")[b].as_py() + table.column("response_token_ids")[b].as_py()])
        n_resp = len(table.column("response_token_ids")[b].as_py())
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        expect = torch.log_softmax(logits[-n_resp - 1 : -1], -1).gather(-1, ids[0, -n_resp:, None])[:, 0]
        torch.testing.assert_close(lp[b, :n_resp], expect, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_reference_equals_initial_policy(tiny_model_path, tiny_tokenizer, dtype):
    learner = _learner(tiny_model_path, dtype=dtype)
    # under bf16 the reference keeps its linear weights in bf16 (the policy's stay float32), bit for bit the same
    linear = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    assert learner.reference.module.model.layers[0].mlp.up_proj.weight.dtype == linear
    assert learner.module.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
    batch = schema.collate(_table(tiny_tokenizer.pad_token_id), tiny_tokenizer.pad_token_id)
    a = learner.logprobs(batch.inputs, reference=False, batching=MicroBatching(8))
    b = learner.logprobs(batch.inputs, reference=True, batching=MicroBatching(8))
    assert torch.equal(a, b)


@pytest.mark.parametrize("microbatch", [1, 3, 8])
def test_gradient_accumulation_matches_full_batch(tiny_model_path, tiny_tokenizer, microbatch):
    pad = tiny_tokenizer.pad_token_id
    table = _table(pad)
    batch = schema.collate(table, pad)
    g = torch.Generator().manual_seed(1)
    batch.advantages = torch.randn(batch.inputs.response_ids.shape, generator=g) * batch.response_mask
    spec = LossSpec(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.05, kl_estimator="k3", loss_agg="token-mean",
                    max_response_tokens=16)
    norm = Normaliser(float(batch.response_mask.sum()), 8.0, 1)

    def grads(mb_size):
        learner = _learner(tiny_model_path)
        ref = learner.logprobs(batch.inputs, reference=True, batching=MicroBatching(8))
        b = dataclasses.replace(batch, ref_logprobs=ref)
        b.old_logprobs = ref + 0.05 * torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
        stats = learner.train_minibatch(b, spec, norm, MicroBatching(mb_size))
        return {n: p.grad.clone() for n, p in learner.module.named_parameters() if p.grad is not None}, stats

    full, s_full = grads(8)
    acc, s_acc = grads(microbatch)
    assert s_acc["tokens"] == s_full["tokens"] == norm.num_tokens
    assert s_acc["loss"] == pytest.approx(s_full["loss"], abs=1e-6)
    for name in full:
        torch.testing.assert_close(acc[name], full[name], atol=1e-6, rtol=1e-4, msg=name)


def test_split_microbatches_trims_padding(tiny_tokenizer):
    batch = schema.collate(_table(tiny_tokenizer.pad_token_id), tiny_tokenizer.pad_token_id)
    mbs = list(split_microbatches(batch, 3))
    assert [m.inputs.input_ids.shape[0] for m in mbs] == [3, 3, 2]
    for m in mbs:  # every kept column has at least one real token; response starts at the same column
        assert m.inputs.attention_mask[:, 0].any()
        t = m.inputs.response_ids.shape[1]
        assert m.inputs.attention_mask[:, -t:].sum(1).max() == t
        assert m.response_mask.shape[1] == m.rollout_logprobs.shape[1] == t  # per-token tensors trimmed alike


def test_export_weights_dtype_and_names(tiny_model_path):
    learner = _learner(tiny_model_path, use_reference=False)
    w = learner.export_weights(torch.bfloat16)
    assert set(w) == set(learner.module.state_dict())
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in w.values())


@pytest.mark.parametrize(("dtype", "estimator"), [("float32", "k1"), ("bfloat16", "k1"), ("float32", "k3")])
def test_first_step_takes_reference_logprobs_from_the_policy(tiny_model_path, tiny_tokenizer, dtype, estimator):
    """While the policy is still the reference (a run's first step) stage 4 makes no reference pass: the update takes
    its own detached logprobs as ref_logprobs, which gives the reference pass's step (KL 0, the same gradient: k1's is
    kl_coef x the logprobs' own, which a step without the KL term would lose) and leaves ``at_reference`` False after
    the optimizer step."""
    from types import SimpleNamespace

    from rlray.learner import online

    pad = tiny_tokenizer.pad_token_id
    batch = schema.collate(_table(pad), pad)
    batch.advantages = torch.randn(batch.inputs.response_ids.shape, generator=torch.Generator().manual_seed(3))
    batch.advantages = batch.advantages * batch.response_mask
    spec = LossSpec(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.5, kl_estimator=estimator, loss_agg="token-mean",
                    max_response_tokens=16)
    norm = Normaliser(float(batch.response_mask.sum()), 8.0, 1)
    stage4 = SimpleNamespace(batching=MicroBatching(3), distill_weight=0.0, old_logprobs_before_update=False)

    def step(learner, ref_logprobs):
        b = dataclasses.replace(batch, ref_logprobs=ref_logprobs)
        stats = learner.train_minibatch(b, spec, norm, MicroBatching(3))
        return stats, {n: p.grad.clone() for n, p in learner.module.named_parameters()}

    reused, passed = _learner(tiny_model_path, dtype=dtype), _learner(tiny_model_path, dtype=dtype)
    assert reused.at_reference and passed.at_reference
    calls = []
    reused.reference.logprobs = lambda *a, **k: calls.append(a)  # a reference pass would be recorded here
    assert online.reference_and_old(reused, dataclasses.replace(batch), stage4).ref_logprobs is None and not calls
    s_reused, g_reused = step(reused, None)
    s_passed, g_passed = step(passed, passed.logprobs(batch.inputs, reference=True, batching=MicroBatching(3)))
    assert s_reused["kl_sum"] == 0.0  # exactly: the KL of a logprob against itself
    assert abs(s_passed["kl_sum"]) < 1e-4 * norm.num_tokens and s_reused["tokens"] == s_passed["tokens"]
    assert s_reused["loss"] == pytest.approx(s_passed["loss"], abs=1e-5)
    for name in g_reused:
        torch.testing.assert_close(g_reused[name], g_passed[name], atol=1e-5, rtol=1e-3, msg=name)
    assert not reused.at_reference and not passed.at_reference  # the weights moved: step 2 makes its reference pass
    del reused.reference.logprobs
    got = online.reference_and_old(reused, dataclasses.replace(batch), stage4).ref_logprobs
    torch.testing.assert_close(got, passed.logprobs(batch.inputs, reference=True, batching=MicroBatching(3)))
    # old logprobs taken before the update (off-policy, or the KL in the reward): they are the reference's too
    fresh = _learner(tiny_model_path, dtype=dtype)
    off = online.reference_and_old(fresh, dataclasses.replace(batch), SimpleNamespace(**{**vars(stage4), "old_logprobs_before_update": True}))
    assert off.ref_logprobs is off.old_logprobs
    assert torch.equal(off.ref_logprobs, fresh.logprobs(batch.inputs, reference=True, batching=MicroBatching(3)))


def test_at_reference_holds_only_for_an_untouched_full_weight_learner(tiny_model_path):
    assert not _learner(tiny_model_path, use_reference=False).at_reference  # no reference to be equal to
    lora = _learner(tiny_model_path, lora={"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj"]})
    assert lora.has_reference and not lora.at_reference  # the reference is the base with the adapters off
    restored = _learner(tiny_model_path)
    restored.load_state_dict(restored.state_dict())  # restore_learner loads a snapshot's weights with this state
    assert not restored.at_reference
    # a reference actor's copy of the same folder (resources.reference.placement=actor): no copy here, the same rule
    elsewhere = _learner(tiny_model_path, use_reference=False, reference_elsewhere=True)
    assert elsewhere.reference is None and not elsewhere.has_reference and elsewhere.at_reference
    lora_elsewhere = _learner(tiny_model_path, use_reference=False, reference_elsewhere=True,
                              lora={"rank": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj"]})
    assert not lora_elsewhere.at_reference


def test_with_the_reference_in_an_actor_the_first_step_takes_the_policys_logprobs_as_the_reference(tiny_model_path,
                                                                                                    tiny_tokenizer):
    """resources.reference.placement=actor: at a run's first step (no actor call, ``frozen_logprobs``) the update
    takes its own detached logprobs as ref_logprobs: the step of a learner given the actor's (here: the same model's)
    logprobs, KL exactly 0."""
    pad = tiny_tokenizer.pad_token_id
    batch = schema.collate(_table(pad), pad)
    batch.advantages = torch.randn(batch.inputs.response_ids.shape, generator=torch.Generator().manual_seed(5))
    batch.advantages = batch.advantages * batch.response_mask
    spec = LossSpec(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.5, kl_estimator="k1", loss_agg="token-mean",
                    max_response_tokens=16)
    norm = Normaliser(float(batch.response_mask.sum()), 8.0, 1)
    reused = _learner(tiny_model_path, use_reference=False, reference_elsewhere=True)
    given = _learner(tiny_model_path, use_reference=False, reference_elsewhere=True)
    actor_logprobs = given.logprobs(batch.inputs, reference=False, batching=MicroBatching(3))  # the actor's model
    s_reused = reused.train_minibatch(dataclasses.replace(batch), spec, norm, MicroBatching(3))
    s_given = given.train_minibatch(dataclasses.replace(batch, ref_logprobs=actor_logprobs), spec, norm, MicroBatching(3))
    assert s_reused["kl_sum"] == 0.0 and s_reused["loss"] == pytest.approx(s_given["loss"], abs=1e-5)
    for (name, a), (_, b) in zip(reused.module.named_parameters(), given.module.named_parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-3, msg=name)
    assert not reused.at_reference  # step 2 asks the actor
