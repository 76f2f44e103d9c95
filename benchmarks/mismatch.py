"""The rollout/learner mismatch: the engine's logprobs of the tokens it sampled against the learner's, same weights.

    .venv/bin/python benchmarks/mismatch.py                       # SmolLM2-135M-Instruct, float32 and bfloat16
    .venv/bin/python benchmarks/mismatch.py --prompts 4 --max-new-tokens 16 --model tiny-random --dtypes float32

For each precision (``model.dtype``), in a fresh child process, the demo config (configs/grpo_gsm8k_smollm2.yaml)
with ``model.dtype`` set, ``rollout.temperature=1.0`` and ``rollout.max_new_tokens`` (64) is turned into the
objects a run builds, through the run's own functions:

1. the first ``--prompts`` GSM8K test questions, chat-templated with the config's instruction as a run's rank 0
   templates its training prompts (``rlray.run.build.training_prompts`` over data/gsm8k/test.jsonl);
2. the rollout engine a rollout actor starts (``RolloutEngine`` with ``rlray.launch.actors.rollout_engine_kwargs``:
   backend vllm, the engine dtype of ``model.dtype``, eager), which samples the config's ``samples_per_prompt`` (4)
   completions per prompt with step 0's seed, and reports each token's logprob (``rollout_logprobs``); it is shut
   down before the learner loads;
3. the policy learner of a run (``PolicyLearner`` with ``rlray.run.build.learner_kwargs``: float32 master weights,
   bf16 autocast when the dtype is bfloat16), whose ``logprobs`` (``rlray.learner.scoring.batched_logprobs``,
   the run's micro-batching and layout) gives the learner's logprobs of the same tokens, what a step's
   ``old_logprobs`` are (stage 4).

Over the sampled tokens (``response_mask``), with d = learner - rollout logprob (nats), it reports:
- k3 KL: the token mean of ``algos.kl_penalty(rollout, learner, "k3")`` = exp(d) - d - 1, the estimate of
  KL(pi_rollout || pi_learner) from the engine's own samples (Schulman 2020), the value a run logs as
  ``algo/rollout_kl``; computed in float64 here, since in float32 the exp(d) - 1 of |d| ~ 1e-5 is lost in rounding
  (the float32 value, as the run computes it, is reported beside it);
- mean, p99 and max |d|, and the fraction of tokens with |d| > 0.1 nats;
- the fraction of tokens the default rollout correction (``algo.rollout_correction``: token_truncate,
  ratio_max 2.0) truncates, i.e. with pi_learner / pi_rollout > 2.

Precision of the two sides: in float32 both run float32 weights and float32 kernels (vLLM's CPU kernels against
transformers'). In bfloat16 they differ by design: the engine holds bf16 weights and computes in bf16, while the
learner keeps float32 master weights and runs under bf16 autocast (bf16 matmuls over the same bf16-rounded weights;
embeddings, RMSNorm and the log-softmax in float32).

prime-rl's published bar for this gap is a mismatch KL below 0.01 (docs/algorithms.md, "Rollout/learner mismatch").
Prints a markdown table and writes bench_results/mismatch.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

from benchlib import REPO, fmt, fmt_percent, gsm8k_train_file, markdown_table, write_results

CONFIG = REPO / "configs" / "grpo_gsm8k_smollm2.yaml"
DTYPES = ("float32", "bfloat16")
BIG_DIFF_NATS = 0.1  # |learner - rollout| counted as a large per-token difference
PRIME_RL_KL_BAR = 0.01  # prime-rl: mismatch KL < 0.01 (nats/token)


def mismatch_stats(rollout_logprobs: Any, learner_logprobs: Any, response_mask: Any, *,
                   ratio_max: float = 2.0) -> dict[str, float]:
    """Returns the mismatch statistics of the sampled tokens: k3 KL, mean/p99/max |d|, the fraction with |d| >
    ``BIG_DIFF_NATS`` and the fraction the default correction truncates, with d = learner - rollout (nats).

    Args:
        rollout_logprobs: [B, T] logprobs (nats) the engine reported for the tokens it sampled.
        learner_logprobs: [B, T] logprobs (nats) of the same tokens under the learner.
        response_mask: [B, T] bool, True on sampled tokens (values elsewhere are ignored).
        ratio_max: the correction's bound on pi_learner / pi_rollout (``algo.rollout_correction.ratio_max``).

    Returns:
        {"tokens", "k3_kl" (token mean, nats), "k3_kl_float32" (the same in float32 arithmetic, as the run's
        ``algo/rollout_kl`` is computed), "mean_abs_diff", "p99_abs_diff", "max_abs_diff" (nats),
        "frac_abs_diff_gt_0.1", "frac_truncated"}; every mean is over the valid tokens. Computed in float64.

    Raises:
        ValueError: the shapes differ or no token is valid.
    """
    import math

    import torch

    from rlray import algos

    rollout, learner = rollout_logprobs.double(), learner_logprobs.double()
    if rollout.shape != learner.shape or response_mask.shape != rollout.shape:
        raise ValueError(f"mismatch_stats: shapes {tuple(rollout.shape)}, {tuple(learner.shape)} and mask "
                         f"{tuple(response_mask.shape)} differ")
    if not bool(response_mask.any()):
        raise ValueError("mismatch_stats: no valid token in response_mask")
    # kl_penalty(x, y) estimates KL(pi_x || pi_y) from samples of pi_x: here the engine sampled, so x = rollout
    k3 = algos.kl_penalty(rollout, learner, "k3")[response_mask]
    logged = algos.kl_penalty(rollout.float(), learner.float(), "k3")[response_mask]  # as the run computes it
    d = (learner - rollout)[response_mask]
    return {
        "tokens": int(response_mask.sum()),
        "k3_kl": float(k3.mean()),
        "k3_kl_float32": float(logged.double().mean()),
        "mean_abs_diff": float(d.abs().mean()),
        "p99_abs_diff": float(torch.quantile(d.abs(), 0.99)),
        "max_abs_diff": float(d.abs().max()),
        f"frac_abs_diff_gt_{BIG_DIFF_NATS}": float((d.abs() > BIG_DIFF_NATS).double().mean()),
        "frac_truncated": float((d > math.log(ratio_max)).double().mean()),
    }


def sample_and_score(model: str, dtype: str, prompts: int, max_new_tokens: int, overrides: tuple[str, ...] = (), *,
                     learner_threads: bool = False) -> dict[str, Any]:
    """Samples GSM8K test prompts with the run's engine (``CONFIG`` with ``overrides``), then scores the samples with
    the run's learner on the same weights (stage 4's pass); runs in a child process of a benchmark.
    ``learner_threads``: the learner's pass runs on the plan's learner threads (a run's count), else on torch's own.

    Returns:
        {"cfg", "prompt_ids", "completions", "inputs", "rollout" ([B, T] float64, the engine's logprobs, 0 past each response),
        "learner" ([B, T] float32, the learner's), "mask" ([B, T] bool, response tokens), "seconds" (engine_start,
        generate, learner_load, learner_logprobs)}.
    """
    import torch

    from rlray.config import load_config
    from rlray.launch.actors import rollout_cpu_threads, rollout_engine_kwargs
    from rlray.launch.driver import max_model_len
    from rlray.learner import PolicyLearner
    from rlray.models import load_tokenizer, resolve_model_path
    from rlray.plan import resolve_plan
    from rlray.rollout import RolloutEngine
    from rlray.run import build
    from rlray.schema import pack_sequences, response_mask_from_lengths

    test_file = gsm8k_train_file().with_name("test.jsonl")
    cfg = load_config(CONFIG, [f"model.path={model}", f"model.dtype={dtype}", "rollout.temperature=1.0",
                               f"rollout.max_new_tokens={max_new_tokens}", f"data.train_files=[{test_file}]", *overrides])
    model_dir = resolve_model_path(cfg.model.path)
    tokenizer = load_tokenizer(model_dir, cfg.model.chat_template)
    prompt_ids = build.training_prompts(cfg, tokenizer)[2][:prompts]
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    plan = resolve_plan(cfg)
    engine = RolloutEngine(model_dir, **rollout_engine_kwargs(plan, max_model_len(cfg), rollout_cpu_threads(plan)[0],
                                                              model_dir))
    seconds["engine_start"] = time.perf_counter() - start
    try:
        start = time.perf_counter()
        completions = engine.generate(prompt_ids, build.sampling_for_step(cfg, 0))
        seconds["generate"] = time.perf_counter() - start
    finally:
        engine.shutdown()
    inputs = pack_sequences([prompt_ids[c.prompt_index] for c in completions],
                            [c.response_token_ids for c in completions], tokenizer.pad_token_id)
    width = inputs.response_ids.shape[1]
    rollout = torch.tensor([c.rollout_logprobs + [0.0] * (width - len(c.rollout_logprobs)) for c in completions],
                           dtype=torch.float64)
    start = time.perf_counter()
    learner = PolicyLearner(model_dir, **build.learner_kwargs(cfg, world=1, with_reference=False))
    if learner_threads:
        torch.set_num_threads(build.core_plan(cfg).learner_threads)
    seconds["learner_load"] = time.perf_counter() - start
    start = time.perf_counter()
    old = learner.logprobs(inputs, reference=False, batching=build.micro_batching(cfg))
    seconds["learner_logprobs"] = time.perf_counter() - start
    return {"cfg": cfg, "prompt_ids": prompt_ids, "completions": completions, "inputs": inputs, "rollout": rollout, "learner": old,
            "mask": response_mask_from_lengths(inputs), "seconds": seconds}


def _measure(model: str, dtype: str, prompts: int, max_new_tokens: int) -> dict[str, Any]:
    """Runs in the child: samples with the run's engine, scores with the run's learner; returns the statistics."""
    got = sample_and_score(model, dtype, prompts, max_new_tokens)
    stats = mismatch_stats(got["rollout"], got["learner"], got["mask"],
                           ratio_max=got["cfg"].algo.rollout_correction.ratio_max)
    return {"dtype": dtype, "engine_dtype": dtype, "learner": _learner_precision(dtype), "prompts": len(got["prompt_ids"]),
            "sequences": len(got["completions"]), "seconds": got["seconds"], **stats}


def _learner_precision(dtype: str) -> str:
    """Returns how the learner computes under ``model.dtype`` = ``dtype`` (the engine runs ``dtype`` throughout)."""
    return "float32" if dtype == "float32" else "fp32 masters + bf16 autocast"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=16, help="GSM8K test prompts (x samples_per_prompt = 4)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--child", choices=DTYPES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure(args.model, args.child, args.prompts, args.max_new_tokens)))
        return
    sizes = ["--model", args.model, "--prompts", str(args.prompts), "--max-new-tokens", str(args.max_new_tokens)]
    results = {}
    for dtype in args.dtypes:
        out = subprocess.run([sys.executable, __file__, "--child", dtype, *sizes], capture_output=True, text=True,
                             cwd=REPO)
        if out.returncode != 0:
            sys.exit(f"mismatch.py: the {dtype} child failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
        results[dtype] = json.loads(out.stdout.strip().splitlines()[-1])
    big = f"frac_abs_diff_gt_{BIG_DIFF_NATS}"
    sci = ("k3_kl", "k3_kl_float32", "mean_abs_diff", "p99_abs_diff", "max_abs_diff")
    rows = [[r["dtype"], r["learner"], f"{r['sequences']} x <= {args.max_new_tokens}", r["tokens"],
             *(f"{r[k]:.2e}" for k in sci), fmt_percent(r[big], 2), fmt_percent(r["frac_truncated"], 2),
             "yes" if r["k3_kl"] < PRIME_RL_KL_BAR else "no"] for r in results.values()]
    print(f"{args.model}, vLLM engine vs rlray learner, {args.prompts} GSM8K test prompts, temperature 1.0; "
          f"d = learner - rollout logprob (nats)")
    print(markdown_table(["engine dtype", "learner", "sequences x tokens", "tokens", "k3 KL (nats/token)",
                          "k3 in float32 (as logged)",
                          "mean \\|d\\|", "p99 \\|d\\|", "max \\|d\\|", f"\\|d\\| > {BIG_DIFF_NATS}", "truncated (ratio > 2)",
                          f"k3 < {PRIME_RL_KL_BAR} (prime-rl)"], rows))
    print("seconds: " + "; ".join(f"{d}: " + ", ".join(f"{k} {fmt(v, 1)}" for k, v in r["seconds"].items())
                                  for d, r in results.items()))
    write_results("mismatch", {"sizes": vars(args), "prime_rl_kl_bar": PRIME_RL_KL_BAR, "results": results})


if __name__ == "__main__":
    main()
