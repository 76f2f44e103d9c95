"""Offline methods in process (no Ray) through the real learner: cached reference logprobs, DPO learning its pairs."""

import json
import math

import pytest
import torch

from rlray.config import config_from_dict
from rlray.data import DataError
from rlray.data.pairs import collate_pairs
from rlray.learner.collective import Collective
from rlray.observe.tracking import Tracker, get_run_metrics
from rlray.plan import resolve_plan
from rlray.run import offline, worker
from rlray.run.state import WorkerArgs


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One intra-op thread for these tiny models (see tests/learner/conftest.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


DPO_STEPS = 3  # seen: training-pair accuracy 0.0 (margins start at exactly 0) -> 1.0 after 1 step; loss 0.69 -> 0.23


def _ctx(method: str, tmp_path, hh_rlhf_dir, tiny_model_path, files=None, **algo):
    cfg = config_from_dict({
        "algo": {"name": method, **algo},
        "model": {"path": "tiny-random", "dtype": "float32"},
        "offline": {"pairs_files": files or [str(hh_rlhf_dir / "test.jsonl.gz")], "max_pairs": 8, "eval_fraction": 0.0,
                    "pairs_per_step": 8, "pairs_per_microbatch": 4, "max_prompt_tokens": 32, "max_response_tokens": 16},
        "learner": {"lr": 3e-3, "max_grad_norm": 10.0, "torch_threads": 1},
        "run": {"output_dir": str(tmp_path / "out")},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db"},
    })  # fmt: skip
    ctx = offline.setup(resolve_plan(cfg), Collective(), model_dir=tiny_model_path, run_id=None)
    ctx.eval_pairs = ctx.train_pairs  # measure on the training pairs
    return ctx


def test_reference_logprobs_are_cached_per_pair(tmp_path, hh_rlhf_dir, tiny_model_path, tiny_tokenizer):
    ctx = _ctx("kto", tmp_path, hh_rlhf_dir, tiny_model_path)
    table = ctx.train_pairs
    assert table.num_rows == 8 and all(table.column(c).null_count == 0 for c in ("ref_chosen_logps", "ref_kl_logps"))
    batch = collate_pairs(table, tiny_tokenizer.pad_token_id, with_kl=True)
    model = ctx.learner.module.eval()
    with torch.no_grad():  # the initial policy, unpadded, one sequence at a time
        for i in (0, 5):
            ids = table.column("prompt_token_ids")[i].as_py() + table.column("rejected_token_ids")[i].as_py()
            n = len(table.column("rejected_token_ids")[i].as_py())
            logits = model(torch.tensor([ids])).logits[0, -n - 1 : -1]
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[-n:])[:, None]).sum()
            assert table.column("ref_rejected_logps")[i].as_py() == pytest.approx(float(lp), abs=1e-4)
    assert batch.kl_inputs.response_ids.shape[0] == 8
    # KTO at step 1: policy == reference, so r = 0 and z_ref = 0; each loss is 1 - sigmoid(0) = 0.5
    metrics = offline.update(ctx, offline.take_pairs(ctx))
    assert metrics["algo/kto_kl"] == pytest.approx(0.0, abs=1e-5)
    assert metrics["learner/loss"] == pytest.approx(0.5, abs=1e-5)


def test_dpo_preference_accuracy_rises_on_its_pairs(tmp_path, hh_rlhf_dir, tiny_model_path):
    ctx = _ctx("dpo", tmp_path, hh_rlhf_dir, tiny_model_path, beta=0.1)
    before = offline.evaluate(ctx)
    assert before["eval/pairwise_accuracy"] == 0.0 and before["eval/reward_margin"] == pytest.approx(0.0, abs=1e-5)
    first = offline.update(ctx, offline.take_pairs(ctx))
    assert first["learner/loss"] == pytest.approx(math.log(2.0), abs=1e-5)  # policy == reference at step 1
    for _ in range(DPO_STEPS - 1):
        last = offline.update(ctx, offline.take_pairs(ctx))
    after = offline.evaluate(ctx)
    assert after["eval/pairwise_accuracy"] > 0.9, (before, after)
    assert after["eval/loss"] < math.log(2.0) and last["learner/loss"] < first["learner/loss"]
    # the loss is the mean of -log sigmoid(margin_i), convex in the margin: Jensen bounds it by the mean margin's
    assert after["eval/loss"] >= float(-torch.nn.functional.logsigmoid(torch.tensor(after["eval/reward_margin"]))) - 1e-6


