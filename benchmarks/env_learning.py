"""make demo's learning bar: SmolLM2-135M-Instruct learns a multi-turn environment on this CPU, held-out set before/after.

    python benchmarks/env_learning.py                        # configs/envs/retry_arith_smollm2.yaml, seed 0
    python benchmarks/env_learning.py --steps 30 --seed 0
    python benchmarks/env_learning.py --calibrate            # the base model on the calibration split only
    python benchmarks/env_learning.py --task rgym            # configs/grpo_rgym_learn_smollm2.yaml: reasoning-gym

The whole command, timed end to end:
1. the base model on the held-out episodes (data.eval_files, 200 rows), greedy, twice on one rollout actor
   (``rlray.launch.driver.eval_setup``; the engine is reseeded per call); the two must give identical episodes
   (checked and printed),
2. ``--steps`` GRPO steps (``rlray.launch.driver.run_training`` with the config; run.seed = ``--seed``),
3. the final snapshot on the same held-out episodes.

Success is the environment's own end result (its reward above 0, the episode not failed), per episode. The table
gives before, after, the paired difference with its standard error, a one-sided exact McNemar test on the episodes
whose outcome changed (``mcnemar_one_sided``: b improved vs c worsened, P(X >= b) for X ~ Binomial(b + c, 1/2)),
the valid-action rate (valid turns / turns: the environment's ``valid_action`` metric), turns per episode, the
training's env/turns_mean (first and last step), the median step time (MLflow timing/step_s) and the command's
wall time. The bar: p < 0.025, base success 10-60%, base turns >= 2, wall time < 30 min.

A config without environments (``--task rgym``: reasoning-gym's chain_sum rows scored by the built-in reward
reasoning_gym) runs one completion per held-out row instead of an episode: success is its total reward >= 1.0
(``SUCCESS_REWARD``: the generator's score_answer gave full marks), turns are 1 and the turns bar does not apply.

``--calibrate`` evaluates only the base model on the calibration split (data/retry-arith/calibration.jsonl, or for a
``reasoning-gym:`` held-out source the same source with ``split=calibration``): that split alone chooses the task
and its difficulty. Results go to outputs/env_learning/<name>.json (not committed).
Pure helpers (``mcnemar_one_sided``, ``paired_difference``) have tests in tests/benchmarks/test_env_learning.py.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))

from benchlib import fmt, fmt_percent, markdown_table  # noqa: E402

CONFIG = "configs/envs/retry_arith_smollm2.yaml"
RGYM_CONFIG = "configs/grpo_rgym_learn_smollm2.yaml"
TASKS = {"retry-arith": CONFIG, "rgym": RGYM_CONFIG}
CALIBRATION_FILE = "data/retry-arith/calibration.jsonl"
HELDOUT_EPISODES = 200
P_BAR = 0.025
WALL_BAR_S = 30 * 60
SUCCESS_REWARD = 1.0  # a single-turn (reward.functions) row succeeds at full marks: score_answer 1.0


def mcnemar_one_sided(improved: int, worsened: int) -> float:
    """Returns the one-sided exact McNemar p-value that ``improved`` > ``worsened`` happened by chance.

    Of the n = improved + worsened discordant pairs (episodes whose outcome changed), under H0 each changed either
    way with probability 1/2: p = P(X >= improved) for X ~ Binomial(n, 1/2) = sum_{k >= improved} C(n, k) / 2^n,
    exact (integer arithmetic). p = 1.0 when no pair changed.
    """
    n = improved + worsened
    return sum(math.comb(n, k) for k in range(improved, n + 1)) / 2**n


def paired_difference(before: Sequence[float], after: Sequence[float]) -> tuple[float, float]:
    """Returns (mean of after - before, its standard error) over paired outcomes (the same episodes twice).

    Standard error: sample standard deviation (denominator n - 1) of the per-pair differences over sqrt(n).
    """
    diffs = [a - b for b, a in zip(before, after, strict=True)]
    return statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs))


def episode_outcomes(cfg: Any, model_path: str, repeats: int = 1) -> list[list[dict[str, Any]]]:
    """Returns ``repeats`` greedy evaluations of ``model_path``, each one episode per eval row of ``cfg`` (its first
    eval.num_problems) as plain records, on one rollout actor (its engine reseeded before each generate call).

    A config without environments (prompt rows scored by reward.functions, e.g. a ``reasoning-gym:`` source) gets
    each row's one completion scored by the run's reward (``rlray.run.experience.score``); its "episode" is that
    completion (``_scored_record``).
    """
    from rlray.launch.driver import eval_setup
    from rlray.run import build
    from rlray.run.experience import score

    runs = []
    with eval_setup(cfg, model_path) as setup:
        rows = [row for row, _ in setup.prompts]
        for _ in range(repeats):
            completions = setup.rollouts.generate([ids for _, ids in setup.prompts], build.eval_sampling(cfg), rows)
            texts = [setup.tokenizer.decode(c.response_token_ids) for c in completions]
            if all(c.episode is not None for c in completions):
                runs.append([_record(row, c, t) for row, c, t in zip(rows, completions, texts, strict=True)])
                continue
            values = score(setup.reward, rows, completions, setup.tokenizer).values
            runs.append([_scored_record(row, c, t, values, i)
                         for i, (row, c, t) in enumerate(zip(rows, completions, texts, strict=True))])
    return runs


def _record(row: Any, completion: Any, text: str) -> dict[str, Any]:
    """Returns one episode's outcome: row id, success, env reward, turns, failure, valid turns, stop reason, text."""
    e = completion.episode
    return {"id": row.prompt_id, "success": int((e.env_reward or 0.0) > 0 and not e.failed), "env_reward": e.env_reward or 0.0,
            "turns": e.num_turns, "failed": e.failed, "valid_turns": e.metrics.get("valid_action", 0.0),
            "stop_reason": e.stop_reason, "text": text}


