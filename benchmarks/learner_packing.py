"""The learner's stages 4 and 6 (reference/old logprobs, the update) padded against packed, with and without shared
prefixes and a token budget, on the step shapes of three runs, in one invocation.

    .venv/bin/python benchmarks/learner_packing.py                       # SmolLM2-135M-Instruct, every workload, auto dtype
    .venv/bin/python benchmarks/learner_packing.py --workloads grpo --dtypes float32 bfloat16 --repeats 2
    .venv/bin/python benchmarks/learner_packing.py --quick               # tiny-random, seconds (a smoke test)

Workloads, each one step of its run's rows (prompts rendered from its data with its chat template; responses of
seeded random tokens, lengths drawn as its runs produce them, so no two samples share a token after the prompt: the
sharing measured is the prompt's alone):
- ``demo``: ``configs/envs/retry_arith_smollm2.yaml`` (``make demo``): 16 prompts x 4 episodes, a system turn and the
  question (~40 tokens), 1-3 turns of at most 16 sampled tokens, 16 observation tokens between turns; one mini-batch,
  micro-batches of 32 sequences, KL in the loss (reference logprobs in stage 4).
- ``env``: ``benchmarks/env_vs_trl.py``: 4 x 4, the ``smollm2-tools`` opening with the tool schema (~330 tokens),
  1-3 turns of at most 64 tokens with ~20-token tool results; micro-batches of 8.
- ``grpo``: ``benchmarks/grpo_vs_trl.py --models smollm2-135m-instruct``: 4 x 4 GSM8K prompts with the instruction
  (~150 tokens), 64 new tokens (85% hit the cap, as measured there); micro-batches of 8.

Variants (``learner.*``): ``today`` is the learner before packing (padded rows, a group's prompt through the KV cache
when neighbours share it); ``padded`` the reference layout (no sharing); ``packed``; ``packed+shared``;
``packed+shared+budget`` (``tokens_per_microbatch``, ``--budget``). Each variant runs in a fresh child process; for
each: seconds of stage 4 and stage 6 (median of ``--repeats``), the tokens the forwards computed (real, padding,
shared: ``perf/learner_tokens_*``), so a gain is explained, not only timed, and the child's peak RSS. Timing needs
a quiet machine; run it under the heavy lock where others work.
Prints one table per workload and dtype; writes bench_results/learner_packing.json (``--quick``:
learner_packing_quick.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

from benchlib import GIB, REPO, fmt, markdown_table, ratio, write_results

VARIANTS = {
    "today": dict(sequence_packing="off", share_prefixes=True),
    "padded": dict(sequence_packing="off", share_prefixes=False),
    "packed": dict(sequence_packing="on", share_prefixes=False),
    "packed+shared": dict(sequence_packing="on", share_prefixes=True),
    "packed+shared+budget": dict(sequence_packing="on", share_prefixes=True, budget=True),
}
WORKLOADS = ("demo", "env", "grpo")


@dataclasses.dataclass(frozen=True)
class Workload:
    """One step's shape: the config overrides of its run and how its rows' responses are drawn."""

    overrides: tuple[str, ...]
    prompts: int
    samples: int
    turns: tuple[int, int]  # fewest and most assistant turns per episode (1, 1: single-turn)
    turn_tokens: tuple[int, int]  # sampled tokens per turn, drawn uniformly in this range
    observation_tokens: int  # tokens between two turns
    capped: float = 0.0  # share of single-turn responses at the cap (turn_tokens[1])


SHAPES = {
    "demo": Workload((), 16, 4, (1, 3), (4, 16), 16),
    "env": Workload(("learner.prompts_per_step=4", "rollout.samples_per_prompt=4", "learner.sequences_per_minibatch=16",
                     "learner.sequences_per_microbatch=8", "algo.kl_coef=0.01", "rollout.max_new_tokens=64",
                     "data.max_prompt_tokens=512"), 4, 4, (1, 3), (20, 64), 20),
    "grpo": Workload(("learner.prompts_per_step=4", "rollout.samples_per_prompt=4", "learner.sequences_per_minibatch=16",
                      "learner.sequences_per_microbatch=8", "algo.kl_coef=0.01", "rollout.max_new_tokens=64"),
                     4, 4, (1, 1), (20, 64), 0, capped=0.85),
}


def prompts_of(name: str, tokenizer: Any, n: int) -> list[list[int]]:
    """Returns ``n`` rendered prompts (token ids) of workload ``name`` from its run's data and chat template."""
    import sys

    from rlray.data import load_prompt_rows, render_prompt

    sys.path.insert(0, str(REPO / "benchmarks"))
    if name == "demo":
        rows = [json.loads(line) for line in (REPO / "data/retry-arith/train.jsonl").read_text().splitlines()[:n]]
        system = "You are a calculator. Reply with the number only, no words."
        return [render_prompt(tokenizer, r["prompt"], instruction="", system_prompt=system) for r in rows]
    if name == "env":
        import multiply_env

        from rlray.envs.tools import tool_schemas
        from rlray.models import load_tokenizer

        tools_tok = load_tokenizer(tokenizer.name_or_path, chat_template="smollm2-tools")
        env = multiply_env.MultiplyEnv()
        tools = tool_schemas([env.multiply])
        text = [tools_tok.apply_chat_template([{"role": "user", "content": r["prompt"] + env.reset(**r)}], tools=tools,
                                              tokenize=False, add_generation_prompt=True) for r in multiply_env.rows(n, seed=0)]
        return [tools_tok(t, add_special_tokens=False)["input_ids"] for t in text]
    import benchlib

    rows = load_prompt_rows([str(benchlib.gsm8k_train_file())], prompt_column="question")[:n]
    return [render_prompt(tokenizer, r.prompt, instruction=benchlib.gsm8k_instruction(), system_prompt=None) for r in rows]


