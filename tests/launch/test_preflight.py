"""Checks before a run starts (rlray.launch.preflight), called directly: the model folder it returns, the snapshot
folder it probes, and the errors of a long prompt, a local checkpoint.uri that cannot be written and a missing
reward function. The CLI path (exit status 2 for a missing model, an S3 bucket or bad keys) is in
tests/faults/test_preflight_faults.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlray.checkpoint.storage import SnapshotError
from rlray.config import Config, config_from_dict
from rlray.data import DataError
from rlray.launch.placement import PlacementError
from rlray.launch.preflight import check_function_spec, preflight
from rlray.models import ModelError
from rlray.plan import resolve_plan
from rlray.reward.scorer import RewardFunctionError

REPO = Path(__file__).resolve().parents[2]
REWARDS = REPO / "tests" / "fixtures" / "rewards.py"


@pytest.fixture
def cfg_of(tmp_path):
    """Returns cfg_of(*overrides) -> a GRPO config on the tiny model, with 3 train and 2 eval rows in ``tmp_path``.

    Row 1 of train.jsonl has a ~300-word question (over 300 tokens); the others fit in 256.
    """
    rows = [{"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"},
            {"question": "word " * 300 + "How many words?", "answer": "#### 300"},
            {"question": "What is 4 * 4?", "answer": "#### 16"}]  # fmt: skip
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[::2]))

    def make(*overrides: str) -> Config:
        return config_from_dict({}, [
            "model.path=tiny-random", "data.prompt_column=question", f"data.train_files=[{tmp_path}/train.jsonl]",
            f"data.eval_files=[{tmp_path}/test.jsonl]",
            "eval.num_problems=2", f"run.output_dir={tmp_path}/out", f"tracking.mlflow_uri=sqlite:///{tmp_path}/m.db",
            f"reward.functions=[{{function: '{REWARDS}:completion_length', weight: 1.0}}]", *overrides])  # fmt: skip

    return make


def test_a_valid_config_returns_the_model_folder_and_leaves_the_snapshot_folder_empty(cfg_of, tmp_path, tiny_model_path):
    cfg = cfg_of()
    assert cfg.algo.family == "online" and cfg.data.long_prompts == "skip"
    assert preflight(resolve_plan(cfg)) == tiny_model_path  # the alias 'tiny-random' resolved to the cached folder
    snapshots = tmp_path / "out" / "snapshots"
    assert snapshots.is_dir() and list(snapshots.iterdir()) == []  # created by the write probe, which it removed


def test_a_prompt_too_long_with_long_prompts_error_fails_before_the_storage_probe(cfg_of, tmp_path):
    cfg = cfg_of("data.long_prompts=error", "data.max_prompt_tokens=256")
    with pytest.raises(DataError, match=r"prompt 'train:1' has \d+ tokens after the chat template, more than "
                                        r"data.max_prompt_tokens=256 \(1 of 3 prompts are\)"):  # fmt: skip
        preflight(resolve_plan(cfg))
    assert not (tmp_path / "out").exists()  # the data is checked before snapshots are probed


def test_a_local_checkpoint_uri_that_cannot_be_written_fails(cfg_of, tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    uri = f"{tmp_path}/a-file/snapshots"
    with pytest.raises(SnapshotError) as err:
        preflight(resolve_plan(cfg_of(f"checkpoint.uri={uri}")))
    message = str(err.value)
    assert message.startswith(f"checkpoint.uri='{uri}': snapshots cannot be written there (")
    assert message.endswith("; check the path")  # not the S3 hint about buckets and credentials


def test_a_learner_over_its_memory_cap_fails_before_the_storage_probe(cfg_of, tmp_path, caplog):
    # tiny-random's learner rank at the default sizes: 1.35 GiB predicted (0.7 GiB the CPU process, 0.47 GiB the
    # logits of 8 x 161 positions x 49,152); a 0.5 GiB cap is far under it
    with pytest.raises(PlacementError, match=r"predicted memory: learner rank \(1 rank x CPU\) needs 1\.3\d GiB, "
                                             r"over its 0\.50 GiB \(guard\.memory_cap_gib\)"):
        preflight(resolve_plan(cfg_of("guard.memory_cap_gib=0.5")))
    assert not (tmp_path / "out").exists()
    with caplog.at_level("WARNING", logger="rlray.launch.preflight"):  # over the cap, within the tolerance: a warning
        preflight(resolve_plan(cfg_of("guard.memory_cap_gib=1.2", "model.dtype=float32")))
    assert "predicted memory: learner rank (1 rank x CPU) needs 1.3" in caplog.text


def test_a_missing_reward_function_file_fails(cfg_of, tmp_path):
    cfg = cfg_of(f"reward.functions=[{{function: '{tmp_path}/nope.py:score', weight: 1.0}}]")
    with pytest.raises(RewardFunctionError, match=f"reward function '{tmp_path}/nope.py:score': file "
                                                  f"{tmp_path}/nope.py does not exist"):  # fmt: skip
        preflight(resolve_plan(cfg))


@pytest.mark.parametrize("spec", [f"{REWARDS}:completion_length", "json:loads", "rlray.reward.scorer:anything"])
def test_check_function_spec_accepts_an_existing_file_or_module(spec):
    assert check_function_spec(spec) is None  # only the file or module is checked, not the function name


@pytest.mark.parametrize(
    ("spec", "message"),
    [("rewards.py", "reward function 'rewards.py' is neither a built-in verifier (exact_match, gsm8k_correct, "
                    "gsm8k_format, math_equal, reasoning_gym, regex_match) nor 'module.path:function' / 'file.py:function'"),
     ("no_such_pkg_xyz.sub:fn", "reward function 'no_such_pkg_xyz.sub:fn': module 'no_such_pkg_xyz.sub' cannot be found"),
     ("json.no_such_mod:fn", "reward function 'json.no_such_mod:fn': module 'json.no_such_mod' cannot be found")],
)  # fmt: skip
def test_check_function_spec_names_what_is_missing(spec, message):
    with pytest.raises(RewardFunctionError) as err:
        check_function_spec(spec)
    assert str(err.value) == message


def test_an_online_run_without_any_reward_fails_naming_every_way(cfg_of):
    with pytest.raises(RewardFunctionError, match=r"this online run has no reward: set reward.functions .*, "
                                                  r"reward.model_path, a distillation teacher \(teacher.path\), or "
                                                  r"environments that reward their episodes \(env.environments\)"):
        preflight(resolve_plan(cfg_of("reward.functions=[]")))


def test_environments_are_a_reward_of_their_own(cfg_of, tiny_model_path):
    env = "env.environments={calc: rlray.envs.builtin.calculator:CalculatorEnv}"  # the rows have question and answer
    assert preflight(resolve_plan(cfg_of("reward.functions=[]", env, "env.default=calc"))) == tiny_model_path
    with pytest.raises(ValueError, match=r"env.environments.mine='no/such/file.py:Env': file .*no/such/file.py does not"):
        preflight(resolve_plan(cfg_of("env.environments={mine: no/such/file.py:Env}")))
    with pytest.raises(ValueError, match=r"env.environments.x='rlray.envs.nothing:Env': module 'rlray.envs.nothing' cannot"):
        preflight(resolve_plan(cfg_of("env.environments={x: rlray.envs.nothing:Env}")))


def test_built_in_verifiers_pass_and_an_unknown_name_lists_them(cfg_of, tiny_model_path):
    both = cfg_of("reward.functions=[{function: gsm8k_correct}, {function: regex_match, kwargs: {pattern: x}}]")
    assert preflight(resolve_plan(both)) == tiny_model_path
    with pytest.raises(RewardFunctionError, match=r"reward function 'gsm8k_corect' is neither a built-in verifier "
                                                  r"\(exact_match, gsm8k_correct, gsm8k_format, math_equal, reasoning_gym, "
                                                  r"regex_match\)"):  # fmt: skip
        preflight(resolve_plan(cfg_of("reward.functions=[{function: gsm8k_corect}]")))


def test_bf16_on_a_cpu_without_native_bf16_is_warned_about(cfg_of, monkeypatch, caplog):
    import rlray.launch.preflight as pf

    monkeypatch.setattr(pf, "cpu_supports_bf16", lambda: False)
    with caplog.at_level("WARNING", logger="rlray.launch.preflight"):
        preflight(resolve_plan(cfg_of("model.dtype=bfloat16")))
        assert "model.dtype=bfloat16 on a CPU without native bf16" in caplog.text
        caplog.clear()
        preflight(resolve_plan(cfg_of("model.dtype=float32")))
    assert "bf16" not in caplog.text


def test_an_adapter_path_that_is_no_adapter_fails_before_the_storage_probe(cfg_of, tmp_path, tiny_model_path):
    with pytest.raises(ModelError) as err:
        preflight(resolve_plan(cfg_of(f"model.adapter_path={tiny_model_path}")))
    assert str(err.value).startswith(f"model.adapter_path='{tiny_model_path}' is a full model folder")
    assert not (tmp_path / "out" / "snapshots").exists()


def test_a_teacher_with_the_students_vocabulary_passes_and_no_reward_is_then_allowed(cfg_of, tiny_model_path):
    from rlray.launch.preflight import check_teacher
    from rlray.models import resolve_model_path

    assert check_teacher("tiny-random@1", "tiny-random", tiny_model_path) == resolve_model_path("tiny-random@1")
    assert preflight(resolve_plan(cfg_of("reward.functions=[]", "teacher.path=tiny-random@1"))) == tiny_model_path


def test_a_teacher_with_another_vocabulary_fails_naming_both(cfg_of, tmp_path, tiny_model_path):
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_path)
    config.vocab_size = 1000  # a model of another family: another tokenizer and logits size
    other = tmp_path / "other"
    AutoModelForCausalLM.from_config(config).save_pretrained(other)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(tiny_model_path) / name).exists():
            shutil.copy(Path(tiny_model_path) / name, other / name)
    with pytest.raises(ModelError) as err:
        preflight(resolve_plan(cfg_of(f"teacher.path={other}")))
    assert str(err.value).startswith(f"teacher.path='{other}' (vocabulary 1000 tokens) and model.path='tiny-random' "
                                     "(vocabulary 49152 tokens): "
                                     "the vocabulary sizes differ")


def test_a_missing_teacher_fails_naming_the_key(cfg_of, tmp_path):
    with pytest.raises(ModelError, match=r"^teacher.path='.*nope' is not an existing folder, a .gguf file, "
                                         r"a Hugging Face Hub id \(org/name\) or an alias"):
        preflight(resolve_plan(cfg_of(f"teacher.path={tmp_path}/nope")))


BROKEN = REPO / "tests" / "fixtures" / "envs" / "broken_envs.py"


def test_environments_every_row_reaches_load_and_open_their_first_episode(cfg_of, tiny_model_path, tmp_path):
    from rlray.launch.envcheck import PROBE_ROWS, check_environments, route_rows
    from rlray.launch.preflight import PreflightError

    calc = "env.environments={calc: rlray.envs.builtin.calculator:CalculatorEnv}"
    # configured, but no row names it and there is no env.default: every row would be a single-turn prompt
    with pytest.raises(PreflightError, match=r"env.environments: no row reaches 'calc': no row of data.train_files or "
                                             r"data.eval_files has 'environment' = 'calc' \(so every row would be a "
                                             r"single-turn prompt\). To run every row in it \(TRL's single "
                                             r"environment_factory\), set env.default=calc"):
        preflight(resolve_plan(cfg_of(calc)))
    cfg = cfg_of(calc, "env.default=calc")
    from rlray.data import load_prompt_rows

    rows = load_prompt_rows(cfg.data.train_files, prompt_column="question")
    [opening] = check_environments(resolve_plan(cfg), rows, [])
    assert (opening.name, opening.trl, opening.row_id, opening.rows) == ("calc", False, "train:0", 3)
    assert [t["function"]["name"] for t in opening.reply.tools] == ["calculator"] and PROBE_ROWS == 3
    # a row naming an environment that is not configured
    (tmp_path / "named.jsonl").write_text('{"question": "q", "answer": "#### 1", "environment": "chess"}\n')
    named = cfg_of(calc, "env.default=calc", f"data.train_files=[{tmp_path}/named.jsonl]")
    with pytest.raises(ValueError, match=r"data.train_files: row 'named:0' names environment 'chess' in its "
                                         r"'environment' column, which is not in env.environments \['calc'\]"):
        route_rows(resolve_plan(named), load_prompt_rows(named.data.train_files, prompt_column="question"), [])


@pytest.mark.parametrize(("env", "message"), [
    ("NoDocTool", r"env.environments.e='.*broken_envs.py:NoDocTool': tool 'NoDocTool.shout' has no usable JSON "
                  r"schema: .*Give every argument a type hint and the function a Google-style docstring"),
    ("NeedsColumn", r"env.environments.e='.*:NeedsColumn': no episode could be opened on the first 3 rows routed to "
                    r"it \(train:0, train:1, train:2\): reset\(\*\*row\) raised KeyError: 'a' \(at .*broken_envs.py:\d+\); "
                    r"reset gets the keyword arguments \['answer', 'prompt', 'question'\]: add the columns it reads"),
    ("RequiredColumn", r"env.environments.e='.*:RequiredColumn': reset needs the column 'word' \(a keyword parameter "
                       r"without a default\), which 5 of the 5 rows routed to it lack \(first: 'train:0'\)"),
    ("BadInit", r"env.environments.e='.*:BadInit': no episode could be opened .*BadInit\(\) raised RuntimeError: no "
                r"database connection"),
    ("Missing", r"env.environments.e='.*:Missing': 'Missing' is not defined in '.*broken_envs.py' \(its classes: "),
])
def test_an_environment_that_cannot_work_fails_the_preflight_naming_the_key_and_the_fix(cfg_of, env, message):
    from rlray.launch.preflight import PreflightError

    with pytest.raises(PreflightError, match=message):
        preflight(resolve_plan(cfg_of(f"env.environments={{e: '{BROKEN}:{env}'}}", "env.default=e")))


def test_a_reward_function_needing_a_column_the_data_lacks_fails_the_preflight(cfg_of, tmp_path):
    (tmp_path / "needs.py").write_text("def needs(completions, difficulty, **kwargs):\n    return [1.0] * len(completions)\n")
    with pytest.raises(RewardFunctionError, match=r"parameter 'difficulty' has no default and is not prompts, "
                                                  r"completions, completion_ids, a key of its kwargs or a dataset "
                                                  r"column \(columns: \['answer'\]\)"):
        preflight(resolve_plan(cfg_of(f"reward.functions=[{{function: '{tmp_path}/needs.py:needs'}}]")))
    with pytest.raises(RewardFunctionError, match=r"reads column 'solution', which the dataset lacks"):
        preflight(resolve_plan(cfg_of("reward.functions=[{function: exact_match, kwargs: {column: solution}}]")))


@pytest.mark.parametrize("method, rows, error", [
    ("kto", [{"prompt": "Q", "completion": " a", "label": True}, {"prompt": "Q", "chosen": " a", "rejected": " b"}], None),
    ("sft", [{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "a"}]},
             {"prompt": "Q", "completion": " a"}, {"text": "Q a"}, {"chosen": "Q a", "rejected": "Q b"}], None),
    ("dpo", [{"prompt": "Q", "chosen": " a", "rejected": " b"}, {"text": "Q a"}],
     r"pairs.jsonl:2: this row has no 'rejected' side: it is SFT data, which only algo.name=sft takes, not dpo"),
    ("dpo", [{"prompt": "Q", "chosen": " a", "rejected": " b"}, {"prompt": "Q", "completion": " a", "label": False}],
     r"pairs.jsonl:2: an unpaired row .* only algo.name=kto takes it, not dpo"),
    ("kto", [{"prompt": "Q", "completion": " a", "label": "no"}], r"pairs.jsonl:1: 'label' must be true or false"),
])  # fmt: skip
def test_offline_data_is_checked_against_the_method_naming_file_and_line(cfg_of, tmp_path, method, rows, error):
    """Every accepted form passes for the methods that take it; the first row of another form fails the preflight
    before the storage probe, naming its file and 1-based line."""
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = cfg_of(f"algo.name={method}", f"offline.pairs_files=[{path}]", "offline.eval_fraction=0.0")
    if error is None:
        preflight(resolve_plan(cfg))
        return
    with pytest.raises(DataError, match=error):
        preflight(resolve_plan(cfg))
    assert not (tmp_path / "out").exists()


def test_every_model_key_pins_its_hub_id_to_the_local_snapshot_once(cfg_of, tmp_path, tiny_model_path, monkeypatch,
                                                                     caplog):
    """model.path, teacher.path, reward.model_path, critic.model_path and the judges' paths, each a Hub id with its own
    revision key, become the snapshot folder in the driver's config (resolve_paths), which the actors then read."""
    import huggingface_hub

    from rlray.plan.hub import pin_hub_models
    from rlray.plan.paths import resolve_paths
    from tests.models.test_hub import COMMIT, lay_out_hub_cache

    cache = tmp_path / "hf-cache"
    main = lay_out_hub_cache(cache, tiny_model_path, repo_id="org/policy")
    tagged = lay_out_hub_cache(cache, tiny_model_path, repo_id="org/teacher", commit="f" * 40, ref="v1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = cfg_of("model.path=org/policy", "teacher.path=org/teacher", "teacher.revision=v1",
                 "reward.model_path=org/policy", f"reward.model_revision={COMMIT}", "critic.model_path=org/policy",
                 "reward.judges=[{name: j, path: org/teacher, revision: v1}]")  # fmt: skip
    with caplog.at_level("INFO", logger="rlray.plan.hub"):
        pinned = resolve_paths(cfg)
    assert (pinned.model.path, pinned.reward.model_path, pinned.critic.model_path) == (str(main),) * 3
    assert pinned.teacher.path == pinned.reward.judges[0].path == str(tagged)  # revision v1 -> its commit's snapshot
    assert pinned.teacher.revision == "v1" and cfg.model.path == "org/policy"  # the revisions stay; cfg is not changed
    assert f"model.path='org/policy': the Hugging Face snapshot {main}" in caplog.text
    assert pin_hub_models(pinned) == pinned  # local folders stay as they are
    with pytest.raises(ModelError, match=r"teacher.path='org/teacher' \(revision 'v2'\): HF_HUB_OFFLINE=1 and the "
                                         r"model is not in the Hugging Face cache"):
        resolve_paths(cfg_of("teacher.path=org/teacher", "teacher.revision=v2"))
    with pytest.raises(ModelError, match=r"reward.judges\[0\].path='org/unknown': HF_HUB_OFFLINE=1"):
        resolve_paths(cfg_of("reward.judges=[{name: j, path: org/unknown}]"))
