"""Stage 3 with general data (issue 12): what the reward client receives (the prompt as the dataset had it,
the row's other columns, token ids), the per-term metrics (mean over scored samples, skipped counts) and the
experience table's prompt_columns and reward_components."""

from __future__ import annotations

import json
import math

import pytest

from rlray.data import PromptRow
from rlray.reward.server import ScoreResult
from rlray.rollout import Completion
from rlray.run import experience

ROWS = [
    PromptRow("a", "What is 2+2?", {"answer": "4", "meta": {"level": 1, "tags": ["easy"]}}),
    PromptRow("b", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of Peru?"}],
              {"answer": 7, "meta": [1, "two", None]}),
]


class FakeTokenizer:
    """Decodes ids as text 't<id>' joined by spaces (the real decode is covered by the engine tests)."""

    def batch_decode(self, ids, skip_special_tokens):
        assert skip_special_tokens
        return [" ".join(f"t{i}" for i in seq) for seq in ids]


class RecordingClient:
    """A reward client that records its arguments and gives each completion its length as the reward."""

    def score(self, prompts, completions, columns, completion_ids=None):
        self.got = (prompts, completions, columns, completion_ids)
        n = [float(len(c)) for c in completion_ids]
        return ScoreResult(3, {"reward": n, "length": n})


def _completions() -> list[Completion]:
    return [Completion(0, 0, [5, 6], [-0.1, -0.2], "stop", 0), Completion(1, 0, [7], [-0.3], "length", 0),
            Completion(1, 1, [8, 9, 10], [-0.1] * 3, "stop", 0)]


def test_score_hands_the_prompt_as_the_dataset_had_it_the_columns_and_the_token_ids():
    client = RecordingClient()
    got = experience.score(client, ROWS, _completions(), FakeTokenizer())
    prompts, texts, columns, ids = client.got
    assert prompts == ["What is 2+2?", ROWS[1].prompt, ROWS[1].prompt]  # the messages, not a rendered string
    assert texts == ["t5 t6", "t7", "t8 t9 t10"]
    assert columns == [ROWS[0].columns, ROWS[1].columns, ROWS[1].columns]  # mixed types, untouched
    assert ids == [[5, 6], [7], [8, 9, 10]]
    assert got.version == 3 and got.values["reward"] == [2.0, 1.0, 3.0]


def test_term_metrics_average_over_scored_samples_and_count_skips():
    nan = math.nan
    rewards = {"reward": [1.2, nan, 0.2, 1.0], "gsm8k_correct": [1.0, nan, 0.0, None], "gsm8k_format": [1.0, 1.0, 1.0, 0.0],
               "reward_model": [0.3, 0.1, 0.2, 0.0]}
    got = experience.term_metrics(rewards, "reward")
    # gsm8k_correct: 1.0 and 0.0 scored (the NaN failed, the None skipped) -> 0.5; format: 3 of 4 -> 0.75
    assert got == {"reward/gsm8k_correct": 0.5, "reward/gsm8k_correct_skipped": 1.0,
                   "reward/gsm8k_format": 0.75, "reward/gsm8k_format_skipped": 0.0}
    every_skipped = experience.term_metrics({"reward": [nan], "t": [None]}, "eval")
    assert math.isnan(every_skipped["eval/t"]) and every_skipped["eval/t_skipped"] == 1.0


def test_the_experience_table_carries_the_columns_as_json_and_skipped_terms_as_nulls():
    rewards = {"reward": [2.0, 1.0, math.nan], "length": [2.0, None, math.nan]}
    table = experience.build_experience(ROWS, [[1, 2], [3]], _completions(), rewards)
    cols = [json.loads(c) for c in table.column("prompt_columns").to_pylist()]
    assert cols == [ROWS[0].columns, ROWS[1].columns, ROWS[1].columns]
    comps = table.column("reward_components").to_pylist()
    assert comps[0] == [("length", 2.0)] and comps[1] == [("length", None)]
    assert math.isnan(comps[2][0][1])
    # the failed sample (NaN reward) is masked out of the loss; the skipped term alone does not mask
    assert [any(m) for m in table.column("response_mask").to_pylist()] == [True, True, False]


@pytest.mark.parametrize("prefix", ["reward", "eval"])
def test_term_metrics_leave_out_the_summed_reward(prefix):
    assert experience.term_metrics({"reward": [1.0]}, prefix) == {}
