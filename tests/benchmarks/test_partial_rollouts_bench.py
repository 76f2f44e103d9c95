"""benchmarks/partial_rollouts.py: the engine idle time it reports, the long-tailed model it builds (its next-token
probabilities are the ones its docstring gives), and its two runs differ in rollout.partial alone."""

from __future__ import annotations

import math

import pytest
import torch

from rlray.config import load_config
from tests.fixtures.bench import load_bench


@pytest.fixture(scope="module")
def bench():
    yield load_bench("partial_rollouts")


def test_idle_time_is_the_window_minus_the_calls(bench):
    # window [10, 20]; calls [8, 12] (2 s inside), [11, 13] (overlaps: 1 s more), [15, 16], [19, 25] (1 s inside)
    # covered 2 + 1 + 1 + 1 = 5 s, idle 10 - 5 = 5 s
    assert bench.idle_s([(15.0, 16.0), (8.0, 12.0), (19.0, 25.0), (11.0, 13.0)], 10.0, 20.0) == 5.0
    assert bench.idle_s([], 10.0, 20.0) == 10.0  # no call: idle throughout
    assert bench.idle_s([(0.0, 5.0), (21.0, 30.0)], 10.0, 20.0) == 10.0  # calls outside the window
    assert bench.idle_s([(9.0, 21.0), (12.0, 14.0)], 10.0, 20.0) == 0.0  # one call spans it


def test_the_long_tail_model_gives_the_documented_next_token_probabilities(bench, tmp_path, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    folder = bench.long_tail_model(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
    assert prompt[-1] == 198  # every prompt ends with the template's "\n"
    short, long = bench.SHORT_TOKENS[3], bench.LONG_TOKENS[5]
    with torch.no_grad():
        probs = [model(torch.tensor([prompt + tail])).logits[0, -1].softmax(-1) for tail in ([], [short], [long])]
    start, after_short, after_long = probs
    assert start[list(bench.LONG_TOKENS)].sum().item() == pytest.approx(1 / 8, abs=1e-3)  # starts long with 1/8
    assert start[list(bench.SHORT_TOKENS)].sum().item() == pytest.approx(7 / 8, abs=1e-3)
    assert after_short[2].item() == pytest.approx(0.2, abs=1e-4)  # EOS after a short token: 0.2
    assert after_short[list(bench.SHORT_TOKENS)].sum().item() == pytest.approx(0.8, abs=1e-4)
    assert after_long[list(bench.LONG_TOKENS)].sum().item() == pytest.approx(1.0, abs=1e-6)  # never EOS
    assert math.isclose(after_long[2].item(), 0.0, abs_tol=1e-9)
    assert model.config.tie_word_embeddings is False


def test_the_two_runs_differ_in_partial_rollouts_alone(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(bench.benchlib, "gsm8k_train_file", lambda: tmp_path / "train.jsonl")
    size = bench.SIZES["quick"]
    whole, partial = (load_config(bench.CONFIG, bench.overrides(m, size, "tiny-random", tmp_path)) for m in bench.MODES)
    assert (whole.rollout.partial, partial.rollout.partial) == (False, True)
    assert partial.rollout.partial_segment_tokens == size["segment_tokens"]
    assert whole.model_dump(exclude={"rollout"}) == partial.model_dump(exclude={"rollout"})
    differ = {"partial", "partial_segment_tokens"}
    assert whole.rollout.model_dump(exclude=differ) == partial.rollout.model_dump(exclude=differ)
    assert (partial.rollout.max_staleness, partial.resources.rollout.num_workers, partial.rollout.backend) == (1, 2, "hf")
    assert whole.learner.prompts_per_step * whole.rollout.samples_per_prompt == size["prompts_per_step"] * 4


def test_repeats_combine_into_medians_and_the_table_shows_each_mode(bench):
    fig = dict(wall_s=60.0, load_1m=2.0, steps=10, step_s=2.0, rollout_wait_s=1.0, engine_idle_s_per_step=0.5,
               engine_idle_frac=0.25, generated_tokens_per_step=200.0, at_max_new_tokens_frac=0.125,
               partial_samples_frac=0.0, token_staleness_mean=1.0)
    whole = bench.combine([fig, {**fig, "step_s": 4.0, "samples_per_step": 16}, {**fig, "step_s": 3.0}])
    assert whole["step_s"] == 3.0 and whole["runs"] == 3 and "samples_per_step" not in whole  # median of 2, 4, 3
    partial = bench.combine([{"error": "exit code 1"}, {**fig, "step_s": 1.5, "partial_samples_frac": 0.2}])
    assert partial["runs"] == 1 and partial["step_s"] == 1.5  # the failed run left out
    assert bench.combine([{"error": "timed out"}]) == {"error": "timed out", "runs": 0}
    lines = bench.table({"whole": whole, "partial": partial}).splitlines()
    assert lines[2].startswith("| whole | 3.00 | 1.00 | 1.00 | 0.50 | 25.0% | 200 | 12.5% | 0.0% | 1.00 | 2.0 |")
    assert lines[3].startswith("| partial | 1.50 | 0.50 |") and "| 20.0% |" in lines[3]
    failed = bench.table({"whole": {"error": "timed out", "runs": 0}, "partial": partial}).splitlines()
    assert failed[2].startswith("| whole | failed: timed out |") and failed[3].startswith("| partial | 1.50 | n/a |")