def _scored_record(row: Any, completion: Any, text: str, values: dict[str, list], index: int) -> dict[str, Any]:
    """Returns one single-turn completion's outcome in ``_record``'s keys: success is a total reward >= SUCCESS_REWARD
    (for the reasoning_gym reward: the generator's score_answer gave full marks, partial credit is no success);
    env_reward is the total reward (0.0 where NaN or skipped), one turn, valid_turns 1 where the reward is
    above 0."""
    value = values["reward"][index]
    reward = 0.0 if value is None or math.isnan(value) else float(value)
    return {"id": row.prompt_id, "success": int(reward >= SUCCESS_REWARD), "env_reward": reward, "turns": 1,
            "failed": False, "valid_turns": float(reward > 0), "stop_reason": completion.finish_reason, "text": text}


def summary(episodes: list[dict[str, Any]]) -> dict[str, float]:
    """Returns success rate, mean env reward, valid-action rate (valid turns / turns), turns mean and failures."""
    turns = sum(e["turns"] for e in episodes)
    return {"success": statistics.fmean(e["success"] for e in episodes),
            "env_reward": statistics.fmean(e["env_reward"] for e in episodes),
            "first_attempt": statistics.fmean(e["env_reward"] == 1.0 for e in episodes),
            "valid_action_rate": sum(e["valid_turns"] for e in episodes) / max(turns, 1),
            "turns_mean": turns / len(episodes), "failed": sum(e["failed"] for e in episodes),
            "episodes": len(episodes)}


