"""benchmarks/learner_packing.py (its step tables and table) and the learner lines of the TRL comparisons."""

from __future__ import annotations

import pytest

from tests.fixtures.bench import load_bench


@pytest.fixture(scope="module")
def bench():
    yield load_bench("learner_packing"), load_bench("grpo_vs_trl")


@pytest.mark.parametrize("name", ["demo", "env", "grpo"])
def test_step_tables_have_the_runs_shapes(bench, tiny_tokenizer, name):
    packing, _ = bench
    shape = packing.SHAPES[name]
    batch, prompt_lengths = packing.step_table(name, tiny_tokenizer)
    assert batch.num_rows == shape.prompts * shape.samples and len(prompt_lengths) == shape.prompts
    assert batch.group_id.tolist() == [i // shape.samples for i in range(batch.num_rows)]
    lo, hi = {"demo": (20, 80), "env": (250, 450), "grpo": (80, 260)}[name]  # rendered openings, in tokens
    assert all(lo <= n <= hi for n in prompt_lengths), prompt_lengths
    most = shape.turns[1] * shape.turn_tokens[1] + (shape.turns[1] - 1) * shape.observation_tokens
    assert 1 <= int(batch.inputs.response_lengths.max()) <= most
    observed = batch.inputs.response_lengths.sum() - batch.response_mask.sum()  # observation tokens: not in the loss
    assert (int(observed) > 0) == (shape.observation_tokens > 0)


def test_variants_count_their_tokens_and_make_a_table(bench):
    packing, _ = bench
    runs = {v: packing.run_variant("grpo", v, "tiny-random", "float32", 4096, repeats=1, warmup=0)
            for v in ("today", "packed+shared")}
    today, packed = runs["today"], runs["packed+shared"]
    assert packed["tokens"]["padding"] == 0 < today["tokens"]["padding"]
    assert packed["tokens"]["real"] + packed["tokens"]["shared"] == 2 * today["row_tokens"]  # stage 4 and stage 6
    for r in runs.values():
        r["peak_rss_gib"] = 1.0
    text = packing.table({"workload": "grpo", "dtype": "float32", "repeats": 1, "rows": 16,
                          "row_tokens": today["row_tokens"], "runs": runs})
    assert "| packed+shared |" in text and "| 1.00 |" in text  # today against itself


def test_learner_lines_explain_the_stage_times(bench):
    _, grpo = bench
    result = {"runs": {"trl": {"stage_median_s": {}},
                       "rlray-sync": {"stage_median_s": {"timing/logprobs_s": 4.25, "timing/update_s": 14.75},
                                      "learner_tokens_median": {"perf/learner_tokens_real": 5000.0,
                                                                "perf/learner_tokens_padding": 0.0,
                                                                "perf/learner_tokens_shared": 3000.0}}}}
    assert grpo.learner_lines(result) == ["", "rlray-sync: logprobs 4.2 s, update 14.8 s per step (median); learner "
                                              "tokens per step: 5000 real, 0 padding, 3000 shared"]
