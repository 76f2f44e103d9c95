"""rlray.data.rgym: reasoning-gym sources as prompt rows (issue 41): items checked by hand, the mix's weights, held-out
items disjoint from training items, every generator of the library loading and scoring through the row, and errors
that name the close matches."""

from __future__ import annotations

import ast
import hashlib
import json
import math
import operator
import re
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest

from rlray.config import ConfigError, load_config
from rlray.data import DataError, columns_json, load_prompt_rows
from rlray.data.rgym import MAX_DRAWS_PER_ROW, SEED_STRIDE, generator_names
from rlray.reward.verifiers import BUILTIN_VERIFIERS

pytest.importorskip("reasoning_gym")  # make install installs it (pyproject extra reasoning-gym)
CONFIG = Path(__file__).resolve().parents[2] / "configs/grpo_reasoning_gym_smollm2.yaml"
ARITH = "reasoning-gym:basic_arithmetic?min_terms=2&max_terms=2&min_digits=1&max_digits=1"


def _score(rows, texts, **kwargs):
    """Returns the reasoning_gym reward of ``texts`` on ``rows``, the columns after the experience table's JSON trip."""
    columns = [json.loads(columns_json(r)) for r in rows]
    keys = {k for c in columns for k in c}
    return BUILTIN_VERIFIERS["reasoning_gym"]([r.prompt for r in rows], texts,
                                              **{k: [c.get(k) for c in columns] for k in keys}, **kwargs)


