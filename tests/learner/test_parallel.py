"""rlray.learner.parallel: the strategies' micro-batching rule by hand values, and the same weights and state-dict keys
from ``Single``, ``DDP`` and ``FSDP2`` for a tiny model (one-rank gloo group in this process; two ranks:
tests/learner/test_fsdp.py and tests/learner/test_ddp.py, marked ray)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from rlray.config import config_from_dict
from rlray.learner.batching import MicroBatching
from rlray.learner.lora import merged_lora_state_dict
from rlray.learner.parallel import (
    DDP,
    FSDP2,
    KINDS,
    MicroBatchLimits,
    Single,
    effective_micro_batching,
    parallel_kind,
    strategy_for,
)
from rlray.run.build import learner_kwargs
from tests.learner.test_policy import _learner


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fsdp_cuts_by_sequences_and_the_others_keep_the_token_budget():
    assert effective_micro_batching("fsdp", 4096, 8) == MicroBatchLimits(sequences=8, tokens=None)
    assert effective_micro_batching("fsdp", None, 8) == MicroBatchLimits(sequences=8, tokens=None)
    assert effective_micro_batching("ddp", 4096, 8) == MicroBatchLimits(sequences=8, tokens=4096)
    assert effective_micro_batching("single", 512, 2) == MicroBatchLimits(sequences=2, tokens=512)
    assert effective_micro_batching("single", None, 3) == MicroBatchLimits(sequences=3, tokens=None)
    with pytest.raises(ValueError, match="parallelism kind 'tp'"):
        effective_micro_batching("tp", 4096, 8)


def test_the_kind_follows_the_strategy_and_the_world():
    assert [parallel_kind("fsdp", 2), parallel_kind("fsdp", 1), parallel_kind("ddp", 4), parallel_kind("ddp", 1)] == [
        "fsdp", "single", "ddp", "single"]
    assert [strategy_for(k).kind for k in KINDS] == list(KINDS)
    assert (Single().sharded, DDP().sharded, FSDP2(mixed_precision=False).sharded) == (False, False, True)
    with pytest.raises(ValueError, match="parallelism kind 'tp'"):
        strategy_for("tp")


def test_a_strategy_applies_its_rule_to_a_micro_batching():
    budget = MicroBatching(sequences=4, tokens=100, packing="auto", share_prefixes=False)
    assert Single().micro_batching(budget) is budget and DDP().micro_batching(budget) is budget
    assert FSDP2(mixed_precision=False).micro_batching(budget) == dataclasses.replace(budget, tokens=None)
    rows = MicroBatching(sequences=4)
    assert FSDP2(mixed_precision=False).micro_batching(rows) is rows


def test_learner_kwargs_pick_the_strategy_by_world_and_config():
    fsdp = config_from_dict({"resources": {"learner": {"strategy": "fsdp"}}})
    assert isinstance(learner_kwargs(config_from_dict({}), 1)["parallel"], Single)
    assert isinstance(learner_kwargs(config_from_dict({}), 2)["parallel"], DDP)
    assert isinstance(learner_kwargs(fsdp, 1)["parallel"], Single)
    got = learner_kwargs(fsdp, 2)["parallel"]
    assert isinstance(got, FSDP2) and got.mixed_precision == (learner_kwargs(fsdp, 2)["dtype"] == "bfloat16")


def test_the_strategies_give_the_same_weights_and_state_keys(one_rank_group, tiny_model_path):
    learners = {
        "single": _learner(tiny_model_path, use_reference=False, parallel=Single()),
        "ddp": _learner(tiny_model_path, use_reference=False,
                        parallel=DDP(wrap_model=torch.nn.parallel.DistributedDataParallel)),
        "fsdp": _learner(tiny_model_path, use_reference=False, parallel=FSDP2(mixed_precision=False)),
    }
    assert isinstance(learners["ddp"].model, torch.nn.parallel.DistributedDataParallel)
    want = learners["single"].export_weights(torch.float32)
    saved = learners["single"].checkpoint_weights()
    tied = {"lm_head.weight"} if learners["single"].module.config.tie_word_embeddings else set()
    for name, learner in learners.items():
        got = learner.export_weights(torch.float32)
        assert list(got) == list(want), name
        assert all(torch.equal(got[k], want[k]) for k in want), name
        ckpt = learner.checkpoint_weights()  # FSDP2 leaves a tied name out, as save_pretrained does
        assert set(ckpt) <= set(saved) and all(torch.equal(ckpt[k], saved[k]) for k in ckpt), name
        assert set(saved) - set(ckpt) <= tied, name
        state = learner.state_dict()
        assert set(state) == ({"scheduler"} if learner.sharded else {"scheduler", "optimizer"}), name
        assert state["scheduler"] == learners["single"].state_dict()["scheduler"], name
        optimizer = learner.sharded_state_dict()["optimizer"]  # by parameter name, whatever the strategy
        assert set(optimizer["state"]) == set(learners["single"].sharded_state_dict()["optimizer"]["state"]), name


def test_a_lora_policy_exports_the_same_merged_weights_whole_or_sharded(one_rank_group, tiny_model_path):
    lora = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear"}
    plain = _learner(tiny_model_path, use_reference=False, lora=lora)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # peft starts lora_B at 0: nonzero adapters make the merge visible
        for name, param in plain.module.named_parameters():
            if "lora_" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=g))
    sharded = _learner(tiny_model_path, use_reference=False, lora=lora, parallel=FSDP2(mixed_precision=False))
    with torch.no_grad(), sharded.parallel.whole_into_shards():
        sharded.module.load_state_dict(plain.module.state_dict())
    want = merged_lora_state_dict(plain.module)
    got = sharded.export_weights(torch.float32)
    assert list(got) == list(plain.export_weights(torch.float32)) and set(got) == set(want)
    assert all(torch.allclose(got[k], want[k], rtol=0, atol=1e-6) for k in want)
    base = {k.replace(".base_layer.", "."): v for k, v in plain.module.get_base_model().state_dict().items()
            if "lora_" not in k}
    assert set(base) == set(want) and any(not torch.equal(want[k], base[k]) for k in want)  # the adapters are in
