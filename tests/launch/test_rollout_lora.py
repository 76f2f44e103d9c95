"""The rollout engine's LoRA arguments of an adapter-only weight sync (``rlray.launch.actors.adapter_engine_kwargs``,
issue 28): the adapter's rank, and a slot for every policy version an async step may still sample with."""

from __future__ import annotations

import json

from rlray.config import config_from_dict
from rlray.launch.actors import adapter_engine_kwargs, rollout_engine_kwargs
from rlray.plan import resolve_plan


def test_the_engine_gets_the_rank_and_a_slot_per_version_in_flight(tmp_path):
    cfg = resolve_plan(config_from_dict({"model": {"lora": {"rank": 16}},
                                         "rollout": {"max_staleness": 2, "lora_sync": "adapter"}}))
    assert adapter_engine_kwargs(cfg) == {"lora_rank": 16, "lora_slots": 4}
    kwargs = rollout_engine_kwargs(cfg, 512)
    assert (kwargs["lora_rank"], kwargs["lora_slots"], kwargs["weight_transfer"]) == (16, 4, None)
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "rank_pattern": {"q_proj": 32}}))
    assert adapter_engine_kwargs(resolve_plan(config_from_dict({"model": {"adapter_path": str(folder)},
                                                                "rollout": {"lora_sync": "adapter"}}))) == {
        "lora_rank": 32, "lora_slots": 2}  # the largest rank of the adapter's own config
    assert adapter_engine_kwargs(resolve_plan(config_from_dict({"model": {"lora": {"rank": 16}}}))) == {}  # auto on CPU: merged
    assert "lora_rank" not in rollout_engine_kwargs(resolve_plan(config_from_dict({})), 512)