def step_metrics(run_id: str, tracking_uri: str) -> dict[str, list[float]]:
    """Returns the per-step values of timing/step_s, env/turns_mean and reward/mean of an MLflow run, in step order."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    keys = ("timing/step_s", "env/turns_mean", "reward/mean")
    return {k: [m.value for m in sorted(client.get_metric_history(run_id, k), key=lambda m: m.step)] for k in keys}


def load_config(path: str, overrides: list[str]) -> Any:
    """Returns the validated config of ``path`` with dotted ``overrides``."""
    from rlray.config import load_config as load

    return load(path, overrides)


def calibration_source(eval_files: list[str]) -> str:
    """Returns the calibration split of a config: its ``reasoning-gym:`` held-out source with ``split=calibration``
    (the same generators and options, questions no held-out or training item has), else CALIBRATION_FILE."""
    source = eval_files[0] if eval_files else ""
    if source.startswith("reasoning-gym:") and "split=heldout" in source:
        return source.replace("split=heldout", "split=calibration")
    return CALIBRATION_FILE


def calibrate(args: argparse.Namespace) -> dict[str, Any]:
    """Returns (and prints) the base model's figures on the calibration split."""
    cfg = load_config(args.config, [f"run.seed={args.seed}", *args.set])
    cfg.data.eval_files = [args.calibration_file or calibration_source(cfg.data.eval_files)]
    cfg.eval.num_problems = args.calibration_episodes
    (episodes,) = episode_outcomes(cfg, cfg.model.path)
    s = summary(episodes)
    print(markdown_table(["split", "episodes", "success", "first attempt", "valid-action rate", "turns mean"],
                         [["calibration", s["episodes"], fmt_percent(s["success"]), fmt_percent(s["first_attempt"]),
                           fmt_percent(s["valid_action_rate"]), fmt(s["turns_mean"])]]))
    return {"summary": s, "episodes": episodes}


def learn(args: argparse.Namespace, started: float) -> dict[str, Any]:
    """Returns the before/after figures of one seeded run (module docstring), and prints its table."""
    from rlray.launch.driver import resolve_paths, run_training
    from rlray.launch.preflight import preflight
    from rlray.plan import resolve_plan

    cfg = load_config(args.config, [f"run.seed={args.seed}", f"run.max_steps={args.steps}", *args.set])
    preflight(resolve_plan(resolve_paths(cfg)))  # the training run's inputs, checked before the first evaluation
    eval_cfg = cfg.model_copy(deep=True)
    eval_cfg.eval.num_problems = HELDOUT_EPISODES
    base_a, base_b = episode_outcomes(eval_cfg, cfg.model.path, repeats=2)
    identical = [(e["success"], e["turns"], e["text"]) for e in base_a] == [(e["success"], e["turns"], e["text"]) for e in base_b]
    print(f"base model evaluated twice: {'identical' if identical else 'DIFFERENT'} episodes", flush=True)
    result = run_training(cfg, verbose=args.verbose)
    if not result.final_snapshot:
        raise RuntimeError(f"training ended {result.status} without a snapshot to evaluate"
                           f"{': ' + result.error if result.error else ''} (a guard that stops the run before the first "
                           "periodic snapshot leaves none: see guard.* and checkpoint.every_steps in the config)")
    (after,) = episode_outcomes(eval_cfg, result.final_snapshot)
    before_s, after_s = summary(base_a), summary(after)
    improved = sum(b["success"] < a["success"] for b, a in zip(base_a, after, strict=True))
    worsened = sum(b["success"] > a["success"] for b, a in zip(base_a, after, strict=True))
    diff, se = paired_difference([e["success"] for e in base_a], [e["success"] for e in after])
    p = mcnemar_one_sided(improved, worsened)
    steps = step_metrics(result.run_id, result.tracking_uri)
    wall_s = time.time() - started
    out = {"seed": args.seed, "steps": args.steps, "config": args.config, "overrides": args.set, "run_id": result.run_id,
           "status": result.status, "snapshot": result.final_snapshot, "base_identical": identical,
           "before": before_s, "after": after_s, "difference": diff, "difference_se": se, "improved": improved,
           "worsened": worsened, "mcnemar_p": p, "step_metrics": steps,
           "median_step_s": statistics.median(steps["timing/step_s"]) if steps["timing/step_s"] else None,
           "wall_s": wall_s}
    multi_turn = bool(cfg.env.environments)  # a single-turn (reward.functions) config has one turn per row
    out["passed"] = bool(identical and p < P_BAR and wall_s < WALL_BAR_S and 0.1 <= before_s["success"] <= 0.6
                         and (before_s["turns_mean"] >= 2 or not multi_turn))
    print_table(out)
    out["episodes"] = {"base": base_a, "base_again": base_b, "after": after}
    return out


