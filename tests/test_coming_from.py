"""The migration pages (issue 40): every key in the tables of docs/coming_from_trl.md and docs/coming_from_verl.md is
real on both sides (TRL's names against TRL's own classes, verl's against its config file's keys, rlray's against the
config schema, and each ``key=value`` loads), and the worked example's TRL script and rlray config say the same."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from rlray.config import Config, config_from_dict, load_config
from rlray.config.describe import reference_markdown

REPO = Path(__file__).resolve().parents[1]
PAGES = {"trl": REPO / "docs" / "coming_from_trl.md", "verl": REPO / "docs" / "coming_from_verl.md"}
RLRAY_KEYS = set(re.findall(r"^\| `([\w.\[\]]+)` \|", reference_markdown(Config), re.M))


def tables(path: Path) -> dict[str, list[tuple[list[str], list[str], str]]]:
    """Returns {first header cell: [(their tokens, rlray tokens, notes)]} for each 'X | rlray | notes' table of a page
    (tokens: the backticked texts of a cell)."""
    out, rows = {}, None
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")] if line.startswith("|") else None
        if cells and len(cells) == 3 and cells[1:] == ["rlray", "notes"]:
            rows = out.setdefault(cells[0], [])
        elif cells and rows is not None and not set(line) <= set("|- "):
            assert len(cells) == 3, f"{path.name}: a row of 3 cells: {line}"
            rows.append((re.findall(r"`([^`]+)`", cells[0]), re.findall(r"`([^`]+)`", cells[1]), cells[2]))
        elif not cells:
            rows = None
    return out


def _trl_names() -> dict[str, dict[str, str]]:
    """Returns {table header: {name: help text}} of the TRL and peft classes the TRL page maps."""
    peft = pytest.importorskip("peft")
    trl = pytest.importorskip("trl")

    def fields(cls) -> dict[str, str]:
        return {f.name: str(f.metadata.get("help", "")) for f in dataclasses.fields(cls)}

    trainer = {n: "" for n in inspect.signature(trl.GRPOTrainer.__init__).parameters if n != "self"}
    return {"TRL GRPOConfig": fields(trl.GRPOConfig), "TRL GRPOTrainer": trainer, "peft LoraConfig": fields(peft.LoraConfig),
            "TRL DPOConfig": fields(trl.DPOConfig)}


def _check_rlray(tokens: list[str], notes: str, where: str) -> list[str]:
    """Returns what is wrong with a row's rlray tokens: an unknown key, a key=value that does not load, or no key and
    no note."""
    bad = [] if tokens or notes else [f"{where}: no rlray key and no note"]
    for token in tokens:
        key = token.split("=", 1)[0]
        if key not in RLRAY_KEYS:
            bad.append(f"{where}: rlray key {key!r} is not in the config schema")
        elif "=" in token:
            try:
                config_from_dict({}, [token])
            except Exception as err:  # the message names the key and why
                bad.append(f"{where}: {token} does not load: {err}")
    return bad


def test_the_trl_page_names_real_trl_settings_and_real_rlray_keys():
    names, bad = _trl_names(), []
    found = tables(PAGES["trl"])
    assert set(found) == set(names), found.keys()
    for header, rows in found.items():
        for theirs, ours, notes in rows:
            where = f"{header} {theirs}"
            assert len(theirs) == 1, where
            name, _, value = theirs[0].partition("=")
            if name not in names[header]:
                bad.append(f"{where}: {name!r} is not a field of {header}")
            elif value and value.strip('"') not in names[header][name]:
                bad.append(f"{where}: {value} is not among the values {header}.{name} names")
            bad += _check_rlray(ours, notes, where)
    assert bad == [], "\n".join(bad)
    grpo = {r[0][0].split("=")[0] for r in found["TRL GRPOConfig"]}
    assert {"num_generations", "per_device_train_batch_size", "max_completion_length", "beta", "epsilon", "loss_type",
            "scale_rewards", "learning_rate", "gradient_accumulation_steps", "num_iterations"} <= grpo
    assert len(found["TRL GRPOConfig"]) >= 50


def test_the_verl_page_names_real_verl_keys_and_real_rlray_keys():
    fixture = (REPO / "tests" / "fixtures" / "verl_config_keys.txt").read_text().splitlines()
    verl = {k for k in fixture if k and not k.startswith("#")}
    assert len(verl) > 400 and "actor_rollout_ref.rollout.n" in verl
    found = tables(PAGES["verl"])
    assert list(found) == ["verl"]
    bad = []
    for theirs, ours, notes in found["verl"]:
        where = f"verl {theirs}"
        assert len(theirs) == 1, where
        if theirs[0] not in verl:
            bad.append(f"{where}: not a key of verl's config (tests/fixtures/verl_config_keys.txt)")
        bad += _check_rlray(ours, notes, where)
    assert bad == [], "\n".join(bad)
    keys = {r[0][0] for r in found["verl"]}
    assert {"data.train_batch_size", "actor_rollout_ref.rollout.n", "algorithm.adv_estimator",
            "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.actor.kl_loss_coef"} <= keys
    assert len(keys) == len(found["verl"]) >= 60  # each verl key once


def test_the_table_checks_catch_a_wrong_key(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("| verl | rlray | notes |\n|---|---|---|\n| `a.b` | `learner.lrr` | |\n| `c` | `algo.kl_in=sideways` | |"
                    "\n| `d` | — | |\n\ntext\n")
    rows = tables(page)["verl"]
    assert [r[:2] for r in rows] == [(["a.b"], ["learner.lrr"]), (["c"], ["algo.kl_in=sideways"]), (["d"], [])]
    assert _check_rlray(["learner.lrr"], "", "x") == ["x: rlray key 'learner.lrr' is not in the config schema"]
    assert "does not load" in _check_rlray(["algo.kl_in=sideways"], "", "x")[0]
    assert _check_rlray([], "", "x") == ["x: no rlray key and no note"]
    assert _check_rlray(["reward.functions[].weight", "algo.loss_agg=seq-mean-token-mean"], "", "x") == []


def _calls(path: Path) -> dict[str, ast.Call]:
    """Returns {function name: its call} of the calls by name in a script."""
    tree = ast.parse(path.read_text())
    return {n.func.id: n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


def test_the_worked_example_trl_script_and_rlray_config_say_the_same():
    trl = pytest.importorskip("trl")
    calls = _calls(REPO / "docs" / "examples" / "trl_grpo.py")
    kw = {k.arg: ast.literal_eval(k.value) for k in calls["GRPOConfig"].keywords}
    args = trl.GRPOConfig(**kw, use_cpu=True)  # TRL takes every setting (use_cpu: TRL's bf16 default needs a GPU)
    trainer = {k.arg: k.value for k in calls["GRPOTrainer"].keywords}
    data = ast.literal_eval(next(k.value for k in calls["load_dataset"].keywords if k.arg == "data_files"))
    cfg = load_config(REPO / "configs" / "from_trl_grpo_smollm2.yaml")

    assert args.world_size == 1 and args.steps_per_generation == args.gradient_accumulation_steps
    assert cfg.rollout.samples_per_prompt == args.num_generations
    assert cfg.learner.prompts_per_step * cfg.rollout.samples_per_prompt == args.generation_batch_size  # one round
    assert cfg.learner.sequences_per_minibatch == args.per_device_train_batch_size * args.gradient_accumulation_steps
    assert cfg.learner.sequences_per_minibatch == args.generation_batch_size  # one optimizer step per round, as TRL
    assert cfg.learner.sequences_per_microbatch == args.per_device_train_batch_size
    assert cfg.learner.epochs == args.num_iterations
    assert cfg.rollout.max_new_tokens == args.max_completion_length
    assert (cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k) == (args.temperature, args.top_p, args.top_k)
    assert cfg.learner.lr == args.learning_rate and cfg.learner.max_grad_norm == args.max_grad_norm
    assert (cfg.algo.kl_coef, cfg.algo.kl_estimator, cfg.algo.kl_in) == (args.beta, "k3", "loss")
    assert (cfg.algo.clip_eps_low, cfg.algo.clip_eps_high) == (args.epsilon, args.epsilon_high)
    assert cfg.algo.loss_agg == {"dapo": "token-mean", "grpo": "seq-mean-token-mean"}[args.loss_type]
    assert cfg.algo.adv_std_scale == args.scale_rewards
    assert (cfg.run.max_steps, cfg.run.seed, cfg.run.output_dir) == (args.max_steps, args.seed, args.output_dir)
    assert cfg.checkpoint.every_steps == args.save_steps
    assert ast.literal_eval(trainer["model"]) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert cfg.model.path == "smollm2-135m-instruct"  # the alias of that model (rlray.models.loading)
    assert [f.function for f in cfg.reward.functions] == [f"docs/examples/my_reward.py:{trainer['reward_funcs'].id}"]
    assert cfg.data.train_files == [data] and cfg.data.prompt_column == "prompt"
