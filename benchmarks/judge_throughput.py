"""Judge throughput on this machine: judgements per second of one replica, pointwise against group mode (G=4, G=8),
and the share of a GRPO step's wall time that judging takes.

    python benchmarks/judge_throughput.py [--judge smollm2-135m-instruct] [--samples 32] [--batches 2]
                                          [--backend vllm] [--train-steps 3] [--skip-train]

One judge application (``rlray-judge-bench``, 1 replica) is deployed and hot-swapped (``reconfigure``) to each
mode in turn; the swap's seconds are reported too. Judged: GSM8K train questions with reference solutions as the
responses (one per prompt pointwise; G solutions of neighbouring rows per prompt in group mode), the cache off, one
warm-up batch, then ``--batches`` batches of ``--samples`` responses. Modes:

- pointwise, sampled: the built-in 0-10 template, prefill ``Score:``, 4 new tokens;
- pointwise, label logprobs: configs/judge_gsm8k_smollm2.yaml's judge (one token);
- group, G=4 and G=8: the built-in group template, prefill ``Response 1:``, 7 new tokens per response.

Then (without ``--skip-train``) a GRPO run of configs/judge_gsm8k_smollm2.yaml for ``--train-steps`` steps (no eval,
no snapshots) gives the judge's share of a step: timing/reward_s over timing/step_s, the median over the steps after
the first. Prints a markdown table and writes bench_results/judge_throughput.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib  # noqa: E402

CONFIG = benchlib.REPO / "configs" / "judge_gsm8k_smollm2.yaml"
APP = "rlray-judge-bench"


def mode_specs(judge: str, backend: str, max_model_len: int = 2048, kv_cache_gib: float = 0.5) -> dict[str, dict]:
    """Returns the reward.judges entry of each measured mode (name -> entry)."""
    from rlray.config import load_config

    label = load_config(CONFIG).reward.judges[0].model_dump()
    common = {"name": "bench", "path": judge, "backend": backend, "max_model_len": max_model_len, "kv_cache_gib": kv_cache_gib}
    return {
        "pointwise, sampled": {**common, "prefill": "Score:", "max_new_tokens": 4, "parse": {"match": "first"}},
        "pointwise, label logprobs": {**label, **common},
        "group, G=4": {**common, "mode": "group", "prefill": "Response 1:", "max_new_tokens": 28},
        "group, G=8": {**common, "mode": "group", "prefill": "Response 1:", "max_new_tokens": 56},
    }


def data(count: int) -> tuple[list[str], list[str], list[dict]]:
    """Returns (questions, reference solutions, row columns) of the first ``count`` GSM8K train rows."""
    from rlray.data import load_prompt_rows

    rows = load_prompt_rows([str(benchlib.gsm8k_train_file())], prompt_column="question")[:count]
    return [r.prompt for r in rows], [str(r.columns["answer"]) for r in rows], [dict(r.columns) for r in rows]


def measure(name: str, entry: dict, args: argparse.Namespace) -> dict:
    """Swaps the bench judge to ``entry`` and times ``args.batches`` batches; returns the row of the table."""
    from rlray.config import config_from_dict
    from rlray.launch.judges import judge_specs
    from rlray.plan import resolve_plan
    from rlray.reward.judges.client import JudgeClient
    from rlray.reward.judges.deployment import ServeJudgeCaller, build_judge_app, deploy_judge_app

    cfg = config_from_dict({"reward": {"judges": [entry]}})
    spec = dataclasses.replace(judge_specs(resolve_plan(cfg))[0], name="bench")
    t = time.perf_counter()
    deploy_judge_app(build_judge_app(spec, version=int(time.time())), APP)
    swap_s = time.perf_counter() - t
    group = 4 if "G=4" in name else 8 if "G=8" in name else 1
    client = JudgeClient("bench", entry.get("mode", "pointwise"), ServeJudgeCaller(APP), cache_entries=0, timeout_s=600)
    n = args.samples
    prompts, answers, columns = data(n * (args.batches + 1) + group)
    seconds, failures = [], 0
    for b in range(args.batches + 1):  # batch 0 warms up
        lo = b * n
        ps = [prompts[lo + i // group * group] for i in range(n)]  # G neighbouring solutions per prompt
        t = time.perf_counter()
        got = client.score(ps, answers[lo : lo + n], [columns[lo + i // group * group] for i in range(n)],
                           [i // group for i in range(n)], seed=b)  # fmt: skip
        if b:
            seconds.append(time.perf_counter() - t)
            failures += sum(s != s for s in got.scores)
        stats = client.take_stats()
    client.close()
    total = sum(seconds)
    return {"mode": name, "group": group, "swap_s": swap_s, "judgements_per_s": n * args.batches / total,
            "calls_per_s": n * args.batches / group / total, "prompt_tokens_per_call": stats.prompt_tokens / (n / group),
            "output_tokens_per_call": stats.output_tokens / (n / group), "parse_failures": failures}  # fmt: skip


def step_share(args: argparse.Namespace, folder: Path) -> dict:
    """Returns the judge's share of a GRPO step (configs/judge_gsm8k_smollm2.yaml, ``--train-steps`` steps)."""
    from rlray.config import load_config
    from rlray.launch.driver import run_training

    recorder = folder / "steps.jsonl"
    recorder.unlink(missing_ok=True)  # a previous run's steps
    cfg = load_config(CONFIG, [f"run.max_steps={args.train_steps}", "eval.num_problems=0", "checkpoint.every_steps=1000",
                               f"run.output_dir={folder}/out", f"tracking.mlflow_uri=sqlite:///{folder}/mlflow.db"])
    cfg.reward.judges[0].backend = args.backend
    cfg.reward.judges[0].path = args.judge
    result = run_training(cfg, step_hooks=[benchlib.StepRecorder(str(recorder))])
    steps = [s["metrics"] for s in benchlib.read_steps(recorder)][1:]  # after the first step (engine warm-up)
    share = [m["timing/reward_s"] / m["timing/step_s"] for m in steps]
    return {"status": result.status, "steps": len(steps), "reward_s": statistics.median(m["timing/reward_s"] for m in steps),
            "step_s": statistics.median(m["timing/step_s"] for m in steps), "share": statistics.median(share),
            "judge_latency_s": statistics.median(m.get("reward/judge_latency_s", float("nan")) for m in steps),
            "samples_per_step": cfg.sequences_per_step}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--judge", default="smollm2-135m-instruct")
    p.add_argument("--backend", default="vllm", choices=["vllm", "hf"])
    p.add_argument("--samples", type=int, default=32, help="responses per timed batch")
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--train-steps", type=int, default=3)
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--modes", default="", help="only the modes whose name contains this text (default: all)")
    p.add_argument("--max-model-len", type=int, default=2048, help="the judge's context (tokens)")
    p.add_argument("--kv-cache-gib", type=float, default=0.5, help="the judge's KV cache per replica (GiB)")
    args = p.parse_args()
    from ray import serve

    from rlray.reward.server import start_serve
    from rlray.rollout.weight_sync import free_port

    benchlib.init_local_ray()
    start_serve(host="127.0.0.1", port=free_port())
    load_before = benchlib.machine()["load_avg_1m"]
    modes = mode_specs(args.judge, args.backend, args.max_model_len, args.kv_cache_gib)
    rows = [measure(name, entry, args) for name, entry in modes.items() if args.modes in name]
    serve.delete(APP)
    share = None if args.skip_train else step_share(args, benchlib.RESULTS_DIR / "judge_throughput_run")
    cpu = benchlib.machine()
    print(f"Judge {args.judge} ({args.backend}), one replica, {cpu['host_cores']} cores (1-minute load {load_before:.1f} "
          f"before, {cpu['load_avg_1m']:.1f} after), {args.samples} responses per batch, {args.batches} timed batches:\n")
    print(benchlib.markdown_table(
        ["mode", "judgements/s", "calls/s", "judge prompt tokens/call", "output tokens/call", "parse failures", "hot swap s"],
        [[r["mode"], benchlib.fmt(r["judgements_per_s"]), benchlib.fmt(r["calls_per_s"]),
          benchlib.fmt(r["prompt_tokens_per_call"], 0), benchlib.fmt(r["output_tokens_per_call"], 1), r["parse_failures"],
          benchlib.fmt(r["swap_s"], 1)] for r in rows]))  # fmt: skip
    if share is not None:
        print(f"\nGRPO step ({share['samples_per_step']} samples, configs/judge_gsm8k_smollm2.yaml): reward stage "
              f"{share['reward_s']:.1f} s of {share['step_s']:.1f} s ({benchlib.fmt_percent(share['share'])}), "
              f"median over {share['steps']} steps; run {share['status']}")
    print("results:", benchlib.write_results("judge_throughput", {"machine": cpu, "modes": rows, "step": share}))


if __name__ == "__main__":
    main()
