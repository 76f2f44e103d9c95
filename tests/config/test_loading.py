"""Config schema: every shipped config loads; bad keys and values get errors that name them."""

from pathlib import Path

import pytest

from rlray.config import Config, ConfigError, apply_overrides, config_from_dict, load_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p for p in (REPO / "configs").rglob("*.yaml") if "sweeps" not in p.parts)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert cfg.sequences_per_step == cfg.learner.prompts_per_step * cfg.rollout.samples_per_prompt


def test_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"grpo_gsm8k_smollm2.yaml", "grpo_gsm8k_tiny.yaml"} <= names


def test_unknown_key_is_named_with_suggestion():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"learner": {"learning_rate": 1e-5}})
    assert "unknown key 'learner.learning_rate'" in str(err.value)
    assert "did you mean 'learner.lr'" in str(err.value)


def test_unknown_section_is_named():
    with pytest.raises(ConfigError, match="unknown key 'rolout'; did you mean 'rollout'"):
        config_from_dict({"rolout": {"max_new_tokens": 8}})


def test_unknown_override_key_is_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("run: {max_steps: 2}\n")
    with pytest.raises(ConfigError, match="unknown key 'rollout.max_new_token'; did you mean 'rollout.max_new_tokens'"):
        load_config(path, ["rollout.max_new_token=4"])


def test_wrong_type_and_range_name_key_and_value():
    with pytest.raises(ConfigError, match=r"run\.max_steps='ten'"):
        config_from_dict({"run": {"max_steps": "ten"}})
    with pytest.raises(ConfigError, match=r"rollout\.top_p=1\.5"):
        config_from_dict({"rollout": {"top_p": 1.5}})
    with pytest.raises(ConfigError, match=r"algo\.kl_estimator='k4'"):
        config_from_dict({"algo": {"kl_estimator": "k4"}})


def test_sizes_that_cannot_divide():
    with pytest.raises(ConfigError, match="samples_per_prompt=1"):
        config_from_dict({"rollout": {"samples_per_prompt": 1}})
    with pytest.raises(ConfigError, match="prompts_per_step=3 does not divide over resources.learner.num_workers=2"):
        config_from_dict({"learner": {"prompts_per_step": 3}, "resources": {"learner": {"num_workers": 2}}})
    with pytest.raises(ConfigError, match="sequences_per_minibatch=24 does not divide the 32 sequences"):
        config_from_dict({"learner": {"prompts_per_step": 8, "sequences_per_minibatch": 24}})
    with pytest.raises(ConfigError, match="sequences_per_microbatch=5"):
        config_from_dict({"learner": {"sequences_per_microbatch": 5}})


def test_overrides_parse_like_yaml():
    tree = apply_overrides({}, ["learner.lr=1e-5", "run.max_steps=7", "data.shuffle=false", "data.train_files=[a.jsonl,b.jsonl]", "run.name=null"])
    assert tree == {
        "learner": {"lr": 1e-5},
        "run": {"max_steps": 7, "name": None},
        "data": {"shuffle": False, "train_files": ["a.jsonl", "b.jsonl"]},
    }
    cfg = config_from_dict({}, ["learner.lr=3e-6"])
    assert cfg.learner.lr == pytest.approx(3e-6)


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="not of the form dotted.key=value"):
        apply_overrides({}, ["learner.lr"])


def test_missing_or_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(bad)


def test_flat_and_hash_are_stable():
    a, b = Config(), Config()
    assert a.flat()["learner.lr"] == 1e-6
    assert a.flat()["resources.rollout.num_workers"] == 1
    assert a.config_hash() == b.config_hash()
    b.learner.lr = 2e-6
    assert a.config_hash() != b.config_hash()


def test_names_other_tools_rely_on():
    flat = Config().flat()
    for key in ("run.max_steps", "run.output_dir", "run.seed", "model.path", "data.train_files", "data.eval_files", "tracking.mlflow_uri"):
        assert key in flat
    assert flat["tracking.mlflow_uri"] == "sqlite:///mlruns/mlflow.db"


# --- issue 12: TRL prompt formats, reward terms, retired keys -------------------------------------------------
def test_retired_reward_weights_name_their_replacement():
    with pytest.raises(ConfigError, match=r"reward.correct_weight was removed; .*\[\{function: gsm8k_correct, weight: 1.0\}\]"):
        config_from_dict({"reward": {"correct_weight": 1.0}})
    with pytest.raises(ConfigError, match=r"reward.format_weight was removed; .*\[\{function: gsm8k_format, weight: 0.2\}\]"):
        config_from_dict({"reward": {"format_weight": 0.2}})
    with pytest.raises(ConfigError, match=r"reward.functions\[\].path was renamed to 'function' \(path='f.py:g'\)"):
        config_from_dict({"reward": {"functions": [{"path": "f.py:g"}]}})