def step_table(name: str, tokenizer: Any, seed: int = 0):
    """Returns (StepBatch, prompt lengths) of one step of workload ``name``: every prompt's samples in a group."""
    import torch

    from rlray.schema import StepBatch, pack_sequences

    shape, gen = SHAPES[name], torch.Generator().manual_seed(seed)
    prompts = prompts_of(name, tokenizer, shape.prompts)

    def draw(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    rows, responses, masks = [], [], []
    for prompt in prompts:
        for _ in range(shape.samples):
            ids, mask = [], []
            for turn in range(draw(*shape.turns)):
                if turn:
                    ids += [7] * shape.observation_tokens
                    mask += [False] * shape.observation_tokens
                capped = float(torch.rand(1, generator=gen)) < shape.capped
                n = shape.turn_tokens[1] if capped else draw(*shape.turn_tokens)
                ids += torch.randint(100, 40000, (n,), generator=gen).tolist()
                mask += [True] * n
            rows.append(prompt)
            responses.append(ids)
            masks.append(mask)
    inputs = pack_sequences(rows, responses, pad_token_id=tokenizer.pad_token_id)
    b, t = inputs.response_ids.shape
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i, m in enumerate(masks):
        mask[i, : len(m)] = torch.tensor(m)
    group = torch.arange(b) // shape.samples
    batch = StepBatch(inputs=inputs, response_mask=mask, reward=torch.rand(b, generator=gen), group_id=group,
                      policy_version=torch.zeros(b, dtype=torch.long),
                      rollout_logprobs=torch.where(mask, -1.5, 0.0))
    return batch, [len(p) for p in prompts]


def run_variant(name: str, variant: str, model: str, dtype: str, budget: int, repeats: int,
                warmup: int) -> dict[str, Any]:
    """Returns stage seconds (median of ``repeats``, after ``warmup`` passes not counted, at least one: a learner's
    first step makes no reference pass, ``PolicyLearner.at_reference``) and the tokens computed of ``variant`` on one
    step of workload ``name`` after the first."""
    import torch

    from rlray.config import load_config
    from rlray.learner import PolicyLearner
    from rlray.learner import online as learner_online
    from rlray.learner.packing import TokenCounts
    from rlray.models import load_tokenizer, resolve_model_path
    from rlray.run import build

    settings = dict(VARIANTS[variant])
    use_budget = settings.pop("budget", False)
    overrides = [f"model.path={model}", f"model.dtype={dtype}", *SHAPES[name].overrides,
                 *(f"learner.{k}={str(v).lower()}" for k, v in settings.items()),
                 f"learner.tokens_per_microbatch={budget if use_budget else 'null'}"]
    cfg = load_config(REPO / "configs/envs/retry_arith_smollm2.yaml", overrides)
    model_dir = resolve_model_path(model)
    tokenizer = load_tokenizer(model_dir)
    batch, _ = step_table(name, tokenizer)
    spec = build.update_spec(cfg, 1)
    torch.manual_seed(0)
    learner = PolicyLearner(model_dir, **build.learner_kwargs(cfg, 1))
    norms = _norms(batch, cfg)
    stage4, stage6, tokens = [], [], {}
    warmup = max(warmup, 1)
    for i in range(warmup + repeats):  # the warm-up passes build the kernels' shapes once; they are not counted
        fresh = dataclasses.replace(batch)
        start = time.perf_counter()
        fresh = learner_online.reference_and_old(learner, fresh, spec)
        stage4.append(time.perf_counter() - start)
        counted = learner.take_tokens()
        fresh = learner_online.advantages(fresh, spec, lambda d: d)
        start = time.perf_counter()
        metrics = learner_online.update(learner, fresh, norms, spec, lambda d: d)
        stage6.append(time.perf_counter() - start)
        counted.add(TokenCounts(*(int(metrics[f"perf/learner_tokens_{k}"]) for k in ("real", "padding", "shared"))))
        tokens = dataclasses.asdict(counted)
        if i < warmup:
            stage4.pop()
            stage6.pop()
    return {"logprobs_s": statistics.median(stage4), "update_s": statistics.median(stage6), "tokens": tokens,
            "rows": batch.num_rows, "row_tokens": int(batch.inputs.attention_mask.sum()),
            "microbatch_sequences": cfg.learner.sequences_per_microbatch, "budget": budget if use_budget else None}


def _norms(batch, cfg):
    """Returns each mini-batch's global counts (what ``rlray.run.experience.minibatch_normalisers`` gives one rank)."""
    from rlray.learner import Normaliser

    k = cfg.learner.sequences_per_minibatch
    mask = batch.response_mask
    return [Normaliser(float(max(mask[m : m + k].sum(), 1)), float(k), 1) for m in range(0, batch.num_rows, k)]


def table(result: dict[str, Any]) -> str:
    """Returns the markdown table of one workload and dtype."""
    runs = result["runs"]
    base = runs.get("today", {})
    base_s = (base.get("logprobs_s") or 0) + (base.get("update_s") or 0)
    rows = []
    for variant, r in runs.items():
        total = r["logprobs_s"] + r["update_s"]
        t = r["tokens"]
        rows.append([variant, fmt(r["logprobs_s"], 1), fmt(r["update_s"], 1), fmt(total, 1),
                     fmt(ratio(total, base_s)), f"{t['real']:,}", f"{t['padding']:,}", f"{t['shared']:,}",
                     fmt(r["peak_rss_gib"], 2)])
    head = (f"**{result['workload']}** ({result['dtype']}): {result['rows']} sequences, {result['row_tokens']:,} tokens "
            f"in their rows; stage 4 + stage 6 of one step, median of {result['repeats']} after a warm-up pass")
    return "\n".join([head, "", markdown_table(
        ["variant", "logprobs (s)", "update (s)", "both (s)", "both / today", "tokens real", "padding", "shared",
         "peak RSS (GiB)"], rows)])


def run_child(job: dict[str, Any]) -> dict[str, Any]:
    """Returns ``run_variant``'s figures of ``job`` measured in a fresh child process (so one variant's memory and
    allocator state do not weigh on the next), with the child's peak resident memory (GiB)."""
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(job)], check=True, capture_output=True,
                         text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def child_main(job: dict[str, Any]) -> None:
    """Runs one variant (``run_child``'s child) and prints its figures as the last line of JSON."""
    import torch

    if job["threads"]:
        torch.set_num_threads(job["threads"])
    got = run_variant(job["name"], job["variant"], job["model"], job["dtype"], job["budget"], job["repeats"],
                      job["warmup"])
    got["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
    print(json.dumps(got))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs every workload x dtype x variant; prints the tables and writes bench_results/learner_packing.json."""
    import torch

    from rlray.models import resolve_dtype

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--dtypes", nargs="+", default=["auto"], choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--budget", type=int, default=4096, help="tokens_per_microbatch of the +budget variant")
    parser.add_argument("--repeats", type=int, default=1, help="timed passes per variant (the median is reported)")
    parser.add_argument("--warmup", type=int, default=1, help="passes per variant before the timed ones")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: every core)")
    parser.add_argument("--quick", action="store_true", help="tiny-random, for a smoke test")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = "tiny-random" if args.quick else args.model
    results = []
    for dtype in [resolve_dtype(d, gpu=False) for d in args.dtypes]:
        for name in args.workloads:
            result = {"workload": name, "dtype": dtype, "repeats": args.repeats, "runs": {}}
            for variant in args.variants:
                job = dict(name=name, variant=variant, model=model, dtype=dtype, budget=args.budget,
                           repeats=args.repeats, warmup=args.warmup, threads=args.threads)
                got = run_child(job)
                result.update(rows=got["rows"], row_tokens=got["row_tokens"])
                result["runs"][variant] = got
                print(f"{name} {dtype} {variant}: logprobs {got['logprobs_s']:.1f} s, update {got['update_s']:.1f} s, "
                      f"tokens {got['tokens']}", flush=True)
            print("\n" + table(result) + "\n", flush=True)
            results.append(result)
    name = "learner_packing_quick" if args.quick else "learner_packing"  # a smoke test keeps the real figures
    path = write_results(name, {"model": model, "threads": torch.get_num_threads(), "results": results})
    print(f"wrote {path}")
    return {"results": results}


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child_main(json.loads(sys.argv[2]))
    else:
        main()
