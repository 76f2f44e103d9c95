"""Tests for rlray.reward.gsm8k on real GSM8K test rows: exact (accuracy, format) grades, weights, answers_match."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rlray.reward.gsm8k import answers_match, extract_final_answer, grade_gsm8k, gsm8k_reward, plain_number


@pytest.fixture(scope="module")
def solutions(gsm8k_dir):
    """GSM8K test solutions, each ending in '#### <final answer>'."""
    with open(gsm8k_dir / "test.jsonl") as handle:
        return [json.loads(line)["answer"] for line in handle]


@pytest.fixture(scope="module")
def answers(solutions):
    """The reference final answers: the text after each solution's last '####' ("18", "2,125", ...)."""
    return [s.rsplit("####", 1)[1].strip() for s in solutions]


def _first(answers, predicate):
    return next(a for a in answers if predicate(a))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("work\n#### 18", "18"),
        ("#### 18\nthanks", "18"),
        ("#### 1\n#### 2 ", "2"),
        ("So #### $1,080.", "$1,080."),
        ("no marker", None),
        ("########", None),
        ("#### \n", None),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("$1,080.50 dollars.", "1080.50"), ("-10", "-10"), ("**18**", "18"), ("18/4", None), ("x = 3", None), ("nine", None)],
)
def test_plain_number(text, expected):
    assert plain_number(text) == expected


def test_grades_on_real_rows(answers):
    reference = answers[0]  # Janet's ducks
    assert reference == "18"
    work = "Janet sells 16 - 3 - 4 = 9 eggs and makes 9 * 2 = 18 dollars."
    assert grade_gsm8k(f"{work}\n#### 18", reference) == (1.0, 1.0)  # correct
    assert grade_gsm8k(f"{work}\n#### 19", reference) == (0.0, 1.0)  # wrong, formatted
    assert grade_gsm8k(f"{work}\nThe answer is 18.", reference) == (1.0, 0.0)  # right number, no ####
    assert grade_gsm8k(f"{work}\n#### $18", reference) == (1.0, 1.0)  # dollar sign
    assert grade_gsm8k(f"{work}\n#### $18.00 per day.", reference) == (1.0, 1.0)  # decimals, units, period
    assert grade_gsm8k("#### 18\nHope this helps!", reference) == (1.0, 0.0)  # '####' line is not last
    assert grade_gsm8k(f"{work}\n########", reference) == (1.0, 0.0)  # no answer after ####: whole-text fallback
    assert grade_gsm8k("I am not sure.", reference) == (0.0, 0.0)


def test_thousands_commas_and_negatives(answers):
    comma = _first(answers, lambda a: "," in a)  # '2,125'
    assert comma == "2,125"
    digits = comma.replace(",", "")
    assert grade_gsm8k(f"#### {comma}", comma) == (1.0, 1.0)
    assert grade_gsm8k(f"#### {digits}", comma) == (1.0, 1.0)
    big = _first(answers, lambda a: a.isdigit() and int(a) >= 1000)
    assert grade_gsm8k(f"#### {int(big):,}", big) == (1.0, 1.0)  # '1,234' against '1234'
    assert grade_gsm8k(f"#### ${int(big):,}", big) == (1.0, 1.0)
    negative = _first(answers, lambda a: a.startswith("-"))
    assert grade_gsm8k(f"#### {negative}", negative) == (1.0, 1.0)
    assert grade_gsm8k(f"#### {negative[1:]}", negative) == (0.0, 1.0)


def test_reference_solutions_grade_correct(answers, solutions):
    grades = [grade_gsm8k(solutions[i], answers[i]) for i in range(200)]
    assert grades == [(1.0, 1.0)] * 200


def test_grading_from_threads_matches_main_thread(answers, solutions):
    pairs = [(solutions[i], answers[(i + 1) % 60]) for i in range(60)]  # mostly wrong on purpose
    expected = [grade_gsm8k(s, ref) for s, ref in pairs]
    with ThreadPoolExecutor(max_workers=4) as pool:  # signal-based timeouts would raise here
        got = list(pool.map(lambda p: grade_gsm8k(*p), pairs))
    assert got == expected
    assert sum(a for a, _ in got) < 60 and {f for _, f in got} == {1.0}


def test_adversarial_inputs_return_fast_and_never_raise():
    hostile = [
        "#### 9^9^9^9",
        "$9^{9^{9^{9}}}$",
        "9**9**9**9",
        "(9^9)^(9^9)",
        "#### 100000!",
        "\\boxed{" * 500,
        "1+" * 1000 + "1",
        "$" * 5000,
        "",
        "####",
        "\x00\ud800",
        "7 " * 100_000,
    ]
    start = time.perf_counter()
    grades = [grade_gsm8k(text, "18") for text in hostile]
    assert time.perf_counter() - start < 5.0
    assert [a for a, _ in grades] == [0.0] * len(hostile)
    assert grade_gsm8k("#### 18", "not a number") == (0.0, 1.0)


def test_reward_weights():
    responses = ["#### 18", "#### 17", "The answer is 18.", "no idea"]
    out = gsm8k_reward(responses, ["18"] * 4, correct_weight=1.0, format_weight=0.2)
    assert out["accuracy"] == [1.0, 0.0, 1.0, 0.0]
    assert out["format"] == [1.0, 1.0, 0.0, 0.0]
    assert out["reward"] == pytest.approx([1.2, 0.2, 1.0, 0.0], abs=1e-12)
    with pytest.raises(ValueError, match="2 responses but 1 references"):
        gsm8k_reward(["a", "b"], ["1"], correct_weight=1.0, format_weight=0.2)


def test_answers_match_parses_references_as_numbers_text_or_latex():
    assert answers_match("\\boxed{1/2}", "0.5") and answers_match("1080", "1,080")
    assert answers_match("\\boxed{\\sqrt{2}}", "\\sqrt{2}")  # bare LaTeX: parsed again inside $...$
    assert not answers_match("\\boxed{2}", "\\sqrt{2}")
    assert not answers_match("18", "")  # nothing to compare against
