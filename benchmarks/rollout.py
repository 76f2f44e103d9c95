"""rlray's rollout path against bare ``vllm.LLM.generate`` on the same prompts and sampling: the framework's overhead.

    python benchmarks/rollout.py                     # SmolLM2-135M-Instruct, default sizes
    python benchmarks/rollout.py --quick             # tiny-random, seconds-scale sizes
    python benchmarks/rollout.py --model tiny-random --prompts 16 --samples 4 --max-new-tokens 128

Runs, one after another, each in a fresh process:

- ``vllm``: one ``vllm.LLM`` in this process, no Ray, no rlray: ``LLM.generate`` on the prompt token
  ids with ``SamplingParams`` identical to the ones rlray sends (n samples, max tokens, temperature,
  top-p, the sampled token's logprob, no detokenization) and the same engine settings (dtype, seed,
  context length, eager mode, KV-cache size, processed logprobs, in-process engine core), on every
  core (CPU) or GPU 0.
- ``rlray``: the same prompts through rlray's path: ``RolloutFleet.generate`` -> a ``RolloutActor``
  (Ray) -> ``RolloutEngine`` -> vLLM, results back as ``Completion`` records with per-token logprobs;
  one actor on every core (CPU, ``resources.rollout.cpu_threads`` = all cores) or GPU 0.
- ``rlray-2actors`` (CPU with 2+ cores, or 2+ GPUs): two actors, each on its own half of the cores
  (or its own GPU), the prompts split between them.

Each run does two warm-up calls, then ``--repeats`` timed calls (seeded the same way, so ``vllm`` and
``rlray`` sample the same tokens). tokens/s = the median over the timed calls of generated tokens /
seconds of the call; the ratio
is rlray / bare vLLM (1.0 = no overhead; the target is >= 0.9). Prints a markdown table and writes
bench_results/rollout.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchlib

SIZES = {
    "quick": dict(model="tiny-random", prompts=4, samples=2, max_new_tokens=16, repeats=3),
    "default": dict(model="smollm2-135m-instruct", prompts=8, samples=4, max_new_tokens=64, repeats=3),
}
MAX_PROMPT_TOKENS = 256
KV_CACHE_GIB = 1.0
SEED = 0
WARMUP_CALLS = 2


def prompt_token_ids(model: str, count: int) -> list[list[int]]:
    """Returns the token ids of the first ``count`` GSM8K train questions that fit MAX_PROMPT_TOKENS, rendered as rlray renders them."""
    return benchlib.gsm8k_prompts(model, count, MAX_PROMPT_TOKENS)[1]


def timed_calls(generate, prompts: list[list[int]], repeats: int) -> dict[str, Any]:
    """Runs ``generate(prompts, seed)`` WARMUP_CALLS times to warm up, then ``repeats`` times; returns tokens, seconds, token ids.

    ``generate`` returns the generated token ids of every sample, prompt-major.
    """
    for w in range(WARMUP_CALLS):  # vLLM's first calls on CPU are slow (kernels picked per shape)
        generate(prompts, SEED + 999 + w)
    seconds, tokens, samples = [], [], []
    for r in range(repeats):
        start = time.perf_counter()
        out = generate(prompts, SEED + r)
        seconds.append(time.perf_counter() - start)
        tokens.append(sum(len(t) for t in out))
        samples.append(out)
    return {"seconds": seconds, "tokens": tokens, "first_sample": samples[0][0][:16],
            "fingerprint": [hash(tuple(t)) for t in samples[0]]}


def child_vllm(args: dict, prompts: list[list[int]]) -> dict[str, Any]:
    """Bare vLLM in this process: the engine settings and SamplingParams rlray's backend uses, nothing else."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # rlray's process model (rlray/rollout/vllm_backend.py)
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    import torch
    import vllm
    from vllm import SamplingParams

    from rlray.models import resolve_model_path

    on_cpu = not torch.cuda.is_available()
    set_num_threads = torch.set_num_threads  # vLLM's CPU worker turns it into a no-op; keep the real one
    start = time.perf_counter()
    llm = vllm.LLM(model=resolve_model_path(args["model"]), dtype=args["dtype"], seed=SEED,
                   max_model_len=MAX_PROMPT_TOKENS + args["max_new_tokens"], enforce_eager=True,
                   gpu_memory_utilization=0.3, kv_cache_memory_bytes=round(KV_CACHE_GIB * 2**30) if on_cpu else None,
                   logprobs_mode="processed_logprobs", disable_log_stats=True)
    start_s = time.perf_counter() - start
    if on_cpu:
        set_num_threads(len(os.sched_getaffinity(0)))  # every core, as rlray's one actor on cpu_threads "0-<last>"
    params = SamplingParams(n=args["samples"], max_tokens=args["max_new_tokens"], temperature=1.0, top_p=1.0,
                            top_k=0, logprobs=0, detokenize=False)

    def generate(batch: list[list[int]], seed: int) -> list[list[int]]:
        torch.manual_seed(seed)  # the same call-level seeding as rlray's backend
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
        return [list(o.token_ids) for req in outputs for o in sorted(req.outputs, key=lambda o: o.index)]

    return {"start_s": start_s, "threads": torch.get_num_threads(), **timed_calls(generate, prompts, args["repeats"])}


