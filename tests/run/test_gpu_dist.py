"""GPU paths of the distributed topology: NCCL and CUDA-IPC weight sync through vLLM's weight-transfer
API, FSDP against DDP, and the 8-bit optimizer. They need at least 2 GPUs, vLLM (GPU build) and Ray,
and run with ``pytest -m gpu tests/run/test_gpu_dist.py`` on such a machine.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

GPUS = torch.cuda.device_count()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.ray,
    pytest.mark.skipif(GPUS < 2, reason=f"needs at least 2 GPUs, found {GPUS}"),
]


class TrainerProbe:
    """A GPU process that plays learner rank 0: holds a PolicyLearner on cuda and pushes its weights."""

    def __init__(self, model_path: str, actors: list, backend: str) -> None:
        from rlray.learner import OptimizerSpec, PolicyLearner
        from rlray.rollout.fleet import RolloutFleet
        from rlray.rollout.weight_sync import VllmTransferSync

        torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
        self.learner = PolicyLearner(model_path, dtype="float32", optim=OptimizerSpec(lr=1e-3, max_grad_norm=1.0),
                                     temperature=1.0, use_reference=False)
        self.learner.module.cuda()
        self.fleet = RolloutFleet(actors)
        self.sync = VllmTransferSync(self.fleet, backend, torch.float32, tensor_parallel_size=1)

    def perturb_and_push(self, version: int) -> dict[str, torch.Tensor]:
        """Scales every weight matrix by 1.5 (a policy the engine must now use), pushes it, returns it (CPU)."""
        with torch.no_grad():
            for p in self.learner.module.parameters():
                if p.dim() == 2:
                    p.mul_(1.5)
        self.sync.push(self.learner, 0, version)
        return self.learner.export_weights(torch.float32)


def _engine_matches(model_path: str, actor, weights: dict, tokenizer) -> None:
    import ray
    from transformers import AutoModelForCausalLM

    from rlray.rollout import SamplingSpec

    prompt = tokenizer("What is 2 + 3?")["input_ids"]
    (got,) = ray.get(actor.generate.remote([prompt], SamplingSpec(n=1, max_new_tokens=8, temperature=0.0)))
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.load_state_dict(weights, strict=False)
    ids = torch.tensor([prompt + got.response_token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    expect = torch.log_softmax(logits, -1).gather(-1, torch.tensor(got.response_token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(got.rollout_logprobs), expect, atol=2e-3, rtol=0)


def _rollout_actor(model_path: str, transfer: str, gpus: float):
    import ray

    from rlray.launch.actors import RolloutActor

    kwargs = dict(dtype="float32", seed=0, max_model_len=256, backend="vllm", enforce_eager=True, kv_cache_gib=1.0,
                  gpu_memory_utilization=0.3, tensor_parallel_size=1, cpu_threads=None, weight_transfer=transfer)
    actor = ray.remote(RolloutActor).options(num_gpus=gpus, num_cpus=0.25).remote(model_path, kwargs)
    ray.get(actor.ready.remote())
    return actor


@pytest.mark.parametrize(("backend", "gpus"), [("nccl", 1.0), ("ipc", 0.5)])
def test_weight_transfer_reaches_the_engine(ray_session, tiny_model_path, tiny_tokenizer, backend, gpus):
    """nccl: trainer and engine on different GPUs; ipc: both on one GPU (0.5 each, Ray packs them)."""
    import ray

    actor = _rollout_actor(tiny_model_path, backend, gpus)
    trainer = ray.remote(TrainerProbe).options(num_gpus=gpus, num_cpus=0.25).remote(tiny_model_path, [actor], backend)
    try:
        weights = ray.get(trainer.perturb_and_push.remote(1))
        assert ray.get(actor.policy_version.remote()) == 1
        _engine_matches(tiny_model_path, actor, weights, tiny_tokenizer)
        weights = ray.get(trainer.perturb_and_push.remote(2))  # a second round on the same group
        assert ray.get(actor.policy_version.remote()) == 2
        _engine_matches(tiny_model_path, actor, weights, tiny_tokenizer)
    finally:
        ray.kill(trainer)
        ray.kill(actor)


def test_fsdp_two_workers_equal_ddp(ray_session, tmp_path, tiny_model_path):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from safetensors.torch import load_file

    spec = importlib.util.spec_from_file_location("ddp_update", Path(__file__).parents[1].joinpath("learner", "test_ddp.py"))
    ddp_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ddp_module)
    _config, update_once = ddp_module._config, ddp_module.update_once

    for strategy in ("ddp", "fsdp"):
        cfg = _config(2)
        cfg.resources.learner.gpus = 1
        cfg.resources.learner.strategy = strategy
        out = tmp_path / strategy
        out.mkdir()
        TorchTrainer(
            update_once,
            train_loop_config={"config": cfg.model_dump(mode="json"), "model_dir": tiny_model_path, "out": str(out)},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=True),
            run_config=RunConfig(name=f"gpu-{strategy}", storage_path=str(out / "ray_train")),
        ).fit()
    ddp, fsdp = (json.loads((tmp_path / s / "metrics.json").read_text()) for s in ("ddp", "fsdp"))
    assert fsdp["learner/loss"] == pytest.approx(ddp["learner/loss"], rel=1e-4)
    w1, w2 = (load_file(str(tmp_path / s / "weights.safetensors")) for s in ("ddp", "fsdp"))
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-5


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
def test_8bit_optimizer_step_on_cuda():
    from rlray.learner.policy import make_optimizer

    p = torch.nn.Parameter(torch.ones(64, 64, device="cuda"))
    opt = make_optimizer("adamw_8bit", [p], lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0)
    (p * 2).sum().backward()
    opt.step()
    assert torch.all(p < 1.0)  # every element moved against its positive gradient
