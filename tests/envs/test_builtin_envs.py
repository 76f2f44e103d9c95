"""The built-in environments through scripted episodes, with hand-computed rewards; the row generator's splits."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from rlray.data.generate import SPLITS, build_rows, split_of, write_rows
from rlray.envs import AssistantTurn, Environment, parse_tool_calls, tool_schemas
from rlray.envs.builtin import CalculatorEnv, GuessNumberEnv, RetryArithmeticEnv, calculate
from rlray.envs.builtin.calculator import last_number, reference_number
from rlray.envs.builtin.guess import first_integer, success_reward
from rlray.envs.builtin.retry_arith import parse_answer

GSM8K_ROW = {
    "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether.\n#### 72",
}


def turn(text: str, index: int = 0) -> AssistantTurn:
    calls, errors = parse_tool_calls(text)
    return AssistantTurn(text=text, tool_calls=calls, tool_call_errors=errors, turn_index=index)


def call(expression: str) -> str:
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "</tool_call>"


# --- calculator -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("2 * (3 + 4)", "14"),
        ("7/2", "3.5"),
        ("0.1 + 0.2", "0.3"),  # exact rationals: not 0.30000000000000004
        ("-(4 - 10) / 4", "1.5"),
        ("48 / 2 + 48", "72"),
        ("1/3", "0.333333333333"),
        ("99999999999 * 99999999999", "9999999999800000000001"),  # exact integers
    ],
)
def test_calculate(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("1/0", "division by zero"),
        ("2**10", "unsupported element BinOp"),
        ("__import__('os')", "unsupported element Call"),
        ("x + 1", "unsupported element Name"),
        ("True + 1", "unsupported element Constant"),
        ("1 +", "not an arithmetic expression"),
        ("1+" * 101 + "1", "longer than 200 characters"),
    ],
)
def test_calculate_rejects(expression, message):
    with pytest.raises(ValueError, match=message):
        calculate(expression)


def test_numbers_for_grading():
    assert last_number("so 1,080 dollars, then 3.5 and -2.") == Fraction(-2)
    assert last_number("total: 1,080.") == 1080
    assert last_number("no digits") is None
    assert reference_number(GSM8K_ROW["answer"]) == 72
    assert reference_number(18) == 18 and reference_number("0.5") == Fraction(1, 2)


def test_calculator_episode_gsm8k_row():
    env = CalculatorEnv()
    assert isinstance(env, Environment)
    opened = env.reset(**GSM8K_ROW)
    assert opened.prompt[0]["content"].startswith("Natalia sold clips") and len(opened.prompt) == 1
    (schema,) = tool_schemas(opened.tools)
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]

    first = env.step(turn(call("48 / 2")))
    assert first.observations == [{"role": "tool", "name": "calculator", "content": "24"}]
    second = env.step(turn(call("48 + 24") + call("48 / 0"), 1))
    assert [o["content"] for o in second.observations] == ["72", "Error: tool 'calculator' raised ValueError: division by zero"]
    assert (second.tool_calls, second.tool_errors, second.metrics) == (2, 1, {}) and second.reward is None
    last = env.step(turn("She sold 24 in May, so 72 in total.", 2))
    assert (last.reward, last.done) == (1.0, True)


def test_calculator_wrong_final_answer_and_generated_row():
    env = CalculatorEnv()
    env.reset(**GSM8K_ROW)
    assert env.step(turn("72 clips in April? No: 70")).reward == 0.0  # the last number counts
    env.reset(question="What is 12.5 * 4?", answer=50)
    assert env.step(turn("The answer is 50.0")).reward == 1.0
    with pytest.raises(ValueError, match="holds no number"):
        env.reset(question="q", answer="none")


# --- guess the number -------------------------------------------------------------------------------------------

GUESS_ROW = {"secret": 37, "low": 1, "high": 100, "max_guesses": 4}


def test_first_integer_and_reward_schedule():
    assert first_integer("I guess 50, maybe 60") == 50 and first_integer("-3") == -3 and first_integer("none") is None
    assert [success_reward(k) for k in (1, 2, 3, 10, 12)] == [1.0, 0.9, 0.8, 0.1, 0.0]


def test_guess_episode_success_on_the_third_turn():
    env = GuessNumberEnv()
    opened = env.reset(**GUESS_ROW, id="x")
    assert "between 1 and 100" in opened.prompt[0]["content"] and "4 guesses" in opened.prompt[0]["content"]
    first = env.step(turn("50"))
    assert (first.observations, first.reward, first.done, first.truncated) == ([{"role": "user", "content": "lower"}], None, False, False)
    assert first.metrics == {"invalid_actions": 0.0}
    second = env.step(turn("Hmm, no idea.", 1))
    assert second.metrics == {"invalid_actions": 1.0} and second.observations[0]["content"].startswith("Invalid answer")
    third = env.step(turn("My guess: 37", 2))
    assert third.observations == [{"role": "user", "content": "correct"}]
    # success on turn 3: 1.0 - 0.1 * (3 - 1) = 0.8
    assert (third.reward, third.done, third.truncated, third.metrics) == (0.8, True, False, {"invalid_actions": 0.0, "guesses": 3.0})


def test_guess_episode_runs_out_of_guesses():
    env = GuessNumberEnv()
    env.reset(**GUESS_ROW)
    steps = [env.step(turn(text, i)) for i, text in enumerate(["25", "40", "30", "38"])]
    assert [s.observations[0]["content"] for s in steps] == ["higher", "lower", "higher", "lower"]
    assert [s.reward for s in steps] == [None, None, None, 0.0]
    assert (steps[-1].done, steps[-1].truncated, steps[-1].metrics["guesses"]) == (False, True, 4.0)
    with pytest.raises(ValueError, match="low <= secret <= high"):
        env.reset(secret=0, low=1, high=10, max_guesses=3)


# --- retry arithmetic -------------------------------------------------------------------------------------------

ARITH_ROW = {"a": 37, "op": "+", "b": 45, "answer": 82}


def test_parse_answer():
    assert [parse_answer(t) for t in (" 82\n", "82.", "-7", "82 apples", "8 2", "", "0.5")] == [82, 82, -7, None, None, None, None]
    # the question's own expression, then "=" and the number: valid; another expression or no question: not
    question = (37, "+", 45)
    assert [parse_answer(t, question) for t in ("37 + 45 = 82", "37+45=81.", "12 + 7 = 19", "37 + 45 = 82 apples")] == [
        82, 81, None, None]
    assert parse_answer("37 + 45 = 82") is None


def test_retry_first_attempt_correct():
    env = RetryArithmeticEnv()
    opened = env.reset(**ARITH_ROW)
    assert opened.prompt == [{"role": "user", "content": "What is 37 + 45? Answer with the number only."}]
    result = env.step(turn("82"))
    assert (result.observations, result.reward, result.done, result.metrics) == ([], 1.0, True, {"attempts": 1.0, "valid_action": 1.0})
    env.reset(**ARITH_ROW)
    assert env.step(turn("37 + 45 = 82")).reward == 1.0


def test_retry_later_attempt_and_failure():
    env = RetryArithmeticEnv()
    env.reset(**ARITH_ROW)
    first = env.step(turn("The sum is 82"))  # not number-only: invalid, counts as an attempt
    assert first.observations == [{"role": "user", "content": "Wrong, try again."}]
    assert (first.reward, first.done, first.metrics) == (None, False, {"valid_action": 0.0})
    second = env.step(turn("81", 1))
    assert second.metrics == {"valid_action": 1.0} and not second.done
    third = env.step(turn("82", 2))
    assert (third.reward, third.done) == (0.5, True)

    env.reset(a=50, op="-", b=18, answer=32, max_attempts=2)
    assert env.step(turn("30")).reward is None
    last = env.step(turn("31", 1))
    assert (last.reward, last.done, last.truncated, last.observations) == (0.0, False, True, [])


def test_retry_direction_feedback_says_higher_or_lower():
    env = RetryArithmeticEnv()
    env.reset(a=37, op="+", b=45, answer=82, max_attempts=4, feedback="direction")
    assert env.step(turn("80")).observations == [{"role": "user", "content": "Wrong: the answer is higher than 80. Try again."}]
    assert env.step(turn("37 + 45 = 91", 1)).observations == [
        {"role": "user", "content": "Wrong: the answer is lower than 91. Try again."}]
    assert env.step(turn("eighty-two", 2)).observations == [{"role": "user", "content": "Wrong: reply with a number. Try again."}]
    assert env.step(turn("82", 3)).reward == 0.5
    with pytest.raises(ValueError, match="feedback='hint'"):
        RetryArithmeticEnv().reset(**ARITH_ROW | {"feedback": "hint"})


def test_retry_rejects_inconsistent_rows():
    with pytest.raises(ValueError, match="op='/'"):
        RetryArithmeticEnv().reset(a=1, op="/", b=1, answer=1)
    with pytest.raises(ValueError, match="need answer == a \\+ b"):
        RetryArithmeticEnv().reset(a=1, op="+", b=1, answer=3)


# --- generated row sets -----------------------------------------------------------------------------------------


def test_split_of_is_the_hash_bucket():
    import hashlib

    bucket = int(hashlib.sha256(b"37+45").hexdigest(), 16) % 100
    expected = "train" if bucket < 80 else "calibration" if bucket < 90 else "heldout"
    assert split_of("37+45") == expected
    assert set(SPLITS) == {"train", "calibration", "heldout"}


@pytest.mark.parametrize(("kind", "env_cls", "n_heldout"), [("retry_arith", RetryArithmeticEnv, 432), ("guess", GuessNumberEnv, 54)])
def test_rows_are_disjoint_deterministic_and_valid(tmp_path, kind, env_cls, n_heldout):
    sets = {split: build_rows(kind, 50, seed=0, split=split) for split in SPLITS}
    ids = {split: {row["id"] for row in rows} for split, rows in sets.items()}
    assert all(len(v) == 50 for v in ids.values())
    assert not (ids["train"] & ids["calibration"]) and not (ids["train"] & ids["heldout"]) and not (ids["calibration"] & ids["heldout"])
    assert all(split_of(row["id"]) == split == row["split"] for split, rows in sets.items() for row in rows)
    # other seeds pick other items, never from another split
    other = build_rows(kind, 50, seed=1, split="heldout")
    assert {r["id"] for r in other} != ids["heldout"] and all(split_of(r["id"]) == "heldout" for r in other)
    # same arguments, same file, byte for byte
    a = write_rows(kind, tmp_path / "a" / "rows.jsonl", 20, seed=3, split="calibration")
    b = write_rows(kind, tmp_path / "b.jsonl", 20, seed=3, split="calibration")
    assert a.read_bytes() == b.read_bytes() and len(a.read_text().splitlines()) == 20
    rows = [json.loads(line) for line in a.read_text().splitlines()]
    for row in rows:  # every row opens its environment
        env_cls().reset(**row)
    with pytest.raises(ValueError, match=f"split 'heldout' holds {n_heldout} items"):
        build_rows(kind, n_heldout + 1, seed=0, split="heldout")


def test_retry_rows_content():
    rows = build_rows("retry_arith", 200, seed=0, split="train")
    for row in rows:
        assert 0 <= row["a"] <= 50 and 0 <= row["b"] <= 50 and row["max_attempts"] == 3 and row["feedback"] == "direction"
        assert row["answer"] == (row["a"] + row["b"] if row["op"] == "+" else row["a"] - row["b"]) >= 0
        assert row["id"] == f"{row['a']}{row['op']}{row['b']}"
    guess = build_rows("guess", 100, seed=0, split="train")
    # max_guesses is the binary-search bound: high 100 -> ceil(log2 100) + 1 = 8, high 10 -> 4 + 1 = 5
    assert {(r["high"], r["max_guesses"]) for r in guess if r["high"] in (10, 100)} <= {(10, 5), (100, 8)}
    with pytest.raises(ValueError, match="unknown kind"):
        build_rows("chess", 1, 0, "train")
    with pytest.raises(ValueError, match="unknown split"):
        build_rows("guess", 1, 0, "test")