def child_rlray(args: dict, prompts: list[list[int]], actors: int) -> dict[str, Any]:
    """rlray's rollout path: RolloutFleet -> RolloutActor(s) on Ray -> RolloutEngine -> vLLM."""
    import ray
    import torch

    from rlray.config import config_from_dict
    from rlray.cores import split_cores
    from rlray.launch.actors import kill_actors, start_rollout_actors
    from rlray.models import resolve_model_path
    from rlray.plan import resolve_plan
    from rlray.rollout import SamplingSpec
    from rlray.rollout.fleet import RolloutFleet

    on_cpu = not torch.cuda.is_available()
    tree: dict[str, Any] = {"resources": {"rollout": {"num_workers": actors}}}
    if on_cpu:
        tree["resources"]["rollout"]["cpu_threads"] = split_cores(actors, sorted(os.sched_getaffinity(0)))
    else:
        tree["resources"]["rollout"]["gpus"] = 1 if actors > 1 else 0.5
        tree["rollout"] = {"gpu_memory_utilization": 0.3}
    tree.setdefault("rollout", {})["kv_cache_gib"] = KV_CACHE_GIB
    cfg = config_from_dict(tree, [f"model.dtype={args['dtype']}", f"run.seed={SEED}"])
    benchlib.init_local_ray()
    start = time.perf_counter()
    handles = start_rollout_actors(resolve_plan(cfg), resolve_model_path(args["model"]), MAX_PROMPT_TOKENS + args["max_new_tokens"])
    start_s = time.perf_counter() - start
    fleet = RolloutFleet(handles)

    def generate(batch: list[list[int]], seed: int) -> list[list[int]]:
        spec = SamplingSpec(n=args["samples"], max_new_tokens=args["max_new_tokens"], temperature=1.0, top_p=1.0, seed=seed)
        return [c.response_token_ids for c in fleet.generate(batch, spec)]

    try:
        out = timed_calls(generate, prompts, args["repeats"])
    finally:
        kill_actors(handles)
        ray.shutdown()
    return {"start_s": start_s, "actors": actors, "cpu_threads": cfg.resources.rollout.cpu_threads, **out}


def run_child_main(argv: list[str]) -> None:
    """Entry point of a child: ``--child VARIANT ARGS_JSON RESULT_JSON``."""
    variant, args_json, result_json = argv
    args = json.loads(Path(args_json).read_text())
    prompts = prompt_token_ids(args["model"], args["prompts"])
    if variant == "vllm":
        out = child_vllm(args, prompts)
    else:
        out = child_rlray(args, prompts, 2 if variant == "rlray-2actors" else 1)
    Path(result_json).write_text(json.dumps(out))