def test_an_offline_run_logs_no_rollout_metrics(tmp_path, hh_rlhf_dir, tiny_model_path):
    """An offline run through the one run loop (rlray.run.session) logs its own keys and none of rollout/*.

    The old offline loop logged rollout/staleness_mean as a number that grew with the step (stage 8 filled it
    from a policy version that offline runs set to the step).
    """
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = config_from_dict({
        "algo": {"name": "dpo", "beta": 0.1},
        "model": {"path": "tiny-random", "dtype": "float32"},
        "offline": {"pairs_files": [str(hh_rlhf_dir / "test.jsonl.gz")], "max_pairs": 8, "eval_fraction": 0.25,
                    "pairs_per_step": 4, "pairs_per_microbatch": 2, "max_prompt_tokens": 32, "max_response_tokens": 16},
        "learner": {"lr": 1e-3, "torch_threads": 1},
        "run": {"output_dir": str(tmp_path / "out"), "max_steps": 3},
        "checkpoint": {"every_steps": 10},
        "tracking": {"mlflow_uri": uri, "experiment": "offline-keys"},
    })  # fmt: skip
    tracker = Tracker(uri, "offline-keys")
    out = worker.train(resolve_plan(cfg), WorkerArgs(cfg.model_dump(), tiny_model_path, tracker.run_id), Collective())
    assert (out.status, out.step) == ("FINISHED", 3)
    assert out.last_snapshot is not None and out.last_snapshot.endswith("step_00000003")
    logged = get_run_metrics(uri, tracker.run_id)
    assert [s for s, _ in logged["learner/loss"]] == [1, 2, 3]
    assert [s for s, _ in logged["eval/pairwise_accuracy"]] == [0, 3]  # before training and after the last step
    assert sorted(k for k in logged if k.startswith("rollout/")) == []


SKY = [{"role": "user", "content": "What color is the sky?"}]
ANSWERS = [("It is blue.", "It is green."), ("Blue, mostly.", "Purple."), ("Blue by day.", "Red."), ("Blue.", "No.")]
TRL_ROWS = {  # 8 rows of one TRL form each (the row index varies the texts)
    "standard": lambda i, c, r: {"prompt": f"Sky {i} is", "chosen": f" {c}", "rejected": f" {r}"},
    "conversational": lambda i, c, r: {"prompt": [{"role": "user", "content": f"Sky {i}?"}],
                                       "chosen": [{"role": "assistant", "content": c}],
                                       "rejected": [{"role": "assistant", "content": r}]},
    "messages": lambda i, c, r: {"messages": [{"role": "user", "content": f"Sky {i}?"}, {"role": "assistant", "content": c}]},
    "prompt_completion": lambda i, c, r: {"prompt": f"Sky {i} is", "completion": f" {c}"},
    "text": lambda i, c, r: {"text": f"Sky {i} is {c}"},
    # unpaired (kto): even rows the desirable answer, odd rows the undesirable one
    "unpaired_standard": lambda i, c, r: {"prompt": f"Sky {i} is", "completion": f" {c if i % 2 == 0 else r}",
                                          "label": i % 2 == 0},
    "unpaired_conversational": lambda i, c, r: {"prompt": [{"role": "user", "content": f"Sky {i}?"}],
                                                "completion": [{"role": "assistant", "content": c if i % 2 == 0 else r}],
                                                "label": i % 2 == 0},
}


