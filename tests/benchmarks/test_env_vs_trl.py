"""benchmarks/env_vs_trl.py: its environment runs in rlray's TRL adapter as TRL would run it; its helpers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlray.envs import AssistantTurn, TRLEnvironment, is_trl_environment, load_environment, parse_tool_calls
from tests.fixtures.bench import load_bench

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    yield load_bench("env_vs_trl"), load_bench("multiply_env")


def turn(text: str, index: int) -> AssistantTurn:
    calls, errors = parse_tool_calls(text)
    return AssistantTurn(text=text, tool_calls=calls, tool_call_errors=errors, turn_index=index)


def test_the_environment_is_trl_shaped_and_scores_the_tool_call(bench):
    _, multiply_env = bench
    assert is_trl_environment(multiply_env.MultiplyEnv)
    env = load_environment(f"{BENCH / 'multiply_env.py'}:MultiplyEnv")()
    assert isinstance(env, TRLEnvironment)
    row = multiply_env.rows(1, seed=3)[0]
    a, b = row["a"], row["b"]
    opened = env.reset(**row)
    assert opened.prompt == [{"role": "user", "content": f"What is {a} x {b}? Use the multiply tool on {a} and {b}, "
                                                          "then give the product."}]
    assert [t.__name__ for t in opened.tools] == ["multiply"]
    call = f'<tool_call>\n{{"name": "multiply", "arguments": {{"a": {b}, "b": {a}}}}}\n</tool_call>'
    first = env.step(turn(call, 0))
    assert not first.done and str(a * b) in first.observations[0]["content"]
    last = env.step(turn(f"The product is {a * b}.", 1))
    assert last.done and last.reward == 1.0  # the row's factors, in either order

    env.reset(**row)  # a wrong call, then an answer: 0.0
    env.step(turn('<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}\n</tool_call>', 0))
    assert env.step(turn("6", 1)).reward == 0.0


def test_rows_are_seeded_two_digit_questions(bench, tmp_path):
    _, multiply_env = bench
    assert multiply_env.rows(5, seed=0) == multiply_env.rows(5, seed=0) != multiply_env.rows(5, seed=1)
    path = tmp_path / "q.jsonl"
    multiply_env.write_rows(path, 4, seed=0)
    written = [json.loads(line) for line in path.read_text().splitlines()]
    assert written == multiply_env.rows(4, seed=0)
    assert all(10 <= r["a"] <= 99 and 10 <= r["b"] <= 99 and r["prompt"] == f"What is {r['a']} x {r['b']}?"
               for r in written)


def test_mean_after_warmup_and_the_rlray_overrides(bench):
    env_vs_trl, _ = bench
    assert env_vs_trl.mean_after_warmup([9.0, 1.0, None, 2.0], 1) == 1.5  # (1 + 2) / 2: step 1 and the gap left out
    assert env_vs_trl.mean_after_warmup(None, 1) is None and env_vs_trl.mean_after_warmup([1.0], 1) is None
    from rlray.config import config_from_dict

    spec = env_vs_trl.EnvRunSpec(model="tiny-random", prompts_per_step=2, samples_per_prompt=2, max_new_tokens=16,
                                 steps=3, warmup=1, sequences_per_microbatch=4, max_turns=3, data_file="q.jsonl",
                                 workdir="/tmp/w")
    spec.overrides = env_vs_trl.env_overrides(spec)
    cfg = config_from_dict({}, env_vs_trl.grpo.rlray_overrides(spec, 0, "cpu", 0))
    assert cfg.env.max_turns == 3 and cfg.reward.functions == [] and cfg.data.instruction == ""
    assert cfg.data.prompt_column == "prompt" and cfg.model.chat_template == "smollm2-tools"
    assert cfg.env.environments == {"multiply": f"{BENCH / 'multiply_env.py'}:MultiplyEnv"}


def test_the_table_shows_the_work_next_to_the_time(bench):
    env_vs_trl, _ = bench
    spec = {"prompts_per_step": 4, "samples_per_prompt": 4, "max_turns": 3, "max_new_tokens": 64, "steps": 4,
            "warmup": 2, "dtype": "float32"}
    runs = {"trl": {"median_step_s": 100.0, "generated_tokens_per_s": 10.0, "peak_pss_gib": 10.0,
                    "reward_mean": [0.0, 0.0, 0.5, 1.0], "series": {"tool_calls_per_episode": [0.0, 0.0, 1.0, 0.5]}},
            "rlray-sync": {"median_step_s": 40.0, "generated_tokens_per_s": 30.0, "peak_pss_gib": 12.0,
                           "reward_mean": [0.0, 0.0, 0.25, 0.25],
                           "series": {"tool_calls_per_episode": [0.0, 0.0, 1.0, 1.0], "turns_per_episode": [1, 1, 2, 3]}},
            "broken": {"error": "exit code 1"}}
    env_vs_trl.grpo.add_ratios(runs)
    text = env_vs_trl.table("m", {"spec": spec, "runs": runs})
    assert "| trl | 100.00 | 10.0 | 0.75 | n/a | 0.75 | 10.00 | 1.00 | 1.00 | 1.00 |" in text
    assert "| rlray-sync | 40.00 | 30.0 | 1.00 | 2.50 | 0.25 | 12.00 | 0.40 | 3.00 | 1.20 |" in text
    assert "| broken | FAILED: exit code 1 |" in text and "up to 3 turns of 64 new tokens" in text


def test_the_taught_call_is_what_the_template_renders_and_the_parser_reads(bench, tiny_model_path):
    env_vs_trl, _ = bench
    from rlray.models import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_path, chat_template="smollm2-tools")
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "q"},
         {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "multiply",
                                                                               "arguments": {"a": 37, "b": 45}}}]}],
        tokenize=False)
    assert env_vs_trl.call_text(37, 45) in rendered
    calls, errors = parse_tool_calls(env_vs_trl.call_text(37, 45))
    assert [(c.name, c.arguments) for c in calls] == [("multiply", {"a": 37, "b": 45})] and errors == []