def test_a_single_path_is_a_list_of_one(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("run: {max_steps: 2}\n")
    cfg = load_config(path, ["data.train_files=my/prompts.jsonl", "data.eval_files=s3://b/e.parquet"])
    assert cfg.data.train_files == ["my/prompts.jsonl"] and cfg.data.eval_files == ["s3://b/e.parquet"]
    assert load_config(path, ["data.train_files=[a.jsonl, b.jsonl]"]).data.train_files == ["a.jsonl", "b.jsonl"]


def test_prompt_column_and_instruction_defaults_are_trl_ones():
    cfg = Config()
    assert cfg.data.prompt_column == "prompt" and cfg.data.instruction == "" and cfg.reward.functions == []
    assert load_config(REPO / "configs/grpo_gsm8k_smollm2.yaml").data.prompt_column == "question"


def test_reward_term_names_are_unique_and_not_reserved():
    cfg = config_from_dict({"reward": {"functions": [{"function": "gsm8k_correct"}, {"function": "f.py:score", "weight": 0.5},
                                                     {"function": "m.mod:score", "name": "score_b"}]}})
    assert [f.term_name for f in cfg.reward.functions] == ["gsm8k_correct", "score", "score_b"]
    with pytest.raises(ConfigError, match=r"reward.functions\[0\] and reward.functions\[1\] are both named 'score'"):
        config_from_dict({"reward": {"functions": [{"function": "f.py:score"}, {"function": "m.mod:score"}]}})
    with pytest.raises(ConfigError, match=r"reward.functions\[0\] is named 'reward', a reserved name"):
        config_from_dict({"reward": {"functions": [{"function": "f.py:reward"}]}})


def test_dapo_filters_on_a_reward_term_that_exists():
    base = {"algo": {"name": "dapo"}, "reward": {"functions": [{"function": "gsm8k_correct"}]}}
    assert config_from_dict(base).algo.dynamic_sampling_metric == "reward"
    ok = config_from_dict({**base, "algo": {"name": "dapo", "dynamic_sampling_metric": "gsm8k_correct"}})
    assert ok.algo.dynamic_sampling_metric == "gsm8k_correct"
    with pytest.raises(ConfigError, match=r"algo.dynamic_sampling_metric='length' is not a reward term; .*\['gsm8k_correct'\]"):
        config_from_dict({**base, "algo": {"name": "dapo", "dynamic_sampling_metric": "length"}})
    with pytest.raises(ConfigError, match=r"algo.dynamic_sampling_metric='accuracy' was renamed: .* use gsm8k_correct"):
        config_from_dict({**base, "algo": {"name": "dapo", "dynamic_sampling_metric": "accuracy"}})


def test_adapter_path_with_a_lora_rank_is_refused_naming_both_keys():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"model": {"adapter_path": "ckpt/adapter", "lora": {"rank": 8}}})
    assert "model.adapter_path='ckpt/adapter' with model.lora.rank=8: the adapter brings its own LoRA settings; " \
           "set model.lora.rank=0" in str(err.value)
    assert config_from_dict({"model": {"adapter_path": "ckpt/adapter"}}).model.adapter_path == "ckpt/adapter"


def _leaves(model, prefix=""):
    """Yields (dotted key, annotation) of every non-section field below ``model``."""
    from pydantic import BaseModel

    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _leaves(ann, prefix + name + ".")
        else:
            yield prefix + name, ann


SECTIONS = list(Config.model_fields)
BAD_VALUES = ["'bogus'", "-1", "1e30", "[1, 2]", "''", "-0.5", "true", "{a: 1}"]


@pytest.mark.parametrize("section", SECTIONS)
def test_every_bad_value_of_every_field_is_refused_by_its_dotted_key(section):
    """Each field of the section, fed each bad value as an override: accepted as valid, or a ConfigError whose
    message names the field's dotted key. A mapping is a valid value only of a mapping field (env.environments,
    rollout.chat_template_kwargs); every other field refuses it."""
    leaves = [(key, ann) for key, ann in _leaves(Config) if key.split(".")[0] == section]
    assert leaves
    for key, ann in leaves:
        for value in BAD_VALUES:
            try:
                config_from_dict({}, [f"{key}={value}"])
            except ConfigError as err:
                assert key in str(err), (key, value, str(err))
            else:
                assert value != "{a: 1}" or str(ann).startswith("dict["), f"{key} accepted a mapping"


NUMBER_FIELDS = [key for key, ann in _leaves(Config) if ann in (int, float, int | None, float | None)]


@pytest.mark.parametrize("key", ["learner.lr", "learner.epochs", "guard.kl_threshold", "resources.learner.gpus",
                                 "eval.max_new_tokens"])
def test_a_boolean_is_not_read_as_a_number(key):
    # pydantic's lax mode would take true as 1 and false as 0 without a word
    for value in ("true", "false"):
        with pytest.raises(ConfigError) as err:
            config_from_dict({}, [f"{key}={value}"])
        assert f"{key}: got {value}, a boolean; give a number" in str(err.value)


def test_every_number_field_refuses_a_boolean():
    assert len(NUMBER_FIELDS) > 50
    for key in NUMBER_FIELDS:
        with pytest.raises(ConfigError, match="a boolean; give a number"):
            config_from_dict({}, [f"{key}=true"])
    assert config_from_dict({}, ["algo.mask_truncated=true", "learner.lr=1"]).learner.lr == 1.0  # bools and ints still fit


def test_a_section_given_a_value_and_a_bad_yaml_file_name_the_key_and_file(tmp_path):
    with pytest.raises(ConfigError, match=r"learner=5: Input should be a valid dictionary"):
        config_from_dict({"learner": 5})
    path = tmp_path / "c.yaml"
    path.write_text("learner:\n  lr: [1e-5\n")
    with pytest.raises(ConfigError, match=rf"(?s)config file '{path}' is not valid YAML: .*line 2, column 7"):
        load_config(path)
    path.write_text("learner:\n  lr: true\n")
    with pytest.raises(ConfigError, match=rf"^{path}: invalid config:\n  - learner.lr: got true, a boolean"):
        load_config(path)


def test_the_package_reexports_public_names_only_and_lists_them_in_all():
    import ast

    import rlray.config

    tree = ast.parse(Path(rlray.config.__file__).read_text())
    imported = {a.asname or a.name for node in tree.body if isinstance(node, ast.ImportFrom) for a in node.names}
    assert not sorted(n for n in imported if n.startswith("_")), "import private helpers from their defining module"
    assert imported == set(rlray.config.__all__)
    assert {"Config", "ConfigError", "load_config", "config_from_dict", "validate_tree", "validation_error_lines"} <= imported