def _trl_file(tmp_path, form):
    path = tmp_path / f"{form}.jsonl"
    rows = [TRL_ROWS[form](i, *ANSWERS[i % 4]) for i in range(8)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return [str(path)]


@pytest.mark.parametrize("form", ["standard", "conversational"])
def test_dpo_learns_pairs_of_each_trl_form(form, tmp_path, tiny_model_path):
    ctx = _ctx("dpo", tmp_path, None, tiny_model_path, files=_trl_file(tmp_path, form), beta=0.1)
    assert ctx.train_pairs.num_rows == 8
    first = offline.update(ctx, offline.take_pairs(ctx))
    assert first["learner/loss"] == pytest.approx(math.log(2.0), abs=1e-5)  # policy == reference at step 1
    last = offline.update(ctx, offline.take_pairs(ctx))
    assert last["learner/loss"] < first["learner/loss"]


@pytest.mark.parametrize("form", ["messages", "prompt_completion", "text"])
def test_sft_learns_rows_of_each_trl_form(form, tmp_path, tiny_model_path):
    ctx = _ctx("sft", tmp_path, None, tiny_model_path, files=_trl_file(tmp_path, form))
    table = ctx.train_pairs
    assert table.num_rows == 8 and all(r == [] for r in table.column("rejected_token_ids").to_pylist())
    # the loss is the token-mean NLL over the completions (here: every response token, the first step at the initial policy)
    batch = collate_pairs(table, ctx.tokenizer.pad_token_id)
    model = ctx.learner.module
    with torch.no_grad():
        nll, count = 0.0, 0
        for i in range(8):
            prompt, chosen = table.column("prompt_token_ids")[i].as_py(), table.column("chosen_token_ids")[i].as_py()
            logits = model(torch.tensor([prompt + chosen])).logits[0, len(prompt) - 1 : -1]
            nll -= float(torch.log_softmax(logits, -1).gather(-1, torch.tensor(chosen)[:, None]).sum())
            count += len(chosen)
    assert batch.response_mask[8:].sum() == 0  # no rejected tokens
    first = offline.update(ctx, offline.take_pairs(ctx))
    assert first["learner/loss"] == pytest.approx(nll / count, rel=1e-4)
    for _ in range(2):
        last = offline.update(ctx, offline.take_pairs(ctx))
    assert last["learner/loss"] < first["learner/loss"]
    assert offline.evaluate(ctx)["eval/loss"] < first["learner/loss"]  # eval runs without a rejected side


@pytest.mark.parametrize("form", ["unpaired_standard", "unpaired_conversational"])
def test_kto_learns_unpaired_rows_of_each_trl_form(form, tmp_path, tiny_model_path):
    ctx = _ctx("kto", tmp_path, None, tiny_model_path, files=_trl_file(tmp_path, form), beta=0.5)
    table = ctx.train_pairs
    assert table.column("label").to_pylist() == [i % 2 == 0 for i in range(8)]
    first = offline.update(ctx, offline.take_pairs(ctx))
    # policy == reference at step 1: r = 0 and z_ref = 0, each of the 8 examples' losses is 1 - sigmoid(0) = 0.5
    assert first["learner/loss"] == pytest.approx(0.5, abs=1e-5) and first["algo/kto_kl"] == pytest.approx(0.0, abs=1e-5)
    assert "algo/pairwise_accuracy" not in first  # no pairs: the accuracy is not defined
    for _ in range(2):
        last = offline.update(ctx, offline.take_pairs(ctx))
    assert last["learner/loss"] < first["learner/loss"]
    # the desirable completions gained implicit reward over the undesirable ones
    assert last["algo/chosen_reward"] > last["algo/rejected_reward"]
    assert last["algo/reward_margin"] == pytest.approx(last["algo/chosen_reward"] - last["algo/rejected_reward"])
    assert "margin=" in ctx.progress_text(3, last)


def test_sft_rows_are_refused_by_preference_methods(tmp_path, tiny_model_path):
    with pytest.raises(DataError, match=r"messages.jsonl:1: this row has no 'rejected' side: it is SFT data, which only "
                                        r"algo.name=sft takes, not dpo"):
        _ctx("dpo", tmp_path, None, tiny_model_path, files=_trl_file(tmp_path, "messages"))


def test_the_documented_kto_run_trains_on_unpaired_rows(tmp_path, tiny_model_path):
    """docs/data.md's command, `rlray train configs/algos/kto.yaml "offline.pairs_files=[docs/examples/kto_unpaired.jsonl]"`,
    through the one run loop in process (the CLI and Ray path of offline runs is tests/run/test_algos_e2e.py's):
    the config and the example file as shipped, at test size."""
    from pathlib import Path

    from rlray.config import load_config

    repo = Path(__file__).resolve().parents[2]
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = load_config(repo / "configs/algos/kto.yaml", [
        f"offline.pairs_files=[{repo}/docs/examples/kto_unpaired.jsonl]", "model.path=tiny-random", "model.dtype=float32",
        "run.max_steps=2", "offline.pairs_per_step=4", "offline.pairs_per_microbatch=2", "learner.torch_threads=1",
        f"run.output_dir={tmp_path}/out", f"tracking.mlflow_uri={uri}", "learner.warmup_steps=0",
    ])  # fmt: skip
    tracker = Tracker(uri, cfg.tracking.experiment)
    out = worker.train(resolve_plan(cfg), WorkerArgs(cfg.model_dump(), tiny_model_path, tracker.run_id), Collective())
    assert (out.status, out.step) == ("FINISHED", 2)
    logged = get_run_metrics(uri, tracker.run_id)
    assert logged["data/train_pairs"][0][1] + logged["data/eval_pairs"][0][1] == 8  # 8 unpaired rows, none skipped
    assert logged["data/skipped_pairs"][0][1] == 0
    assert logged["learner/loss"][0][1] == pytest.approx(0.5, abs=1e-5)  # policy == reference at step 1
    assert [s for s, _ in logged["algo/chosen_reward"]] == [1, 2] and "algo/pairwise_accuracy" not in logged
    assert [s for s, _ in logged["eval/reward_margin"]] == [0, 2] and "eval/pairwise_accuracy" not in logged
