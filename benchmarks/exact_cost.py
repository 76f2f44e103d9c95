"""The cost of exact on-policy sampling (``rollout.backend=exact``) against the hf and vLLM backends.

    .venv/bin/python benchmarks/exact_cost.py                                      # SmolLM2-135M-Instruct, float32
    .venv/bin/python benchmarks/exact_cost.py --model tiny-random --prompts 2 --max-new-tokens 16

For each backend, in a fresh child process, the demo config (configs/grpo_gsm8k_smollm2.yaml) with
``rollout.backend``, ``model.dtype``, ``rollout.temperature=1.0`` and ``rollout.max_new_tokens`` set becomes the
objects a run builds, through the run's own functions (as benchmarks/mismatch.py does): the first ``--prompts``
GSM8K test prompts, chat-templated; the engine a rollout actor starts (``rollout_engine_kwargs``: exact gets the
learner's torch threads), which samples ``samples_per_prompt`` (4) completions per prompt with step 0's seed; then
the run's learner, whose ``logprobs`` (stage 4's old logprobs, the run's micro-batching: the exact layout for the
exact backend, padded rows with shared prompts otherwise) scores the same tokens.

Per backend: engine start (s), generation (s) and generated tokens/s, the learner's logprob pass (s), and the
rollout/learner gap over the sampled tokens (``mismatch.mismatch_stats``: k3 KL, max |d|), which is exactly 0 for
exact. The generation rate is what the backend costs a step; the learner's pass shows the exact layout's own cost
(each row alone, prompt + max_new_tokens positions, the full vocabulary distribution of each response position).
Prints a markdown table (with the CPU's model name and its AMX / AVX-512 BF16 flags) and writes
bench_results/exact_cost.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchlib import REPO, fmt, markdown_table, write_results
from mismatch import mismatch_stats, sample_and_score

CONFIG = REPO / "configs" / "grpo_gsm8k_smollm2.yaml"
BACKENDS = ("exact", "hf", "vllm")


def cpu_name() -> str:
    """Returns the CPU's model name and whether it has AMX (amx_bf16) and AVX-512 BF16, from /proc/cpuinfo."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return f"{name} (amx_bf16: {'amx_bf16' in flags}, avx512_bf16: {'avx512_bf16' in flags})"


def _measure(model: str, backend: str, dtype: str, prompts: int, max_new_tokens: int) -> dict[str, Any]:
    """Runs in the child: samples with the backend's engine, scores with the run's learner; returns the figures."""
    import torch

    got = sample_and_score(model, dtype, prompts, max_new_tokens, (f"rollout.backend={backend}",), learner_threads=True)
    rollout, old, mask, completions = got["rollout"], got["learner"], got["mask"], got["completions"]
    stats = mismatch_stats(rollout, old.double(), mask)
    tokens = sum(len(c.response_token_ids) for c in completions)
    prompt_tokens = [len(p) for p in got["prompt_ids"]]
    return {"backend": backend, "dtype": dtype, "sequences": len(completions), "tokens": tokens,
            "prompt_tokens": [min(prompt_tokens), max(prompt_tokens)],
            "seconds": got["seconds"], "tokens_per_s": tokens / got["seconds"]["generate"],
            "bitwise": bool(torch.equal(rollout.float()[mask], old[mask])), **stats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=2, help="GSM8K test prompts (x samples_per_prompt = 4)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--child", choices=BACKENDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure(args.model, args.child, args.dtype, args.prompts, args.max_new_tokens)))
        return
    sizes = ["--model", args.model, "--prompts", str(args.prompts), "--max-new-tokens", str(args.max_new_tokens),
             "--dtype", args.dtype]
    results = {}
    for backend in args.backends:
        out = subprocess.run([sys.executable, __file__, "--child", backend, *sizes], capture_output=True, text=True,
                             cwd=REPO)
        if out.returncode != 0:
            sys.exit(f"exact_cost.py: the {backend} child failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
        results[backend] = json.loads(out.stdout.strip().splitlines()[-1])
    base = results.get("vllm") or results.get("hf")
    rows = [[r["backend"], f"{r['sequences']} x <= {args.max_new_tokens}", r["tokens"], fmt(r["seconds"]["engine_start"], 1),
             fmt(r["seconds"]["generate"], 1), fmt(r["tokens_per_s"], 1),
             fmt(base["tokens_per_s"] / r["tokens_per_s"], 1) if base else "n/a",
             fmt(r["seconds"]["learner_logprobs"], 2), f"{r['k3_kl']:.1e}", f"{r['max_abs_diff']:.1e}",
             "yes" if r["bitwise"] else "no"] for r in results.values()]
    first = next(iter(results.values()))
    print(f"{args.model}, {args.dtype}, {args.prompts} GSM8K test prompts x 4 samples (prompts of "
          f"{first['prompt_tokens'][0]}-{first['prompt_tokens'][1]} tokens), temperature 1.0; {cpu_name()}")
    print(markdown_table(["backend", "sequences x tokens", "tokens", "engine start (s)", "generate (s)", "tokens/s",
                          f"slower than {base['backend'] if base else '-'}", "learner logprobs (s)", "k3 KL",
                          "max \\|d\\|", "rollout == learner bitwise"], rows))
    write_results("exact_cost", {"sizes": vars(args), "cpu": cpu_name(), "results": results})


if __name__ == "__main__":
    main()