def print_table(r: dict[str, Any]) -> None:
    """Prints the learning bar's table of one run."""
    b, a, turns = r["before"], r["after"], r["step_metrics"]["env/turns_mean"]
    rows = [
        ["held-out success", fmt_percent(b["success"]), fmt_percent(a["success"]),
         f"{r['difference'] * 100:+.1f} pts (SE {r['difference_se'] * 100:.1f})"],
        ["first-attempt success", fmt_percent(b["first_attempt"]), fmt_percent(a["first_attempt"]), ""],
        ["mean env reward", fmt(b["env_reward"], 3), fmt(a["env_reward"], 3), ""],
        ["valid-action rate (turns)", fmt_percent(b["valid_action_rate"]), fmt_percent(a["valid_action_rate"]), ""],
        ["turns per episode", fmt(b["turns_mean"]), fmt(a["turns_mean"]), ""],
        ["McNemar (one-sided exact)", "", "", f"b={r['improved']} improved, c={r['worsened']} worsened, p={r['mcnemar_p']:.2g}"],
        ["env/turns_mean (training)", fmt(turns[0]) if turns else "-", fmt(turns[-1]) if turns else "-", "first / last step"],
        ["median step time", "", "", f"{fmt(r['median_step_s'], 1)} s over {len(r['step_metrics']['timing/step_s'])} steps"],
        ["base evaluated twice", "", "", "identical" if r["base_identical"] else "DIFFERENT"],
        ["wall time (whole command)", "", "", f"{r['wall_s'] / 60:.1f} min"],
    ]
    print(markdown_table(["", "before", "after", "difference / note"], rows))
    print(f"learning bar (p < {P_BAR}, base success 10-60%, base turns >= 2 with environments, identical base, < 30 min): "
          f"{'PASSED' if r['passed'] else 'NOT PASSED'}", flush=True)


def main(argv: list[str] | None = None) -> int:
    started = time.time()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="retry-arith",
                        help="which learning bar: its config (retry-arith: make demo's; rgym: a reasoning-gym task)")
    parser.add_argument("--config", default=None, help="a config of its own (default: --task's)")
    parser.add_argument("--seed", type=int, default=0, help="run.seed (training sampling, data order)")
    parser.add_argument("--steps", type=int, default=40, help="GRPO steps (run.max_steps)")
    parser.add_argument("--set", action="append", default=[], help="extra dotted config override (repeatable)")
    parser.add_argument("--calibrate", action="store_true", help="only the base model on the calibration split")
    parser.add_argument("--calibration-episodes", type=int, default=200)
    parser.add_argument("--calibration-file", default=None, help="the calibration split's rows (default: the config's "
                        "reasoning-gym held-out source with split=calibration, else " + CALIBRATION_FILE + ")")
    parser.add_argument("--name", default=None, help="results file name (default env_learning or env_calibration)")
    parser.add_argument("-v", "--verbose", action="store_true", help="every process's output on the console (as rlray train -v)")
    args = parser.parse_args(argv)
    args.config = args.config or TASKS[args.task]
    from rlray.launch.console import configure_console
    from rlray.launch.driver import init_ray

    configure_console(args.verbose)  # as `rlray train`: library chatter and Ray's forwarded lines off unless -v
    init_ray(include_dashboard=False, log_to_driver=args.verbose)
    out = calibrate(args) if args.calibrate else learn(args, started)
    path = REPO / "outputs" / "env_learning" / f"{args.name or ('env_calibration' if args.calibrate else 'env_learning')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str))
    print(f"results: {path}")
    return 0 if args.calibrate or out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
