"""Several EOS ids (generation_config.json's eos_token_id list): the rollout stops on any of them, keeps
the EOS it stopped on, and the masks cover exactly the generated tokens. (No pad token, pad == eos and no
chat template: tests/models/test_loading.py and tests/learner/test_masks.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlray import schema
from rlray.data import PromptRow
from rlray.rollout import RolloutEngine
from rlray.rollout.hf_backend import HFBackend
from rlray.rollout.types import Completion, SamplingSpec
from rlray.run import experience

PROMPT = [1, 504, 3304, 314, 28, 216]
SEEDED = SamplingSpec(n=1, max_new_tokens=12, temperature=1.0, seed=3)  # the same draws in both runs


def test_the_rollout_stops_on_any_of_several_eos_ids(tmp_path, tiny_model_path):
    free = HFBackend(tiny_model_path, dtype="float32", seed=0).generate([PROMPT], SEEDED, 0)[0]
    ids = free.response_token_ids
    model_eos = json.loads((Path(tiny_model_path) / "config.json").read_text())["eos_token_id"]
    # the second stop id: the first token of the free run that is new and not the model's own EOS
    cut = next(t for t in range(2, len(ids)) if ids[t] not in ids[:t] and ids[t] != model_eos)
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_path, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [model_eos, ids[cut]]}))
    c = HFBackend(str(folder), dtype="float32", seed=0).generate([PROMPT], SEEDED, 0)[0]
    assert c.response_token_ids == ids[: cut + 1]  # stopped on the second id, and kept it
    assert c.finish_reason == "stop" and len(c.rollout_logprobs) == cut + 1
    assert c.rollout_logprobs == free.rollout_logprobs[: cut + 1]
    got = [c, Completion(0, 1, ids[:2], free.rollout_logprobs[:2], "stop", 0)]  # a shorter neighbour pads the batch
    # masks come from the completions (single-turn: all True): every generated token counts, the stop token included, nothing after it
    rewards = {"reward": [1.0, 0.0], "accuracy": [1.0, 0.0], "format": [0.0, 0.0]}
    table = experience.build_experience([PromptRow("p", "q", {"answer": "1"})], [PROMPT], got, rewards)
    batch = schema.collate(table, model_eos)
    assert batch.response_mask.tolist() == [[True] * (cut + 1), [True, True] + [False] * (cut - 1)]
    assert batch.inputs.response_ids[0].tolist() == ids[: cut + 1]


@pytest.mark.slow
def test_vllm_stops_on_any_of_several_eos_ids(tmp_path, tiny_model_path):
    """The vLLM backend reads the eos_token_id list of generation_config.json itself (vLLM adds the extra ids
    to each request's stop ids); greedy decoding matches the transformers backend, so the stop is known."""
    greedy = SamplingSpec(n=2, max_new_tokens=12, temperature=0.0)
    ids = HFBackend(tiny_model_path, dtype="float32", seed=0).generate([PROMPT], greedy, 0)[0].response_token_ids
    model_eos = json.loads((Path(tiny_model_path) / "config.json").read_text())["eos_token_id"]
    assert model_eos not in ids and len(ids) == 12  # greedy on the random model repeats one token, no EOS
    cut = 0  # so its first token is made the second EOS: the rollout stops right there
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_path, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [model_eos, ids[cut]]}))
    engine = RolloutEngine(str(folder), backend="vllm", dtype="float32", seed=0, max_model_len=64, kv_cache_gib=0.5,
                           cpu_threads="0-1")  # fmt: skip
    try:
        got = engine.generate([PROMPT], greedy)
    finally:
        engine.shutdown()
    assert [c.response_token_ids for c in got] == [ids[: cut + 1]] * 2
    assert [c.finish_reason for c in got] == ["stop", "stop"] and all(len(c.rollout_logprobs) == cut + 1 for c in got)
