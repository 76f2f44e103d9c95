"""Two Ray Train learner workers (DDP on gloo) give the same update as one worker on the same batch.

Each rank gets its shard through ``rlray.run.online.distribute`` (Arrow in the object store); mini-batch
normalisers are global, so the DDP-averaged gradient equals the full-batch gradient.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlray import schema
from rlray.config import Config, config_from_dict
from rlray.plan import resolve_plan

pytestmark = pytest.mark.ray


def _config(world: int) -> Config:
    return config_from_dict({
        "model": {"dtype": "float32"},
        "rollout": {"samples_per_prompt": 2, "max_new_tokens": 6},
        "learner": {"prompts_per_step": 4, "sequences_per_minibatch": 8, "sequences_per_microbatch": 2,
                    "lr": 1e-3, "torch_threads": 1},
        "algo": {"kl_coef": 0.1},
        "resources": {"learner": {"num_workers": world}},
    })


def _table(seed: int = 0):
    """Returns an 8-row experience table (4 groups of 2 samples of one prompt each, as a rollout gives them) with
    ragged random prompts and responses; each micro-batch of 2 rows is one group, so the learner computes its
    prompt once (``rlray.learner.logprobs._shared_prompt_logits``) under DDP too."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, 500, (3 + k,), generator=g).tolist() for k in range(4)]
    rows = []
    for i in range(8):
        t = 2 + (i * 3) % 5
        rows.append((prompts[i // 2], torch.randint(5, 500, (t,), generator=g).tolist()))
    return schema.make_table({
        "prompt_id": [f"p{i // 2}" for i in range(8)], "group_id": [i // 2 for i in range(8)],
        "sample_index": [i % 2 for i in range(8)], "prompt_token_ids": [p for p, _ in rows],
        "response_token_ids": [r for _, r in rows], "response_mask": [[True] * len(r) for _, r in rows],
        "rollout_logprobs": [[-1.0] * len(r) for _, r in rows],
        "reward": torch.rand(8, generator=g).tolist(), "reward_components": [{} for _ in range(8)],
        "policy_version": [0] * 8, "finish_reason": ["length"] * 8,
    })


def update_once(loop_config: dict) -> None:
    """One update (stages 4-6) on this rank; rank 0 writes the new weights, gradients and metrics."""
    from rlray.learner import PolicyLearner
    from rlray.learner import online as learner_online
    from rlray.learner.collective import current_collective
    from rlray.run import build
    from rlray.run.experience import Experience
    from rlray.run.online import OnlineRun, distribute, reference_and_old_logprobs

    cfg = Config.model_validate(loop_config["config"])
    coll = current_collective()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    learner = PolicyLearner(loop_config["model_dir"], **build.learner_kwargs(cfg, coll.world))
    ctx = OnlineRun(resolve_plan(cfg), coll, learner, None, pad_token_id=0)
    spec = build.update_spec(cfg, coll.world)
    shard, batch = distribute(ctx, Experience(_table(), {}, []) if coll.rank == 0 else None)
    data = reference_and_old_logprobs(ctx, schema.collate(shard, 0), spec)
    data = learner_online.advantages(data, spec, coll.all_reduce_sum)
    metrics = learner_online.update(learner, data, batch.minibatch_norms, spec, coll.all_reduce_sum)
    # on every rank: under FSDP (tests/run/test_gpu_dist.py) both gather the shards, a collective
    weights = learner.export_weights(torch.float32)
    grads = {n: _whole(p.grad).contiguous() for n, p in learner.module.named_parameters()}
    if coll.rank == 0:
        out = Path(loop_config["out"])
        save_file({k: v.clone() for k, v in weights.items()}, str(out / "weights.safetensors"))
        save_file(grads, str(out / "grads.safetensors"))
        (out / "metrics.json").write_text(json.dumps({**metrics, "rows": shard.num_rows}))
    coll.barrier()


def _whole(t: torch.Tensor) -> torch.Tensor:
    """Returns a DTensor gathered whole (an FSDP2 gradient shard; a collective), a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _run_one_worker(model_dir: str, out: Path) -> None:
    out.mkdir()
    update_once({"config": _config(1).model_dump(mode="json"), "model_dir": model_dir, "out": str(out)})


def _run_two_workers(model_dir: str, out: Path) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    out.mkdir()
    TorchTrainer(
        update_once,
        train_loop_config={"config": _config(2).model_dump(mode="json"), "model_dir": model_dir, "out": str(out)},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.25}),
        run_config=RunConfig(name="ddp-equivalence", storage_path=str(out / "ray_train")),
    ).fit()


def test_two_learner_workers_equal_one(ray_session, tmp_path, tiny_model_path):
    _run_one_worker(tiny_model_path, tmp_path / "one")
    _run_two_workers(tiny_model_path, tmp_path / "two")
    one, two = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("one", "two"))
    assert (one["rows"], two["rows"]) == (8, 4)  # rank 0 of 2 fetched only its own shard
    for key in ("learner/loss", "learner/pg_loss", "algo/kl", "learner/grad_norm"):
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
    g1, g2 = load_file(str(tmp_path / "one/grads.safetensors")), load_file(str(tmp_path / "two/grads.safetensors"))
    # the DDP-averaged gradient is the full-batch gradient: float32 sums of two halves then an all-reduce, against one
    # sum (rounding ~1e-7 relative; rtol 1e-4 is room for any backend, atol 1e-7 judges elements near zero)
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=1e-4, atol=1e-7)
    w1, w2 = load_file(str(tmp_path / "one/weights.safetensors")), load_file(str(tmp_path / "two/weights.safetensors"))
    before = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    moved = max((w1[k] - before[k]).abs().max().item() for k in before)
    assert moved > 1e-4  # the update is real (lr 1e-3)
    diff = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    assert diff < 1e-3 * moved  # the same update up to float32 reduction order (measured 4e-9 = 2 ulp vs 1e-3)
