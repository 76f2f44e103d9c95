"""End to end: every configs/algos/*.yaml runs 2 steps with `tiny-random` through Ray Train and MLflow.

All marked slow for the suite's time (ppo's 78 s took `make test` to 30.3 min): the offline pairwise path runs
in-process in tests/run/test_offline.py, reward-model scoring in tests/reward, GAE and the critic's loss in
tests/algos and tests/learner. GRPO
runs through Ray in tests/run/test_online_e2e.py and, with entropy and rollout-correction options on, in
tests/run/test_envs_e2e.py; sft's objective is pinned in tests/learner/test_pair_objectives.py.
Online runs use the transformers rollout backend (the vLLM path is covered by tests/run/test_online_e2e.py and
costs ~30 s of engine start per run) and a completion-length reward term, since a random model never
solves GSM8K. Offline runs use 16 hh-rlhf pairs (4 held out). Each test checks: the run FINISHED, every
expected metric was logged at steps 1 and 2, every logged key is registered in rlray.observe.metrics (its own
keys, families and reward terms), losses are finite, and the weights of the final snapshot differ from the initial
ones. The reward-model run's snapshot then goes to the reward stage (``RewardScorer(model_path=...)``), whose
scores must be the model's own outputs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlray.algos import algorithm_names
from rlray.config import load_config
from rlray.observe.metrics import is_metric_key
from rlray.observe.tracking import get_run, get_run_metrics

REPO = Path(__file__).resolve().parents[2]
# In make test (~60 s each on the 2-core CI machine): a critic (ppo), a pairwise preference loss (dpo) and the reward
# model. The others run with -m slow (grpo and sft too: see the module docstring).
CI_ALGOS: tuple[str, ...] = ()  # algorithms run in `make test` (none: see the module docstring)
LENGTH_REWARD = f"{REPO}/tests/fixtures/rewards.py:completion_length"
TERMS = ("completion_length",)  # the reward term of LENGTH_REWARD
ONLINE_ALGOS, OFFLINE_ALGOS = algorithm_names("online"), algorithm_names("offline")

ONLINE_METRICS = ["reward/mean", "algo/kl", "algo/advantage_abs_mean", "learner/pg_loss", "learner/loss",
                  "learner/grad_norm", "rollout/response_tokens_mean", "timing/update_s", "timing/algo_sampling_s"]
OFFLINE_METRICS = ["learner/loss", "learner/grad_norm", "learner/lr", "algo/pairwise_accuracy", "algo/reward_margin",
                   "algo/chosen_reward", "algo/rejected_reward", "timing/update_s"]
EXTRA_METRICS = {  # what each algorithm adds
    "ppo": ["learner/value_loss", "learner/critic_grad_norm", "algo/value_clip_fraction", "algo/dual_clip_fraction"],
    "dapo": ["algo/dynamic_sampling_rounds", "reward/overlong_penalty_mean", "reward/overlong", "reward/overlong_skipped"],
    "remax": ["reward/baseline_mean"],
    "kto": ["algo/kto_kl"],
    "grpo": ["algo/entropy", "algo/rollout_is_weight_mean", "algo/rollout_corrected_sequence_fraction"],
}
ALGO_OVERRIDES = {  # options switched on so that every code path runs once
    "ppo": ["algo.dual_clip=3.0"],
    "grpo": ["algo.entropy_coef=0.001", "algo.rollout_correction.mode=sequence_mask", "algo.rollout_correction.ratio_max=3.0"],
    "dapo": ["algo.dynamic_sampling_metric=completion_length", "algo.overlong_cache_tokens=4"],
}


def _overrides(name: str, tmp_path: Path, gsm8k_dir: Path, hh_file: Path, mlflow_uri: str) -> list[str]:
    common = [f"run.output_dir={tmp_path}/out", f"tracking.mlflow_uri={mlflow_uri}", "run.max_steps=2",
              "model.path=tiny-random", "model.dtype=float32", "learner.lr=1e-3", "learner.warmup_steps=0",
              "learner.torch_threads=1",  # one thread: tiny tensors on a busy 2-core machine (tests/algos/conftest.py)
              "guard.kl_threshold=null",  # lr 1e-3 on a random model moves the k3 KL past 0.03 in a step or two
              "monitor.port=0"]  # a free port: the default 8888 may be held by a run outside the tests
    if name in OFFLINE_ALGOS:
        return common + [f"offline.pairs_files=[{hh_file}]", "offline.max_pairs=16", "offline.eval_fraction=0.25",
                         "offline.pairs_per_step=4", "offline.pairs_per_microbatch=2", "offline.max_prompt_tokens=48",
                         "offline.max_response_tokens=24", "offline.eval_every_steps=0"]
    return common + [f"data.train_files=[{gsm8k_dir}/train.jsonl]", f"data.eval_files=[{gsm8k_dir}/test.jsonl]",
                     "rollout.backend=hf", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=8",
                     "learner.prompts_per_step=2", "learner.sequences_per_minibatch=4",
                     "learner.sequences_per_microbatch=2", "eval.num_problems=0",
                     f"reward.functions=[{{function: '{LENGTH_REWARD}', weight: 1.0}}]"] + ALGO_OVERRIDES.get(name, [])


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory) -> str:
    """Returns one sqlite MLflow store for the module's runs (creating a store costs seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"


