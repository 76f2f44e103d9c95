"""rlray.reward.rgym and verifiers.reasoning_gym: the built-in reward reasoning_gym on hand-made rows (the columns a reasoning-gym source gives)."""

from __future__ import annotations

import pytest

from rlray.reward.rgym import extract_tagged, last_number
from rlray.reward.verifiers import reasoning_gym

pytest.importorskip("reasoning_gym")


def _row(dataset: str, answer: str | None, metadata: str, config: dict | None = None) -> dict:
    return {"answer": answer, "reasoning_gym": {"dataset": dataset, "config": config or {}, "metadata": metadata}}


def _columns(rows: list[dict]) -> dict:
    return {k: [r.get(k) for r in rows] for k in ("answer", "reasoning_gym")}


def test_prime_factorization_scores_the_product_by_hand_and_malformed_text_zero():
    # 84 = 2 * 2 * 3 * 7. reasoning-gym's scorer: the same factors 1.0; another factoring of 84 (2 * 2 * 21 = 84) 0.5;
    # a wrong product (2 * 3 * 7 = 42) 0.01; 'eighty-four' makes its int() raise: 0.0 here; no <answer> tag 0.0
    row = _row("prime_factorization", "2 × 2 × 3 × 7", "{'number': 84, 'factors': [2, 2, 3, 7]}")
    texts = ["<answer>2 × 2 × 3 × 7</answer>", "<answer>2 × 2 × 21</answer>", "<answer>2 × 3 × 7</answer>",
             "<answer>eighty-four</answer>", "2 × 2 × 3 × 7"]
    got = reasoning_gym(["Find the prime factorization of 84."] * 5, texts, **_columns([row] * 5))
    assert got == [1.0, 0.5, 0.01, 0.0, 0.0]


def test_a_conversational_completion_and_a_row_without_an_item():
    row = _row("basic_arithmetic", "7", "{'source_dataset': 'basic_arithmetic', 'expression': '3 + 4'}")
    completions = [[{"role": "assistant", "content": "3 + 4 = <answer>7</answer>"}], "<answer>7</answer>"]
    columns = {"answer": ["7", "7"], "reasoning_gym": [row["reasoning_gym"], None]}  # the second row: a plain file's
    assert reasoning_gym(["Calculate 3 + 4."] * 2, completions, **columns) == [1.0, None]


def test_the_last_tag_is_the_answer():
    assert extract_tagged("<answer>1</answer> no, <answer>\n 12 \n</answer>", "answer") == "12"
    assert extract_tagged("<answer>12", "answer") is None
    assert extract_tagged("<final>x</final>", "final") == "x"


def test_untagged_last_number_scores_a_completion_without_tags():
    # chain_sum's scorer compares numbers: "58 + 26 = 84" answers 84 with untagged=last_number (1.0), nothing
    # without it (no tag: 0.0); a tag wins over the last number; a wrong last number and a number-less text 0.0
    row = _row("chain_sum", "84", "{'source_dataset': 'chain_sum', 'num_terms': 2, 'num_digits': 2, 'expression': '58 + 26'}")
    texts = ["58 + 26 = 84", "<answer>84</answer> so 58 + 26 = 83", "58 + 26 = 83.", "eighty-four"]
    prompts = ["State the final answer to the following arithmetic problem: 58 + 26 ="] * 4
    assert reasoning_gym(prompts, texts, untagged="last_number", **_columns([row] * 4)) == [1.0, 1.0, 0.0, 0.0]
    assert reasoning_gym(prompts[:1], texts[:1], **_columns([row])) == [0.0]
    with pytest.raises(ValueError, match="untagged='first_number'"):
        reasoning_gym(prompts[:1], texts[:1], untagged="first_number", **_columns([row]))


def test_last_number():
    assert last_number("The final answer is 12.") == "12"
    assert last_number("23 - 60 = -37") == "-37"
    assert last_number("3.5 + 1 = 4.5 ok") == "4.5"
    assert last_number("no digits") is None
