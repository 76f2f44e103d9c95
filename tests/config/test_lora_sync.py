"""rollout.lora_sync (issue 28): what a weight sync ships for a LoRA policy, resolved by ``Config.adapter_sync``."""

from __future__ import annotations

import pytest

from rlray.config import ConfigError, config_from_dict

GPUS = {"resources": {"rollout": {"gpus": 1}, "learner": {"gpus": 1}}}


@pytest.mark.parametrize(
    ("tree", "adapter", "backend"),
    [
        ({}, False, "object_store"),  # no LoRA: every sync is merged
        ({**GPUS}, False, "nccl"),
        ({"model": {"lora": {"rank": 16}}}, False, "object_store"),  # on CPU vLLM's LoRA kernels cost more than a sync
        ({"model": {"lora": {"rank": 16}}, "rollout": {"lora_sync": "adapter"}}, True, "object_store"),
        ({"model": {"lora": {"rank": 16}}, **GPUS}, True, "object_store"),  # GPUs: the adapter, through the object store
        ({"model": {"adapter_path": "ckpt/adapter"}, **GPUS}, True, "object_store"),
        ({"model": {"lora": {"rank": 16}}, "rollout": {"lora_sync": "merged"}, **GPUS}, False, "nccl"),
        ({"model": {"lora": {"rank": 16}}, "rollout": {"weight_sync": "nccl"}, **GPUS}, False, "nccl"),
        # a delta sync (rollout.weight_payload) ships merged weights through the object store
        ({"model": {"lora": {"rank": 16}}, "rollout": {"weight_payload": "delta"}, **GPUS}, False, "object_store"),
        ({"rollout": {"weight_payload": "delta"}, **GPUS}, False, "object_store"),
        # a sharded (FSDP2) learner pushes merged weights, gathered on rank 0
        ({"model": {"lora": {"rank": 16}}, "resources": {"rollout": {"gpus": 1},
                                                         "learner": {"gpus": 1, "strategy": "fsdp"}}}, False, "nccl"),
    ],
)
def test_auto_ships_the_adapter_of_a_lora_policy_to_gpu_engines_unless_told_otherwise(tree, adapter, backend):
    cfg = config_from_dict(tree)
    assert cfg.adapter_sync is adapter and cfg.weight_sync_backend == backend


def test_an_adapter_sync_without_lora_is_refused():
    with pytest.raises(ConfigError, match="rollout.lora_sync='adapter' ships a LoRA adapter, but the policy trains "
                                          "every weight; set model.lora.rank>0 or model.adapter_path"):
        config_from_dict({"rollout": {"lora_sync": "adapter"}})


def test_an_adapter_sync_over_nccl_is_refused():
    tree = {"model": {"lora": {"rank": 8}}, "rollout": {"lora_sync": "adapter", "weight_sync": "nccl"}, **GPUS}
    with pytest.raises(ConfigError, match="rollout.lora_sync='adapter' ships the adapter through the object store, "
                                          "not rollout.weight_sync='nccl'"):
        config_from_dict(tree)



@pytest.mark.parametrize("model", [{"lora": {"rank": 8}}, {"adapter_path": "ckpt/adapter"}])
def test_an_adapter_sync_from_a_sharded_learner_is_refused_before_ray_starts(model):
    # LoRA and model.adapter_path train under FSDP2 (tests/learner/test_fsdp.py); only the adapter-only push is refused
    tree = {"model": model, "rollout": {"lora_sync": "adapter"},
            "resources": {"learner": {"num_workers": 2, "strategy": "fsdp"}}}
    with pytest.raises(ConfigError, match="rollout.lora_sync='adapter' with resources.learner.strategy='fsdp': a "
                                          "sharded learner pushes merged weights gathered on rank 0; set "
                                          "rollout.lora_sync=merged or auto"):
        config_from_dict(tree)


@pytest.mark.parametrize("rollout", [{"weight_payload": "delta", "weight_sync": "nccl"},
                                     {"weight_payload": "delta", "lora_sync": "adapter"}])
def test_a_delta_sync_over_nccl_or_of_an_adapter_is_refused(rollout):
    tree = {"model": {"lora": {"rank": 8}}, "rollout": rollout, **GPUS}
    with pytest.raises(ConfigError, match="rollout.weight_payload='delta' goes through the object store with merged "
                                          "weights"):
        config_from_dict(tree)