@pytest.fixture(scope="module")
def small_gsm8k(gsm8k_dir: Path, tmp_path_factory) -> Path:
    """Returns a folder with the first 32 train and 8 test GSM8K rows (rank 0 renders every prompt at start)."""
    out = tmp_path_factory.mktemp("gsm8k")
    for split, n in (("train", 32), ("test", 8)):
        lines = (gsm8k_dir / f"{split}.jsonl").read_text().splitlines()[:n]
        (out / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return out


def run_algo(name: str, tmp_path: Path, data: tuple[Path, Path, str], tiny_model_path: str) -> tuple[Path, dict]:
    """Runs configs/algos/<name>.yaml for 2 steps, checks the common assertions, returns (final snapshot, metrics).

    ``data`` is (GSM8K folder, hh-rlhf file, MLflow URI).
    """
    from rlray.launch.driver import run_training

    cfg = load_config(REPO / f"configs/algos/{name}.yaml", _overrides(name, tmp_path, *data))
    result = run_training(cfg)
    assert result.status == "FINISHED"
    uri = cfg.tracking.mlflow_uri
    metrics = get_run_metrics(uri, result.run_id)
    expected = (ONLINE_METRICS if name in ONLINE_ALGOS else OFFLINE_METRICS) + EXTRA_METRICS.get(name, [])
    for key in expected:
        assert key in metrics, f"{name}: {key} not logged"
        assert [s for s, _ in metrics[key]][-2:] == [1, 2], key
        assert is_metric_key(key, TERMS), key
    undeclared = {k for k in metrics if not is_metric_key(k, TERMS)}  # rlray.observe.metrics registers every key
    assert not undeclared, undeclared
    assert all(math.isfinite(v) for _, v in metrics["learner/loss"] + metrics["learner/grad_norm"])
    assert get_run(uri, result.run_id).data.params["algo.name"] == name
    final = Path(result.final_snapshot)
    assert (final / "manifest.json").exists()
    before = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    after = load_file(str(final / "model" / "model.safetensors"))
    common = [k for k in before if k in after]
    changed = [k for k in common if not torch.equal(before[k], after[k])]
    assert len(common) >= len(before) - 1 and len(changed) >= len(common) // 2, (len(common), len(changed))
    return final, metrics


@pytest.fixture
def data(small_gsm8k: Path, hh_rlhf_dir: Path, mlflow_uri: str) -> tuple[Path, Path, str]:
    """Returns (GSM8K folder, hh-rlhf file, MLflow URI) for ``run_algo``."""
    return small_gsm8k, hh_rlhf_dir / "test.jsonl.gz", mlflow_uri


def _params(names):
    return [pytest.param(n, marks=[pytest.mark.ray] + ([] if n in CI_ALGOS else [pytest.mark.slow])) for n in names]


@pytest.mark.parametrize("name", _params([n for n in ONLINE_ALGOS if n != "ppo"]))
def test_online_algo_two_steps(name, ray_session, tmp_path, data, tiny_model_path):
    run_algo(name, tmp_path, data, tiny_model_path)


@pytest.mark.slow
@pytest.mark.ray
def test_ppo_two_steps_trains_the_critic(ray_session, tmp_path, data, tiny_model_path):
    final, metrics = run_algo("ppo", tmp_path, data, tiny_model_path)
    assert all(v > 0 for _, v in metrics["learner/value_loss"])
    # the critic's weights and optimizer state travel with the learner's state
    state = torch.load(final / "trainer_state.pt", weights_only=True)
    assert "score.weight" in state["critic"]["model"] and state["critic"]["optimizer"]["state"]


@pytest.mark.parametrize("name", _params([n for n in OFFLINE_ALGOS if n != "reward_model"]))
def test_offline_algo_two_steps(name, ray_session, tmp_path, data, tiny_model_path):
    _, metrics = run_algo(name, tmp_path, data, tiny_model_path)
    assert [s for s, _ in metrics["eval/pairwise_accuracy"]] == [0, 2]
    assert metrics["data/train_pairs"][0][1] + metrics["data/eval_pairs"][0][1] == 16


@pytest.mark.slow
@pytest.mark.ray
def test_reward_model_scores_in_the_reward_stage(ray_session, tmp_path, data, tiny_model_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlray.reward import RewardScorer

    final, metrics = run_algo("reward_model", tmp_path, data, tiny_model_path)
    assert [s for s, _ in metrics["eval/pairwise_accuracy"]] == [0, 2]
    config = json.loads((final / "model" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1
    prompts = ["How do I bake bread?", "What is 2 + 2?", "Say hi."]
    completions = ["Mix flour, water and yeast, then bake it.", "4", "hi"]
    scorer = RewardScorer(functions=[], model_path=str(final), model_weight=2.0)
    got = scorer.score(prompts, completions, [{"answer": "1"}, {"answer": "4"}, {"answer": "0"}])
    # the reference: Hugging Face's own forward, one unpadded sequence at a time (pooled at the last token)
    model = AutoModelForSequenceClassification.from_pretrained(final / "model").eval()
    model.config.pad_token_id = None
    tok = AutoTokenizer.from_pretrained(final / "model")
    expect = []
    for p, c in zip(prompts, completions, strict=True):
        text = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"] + tok(c, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            expect.append(float(model(torch.tensor([ids + [tok.eos_token_id]])).logits[0, 0]))
    assert got["reward_model"] == pytest.approx(expect, abs=1e-5)
    assert got["reward"] == pytest.approx([2.0 * e for e in expect], abs=1e-5)
    assert len(set(round(e, 6) for e in expect)) == 3  # distinct inputs get distinct scores