def variants_here() -> list[str]:
    """Returns the runs this machine can do: vllm, rlray, and rlray-2actors with 2+ cores (CPU) or 2+ GPUs."""
    import torch

    units = torch.cuda.device_count() if torch.cuda.is_available() else len(os.sched_getaffinity(0))
    return ["vllm", "rlray", *(["rlray-2actors"] if units >= 2 else [])]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the comparison; prints the table and writes bench_results/rollout.json; returns the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny-random, seconds-scale sizes")
    parser.add_argument("--model", help="model alias or folder")
    parser.add_argument("--prompts", type=int, help="prompts per call")
    parser.add_argument("--samples", type=int, help="samples per prompt (n)")
    parser.add_argument("--max-new-tokens", type=int, help="tokens per sample (cap)")
    parser.add_argument("--repeats", type=int, help="timed calls after the warm-up")
    parser.add_argument("--variants", nargs="+", help="runs (default: vllm rlray [rlray-2actors])")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="limit per run")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                        help="engine precision of both (auto: what rlray's model.dtype=auto picks on this machine)")
    args = parser.parse_args(argv)
    size = dict(SIZES["quick" if args.quick else "default"])
    size.update({k: v for k, v in vars(args).items() if k in size and v is not None})
    from rlray.models.loading import resolve_dtype

    size["dtype"] = resolve_dtype(args.dtype, gpu=benchlib.device() == "cuda")  # as model.dtype=auto resolves
    work = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    (work / "args.json").write_text(json.dumps(size))
    runs: dict[str, Any] = {}
    for variant in args.variants or variants_here():
        result = work / f"{variant}.json"
        raw = benchlib.run_script_child(__file__, [variant, work / "args.json", result], result_path=result,
                                        log_path=work / f"{variant}.log", timeout_s=args.timeout_s, label=variant)
        if "error" in raw:
            runs[variant] = {"error": raw["error"], "log_tail": raw["log_tail"]}
            continue
        rates = [t / s for t, s in zip(raw["tokens"], raw["seconds"], strict=True) if s > 0]
        runs[variant] = {**raw, "tokens_per_s": statistics.median(rates) if rates else None}
    base = runs.get("vllm", {}).get("tokens_per_s")
    for r in runs.values():
        r["vs_vllm"] = benchlib.ratio(r.get("tokens_per_s"), base)
        r["same_tokens_as_vllm"] = ("fingerprint" in r and r.get("fingerprint") == runs.get("vllm", {}).get("fingerprint"))
    rows = [[name, r.get("actors", 1), benchlib.fmt(r.get("start_s"), 1), sum(r.get("tokens", [])) or "n/a",
             benchlib.fmt(sum(r["seconds"]) if "seconds" in r else None, 2), benchlib.fmt(r.get("tokens_per_s"), 1),
             r["vs_vllm"], "yes" if r["same_tokens_as_vllm"] else "no"] if "error" not in r else
            [name, "n/a", f"FAILED: {r['error']}", "n/a", "n/a", "n/a", "n/a", "n/a"] for name, r in runs.items()]
    headers = ["run", "engines", "start (s)", "tokens", "seconds", "tokens/s", "tokens/s / vLLM", "same tokens as vLLM"]
    print(f"\n**rollout** ({size['model']}): {size['prompts']} prompts x {size['samples']} samples x up to "
          f"{size['max_new_tokens']} tokens, {size['repeats']} timed calls after {WARMUP_CALLS} warm-ups, "
          f"{size['dtype']}\n")
    print(benchlib.markdown_table(headers, rows) + "\n")
    results = {"size": size, "runs": runs}
    print(f"wrote {benchlib.write_results('rollout', results)}")
    return results


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        run_child_main(sys.argv[2:])
    else:
        main()