def test_basic_arithmetic_items_have_the_answers_worked_by_hand():
    rows = load_prompt_rows([f"{ARITH}&size=3&seed=0&split=heldout"])
    # reasoning-gym's own items (seed 0 * 2**20 + index): the first three held-out questions, their answers by hand
    assert [(r.prompt, r.columns["answer"]) for r in rows] == [
        ("Calculate 3 / 1.", "3"), ("Calculate -8 + -5.", "-13"), ("Calculate -4 - -8.", "4")]
    assert [r.prompt_id for r in rows] == ["rg:basic_arithmetic:heldout:0:4", "rg:basic_arithmetic:heldout:0:8",
                                           "rg:basic_arithmetic:heldout:0:15"]
    assert rows[0].columns["reasoning_gym"]["dataset"] == "basic_arithmetic"
    assert rows[0].columns["reasoning_gym"]["config"] == {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def test_a_plus_in_an_option_is_a_plus_not_a_space():
    rows = load_prompt_rows(["reasoning-gym:basic_arithmetic?size=4&seed=0&split=heldout&basic_arithmetic.operators=['+']"])
    assert rows[0].columns["reasoning_gym"]["config"] == {"operators": ["+"]}
    assert rows[0].prompt == "Calculate 5 + 3 + 6."  # parsed as a space, '+' failed as "operators=[' ']"
    assert not any(f" {op} " in r.prompt for r in rows for op in "-*/")  # only sums (a '-' left is a negative number)


def test_every_row_of_a_split_is_its_own_arithmetic_and_the_reward_scores_it_right_and_wrong():
    rows = load_prompt_rows([f"{ARITH}&size=40&seed=3"])
    for row in rows:  # "Calculate -( 3 * -2 )." : the exact value of the expression, in fractions
        expression = re.fullmatch(r"Calculate (.+)\.", row.prompt)[1]
        assert row.columns["answer"] == str(_exact(ast.parse(expression, mode="eval").body)), row.prompt
    right = [f"So it is <answer> {r.columns['answer']} </answer>" for r in rows]
    wrong = [f"<answer>{int(r.columns['answer']) + 1}</answer>" for r in rows]
    assert _score(rows, right) == [1.0] * 40
    assert _score(rows, wrong) == [0.0] * 40
    assert _score(rows, [r.columns["answer"] for r in rows]) == [0.0] * 40  # no <answer> tag: no answer
    assert _score(rows, [f" {r.columns['answer']}\n" for r in rows], answer_tag=None) == [1.0] * 40


def test_leg_counting_scores_its_answer_one_and_another_count_zero():
    rows = load_prompt_rows(["reasoning-gym:leg_counting?size=5&seed=1&split=heldout"])
    assert _score(rows, [f"<answer>{r.columns['answer']}</answer>" for r in rows]) == [1.0] * 5
    assert _score(rows, [f"<answer>{int(r.columns['answer']) + 2}</answer>" for r in rows]) == [0.0] * 5


def test_a_mixs_generators_follow_their_weights_within_a_binomial_bound():
    n = 2000
    rows = load_prompt_rows([f"reasoning-gym:leg_counting:3,basic_arithmetic:1?size={n}&seed=5"])
    counts = Counter(r.columns["reasoning_gym"]["dataset"] for r in rows)
    p = 3 / 4  # weight 3 of 3 + 1; sd = sqrt(2000 * 0.75 * 0.25) = 19.4; 4 sd = 77.5 (two-sided p ~ 6e-5)
    assert abs(counts["leg_counting"] - n * p) <= 4 * math.sqrt(n * p * (1 - p)), counts
    assert counts["leg_counting"] + counts["basic_arithmetic"] == n
    texts = [f"<answer>{r.columns['answer']}</answer>" for r in rows[:50]]  # each scored by its own generator
    assert _score(rows[:50], texts) == [1.0] * 50


def test_heldout_items_never_equal_training_items_whatever_the_seeds():
    import reasoning_gym

    train = {r.prompt for seed in (0, 1) for r in load_prompt_rows([f"{ARITH}&size=400&seed={seed}"])}
    heldout = [r.prompt for seed in (0, 1) for r in load_prompt_rows([f"{ARITH}&size=60&seed={seed}&split=heldout"])]
    assert train.isdisjoint(heldout)
    # the split is sha256(question) mod 100: heldout 90-99, train 0-79, recomputed here
    assert all(int(hashlib.sha256(q.encode()).hexdigest(), 16) % 100 >= 90 for q in heldout)
    assert all(int(hashlib.sha256(q.encode()).hexdigest(), 16) % 100 < 80 for q in train)
    # without the split the two seeds' raw items would share questions: the test above can fail
    raw = [reasoning_gym.create_dataset("basic_arithmetic", min_terms=2, max_terms=2, min_digits=1, max_digits=1,
                                        seed=s * SEED_STRIDE, size=500) for s in (0, 1)]
    assert {raw[0][i]["question"] for i in range(500)} & {raw[1][i]["question"] for i in range(500)}


def test_a_wrong_generator_name_lists_the_close_matches():
    with pytest.raises(DataError) as err:
        load_prompt_rows(["reasoning-gym:leg_countin?size=5"])
    assert str(err.value) == ("reasoning-gym:leg_countin?size=5: reasoning-gym has no generator 'leg_countin'; close "
                              "matches: leg_counting, letter_counting, rectangle_count, countdown, count_bits")


@pytest.mark.parametrize(("source", "message"), [
    ("reasoning-gym:leg_counting?max_animal=3", "'max_animal' is not an option of generator 'leg_counting'; did you "
                                                 "mean max_animals, min_animals, max_instances? options: ['max_animals', "
                                                 "'max_instances', 'min_animals', 'min_instances']"),
    ("reasoning-gym:leg_counting,gcd?max_animals=3", "option 'max_animals' in a mix must name its generator"),
    ("reasoning-gym:leg_counting?split=test", "split 'test' is not one of ['train', 'calibration', 'heldout']"),
    ("reasoning-gym:leg_counting?size=0", "size=0 must be an integer >= 1"),
    ("reasoning-gym:leg_counting:0,gcd", "weight of 'leg_counting' must be > 0"),
    ("reasoning-gym:leg_counting?min_animals=9&max_animals=2", "reasoning-gym rejects the generator config"),
    ("reasoning-gym:gcd?size=200&min_numbers=2&max_numbers=2&min_value=1&max_value=3",
     "distinct questions of split 'train' in 10000 draws, fewer than size=200"),
])
def test_bad_sources_name_the_source_and_the_fix(source, message):
    with pytest.raises(DataError, match=re.escape(message)):
        load_prompt_rows([source])


def test_an_eval_source_must_name_its_split():
    with pytest.raises(ConfigError, match=r"gives no split; add split=heldout"):
        load_config(CONFIG, ["data.eval_files=reasoning-gym:leg_counting?size=10"])
    cfg = load_config(CONFIG, ["data.eval_files=reasoning-gym:leg_counting?size=10&split=heldout"])
    assert cfg.data.eval_files == ["reasoning-gym:leg_counting?size=10&split=heldout"]


def test_every_generator_loads_by_name_and_scores_its_oracle_through_the_row():
    import reasoning_gym

    names = generator_names()
    assert len(names) == len(reasoning_gym.factory.DATASETS) - 1 == 105  # all but composite
    for name in names:
        rows = load_prompt_rows([f"reasoning-gym:{name}?size=1&seed=0"])
        answers = [r.columns["answer"] for r in rows]  # None for tasks with many right answers: scores no answer
        got = _score(rows, ["" if a is None else f"<answer>{a}</answer>" for a in answers])
        # the library's own score on the item as generated (no JSON trip): the row must give the same
        ds = reasoning_gym.create_dataset(name)
        want = [float(ds.score_answer(r.columns["answer"], {
            "question": r.prompt, "answer": r.columns["answer"],
            "metadata": _item(name, int(r.prompt_id.rsplit(":", 1)[1]))["metadata"]})) for r in rows]
        assert got == want, name


def _exact(node: ast.expr) -> Fraction:
    """Returns the exact value of an arithmetic expression tree of integers, + - * / and unary minus."""
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_exact(node.operand)
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
    return ops[type(node.op)](_exact(node.left), _exact(node.right))


def _item(name: str, index: int) -> dict:
    import reasoning_gym

    return reasoning_gym.create_dataset(name, seed=0, size=MAX_DRAWS_PER_ROW)[index]
