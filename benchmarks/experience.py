"""Moving a step's experience to every learner rank (Arrow through Ray's object store), beside the step time.

    python benchmarks/experience.py                  # SmolLM2-135M-Instruct at grpo_vs_trl's default sizes
    python benchmarks/experience.py --quick          # tiny-random at grpo_vs_trl's --quick sizes
    python benchmarks/experience.py --step-s 12.5    # compare with a step time you measured

The step's experience table is built exactly as stage 3 of the online step builds it (``rlray.run.experience.build_experience``)
from the first GSM8K train prompts of the model, rendered as rlray renders them, and completions of
max_new_tokens tokens each (random token ids and logprobs: what moves is the same number of bytes).
Then, for a world of W learner ranks (W = 1, 2; each rank a Ray actor, as Ray Train workers are),
what ``rlray.run.online.distribute`` and the collation do every step, timed from rank 0's side:

- ``put``: rank 0 puts one Arrow shard per rank into the object store (``ray.put`` of
  ``table.slice``);
- ``get``: every rank fetches its own shard (``ray.get``), all ranks at once;
- ``collate``: every rank turns its shard into padded tensors (``schema.collate``).

``move``: rank 0's wall time from the first put until every rank holds its collated tensors (the call
to each rank stands in for the step's broadcast of the references), the median over ``--repeats``
after one warm-up; get and collate are the slowest rank's.
The step time is rlray sync's median step time on the same model and sizes, from
bench_results/grpo_vs_trl.json when that run exists (``make bench`` runs it first); otherwise this
script runs rlray sync itself (``grpo_vs_trl.py``'s child), or takes ``--step-s``. The ratio
move / step time is the share of the step spent moving experience (target <= 2%). A larger step
(``--scale-prompts`` x samples x tokens) shows how the movement grows; it has no step time.
Prints a markdown table and writes bench_results/experience.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import benchlib
import grpo_vs_trl

SIZES = {"quick": dict(model="tiny-random", repeats=3, scale_prompts=8),
         "default": dict(model="smollm2-135m-instruct", repeats=5, scale_prompts=64)}
WORLDS = (1, 2)


class Rank:
    """A learner rank's side of the hand-over: fetch its shard, collate it; returns its timings."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def take(self, refs: list[Any]) -> dict[str, float]:
        """Fetches the shard behind ``refs[0]`` and collates it; returns get_s, collate_s, rows and tensor bytes."""
        import ray
        import torch

        from rlray import schema

        start = time.perf_counter()
        shard = ray.get(refs[0])
        mid = time.perf_counter()
        data = schema.collate(shard, self.pad_token_id)
        end = time.perf_counter()
        tensors = [*vars(data.inputs).values(), *(v for v in vars(data).values() if isinstance(v, torch.Tensor))]
        return {"get_s": mid - start, "collate_s": end - mid, "rows": shard.num_rows,
                "tensor_bytes": sum(t.numel() * t.element_size() for t in tensors)}


def experience_table(model: str, prompts: int, samples: int, tokens: int) -> tuple[Any, int]:
    """Returns (the step's experience table, the tokenizer's pad id) for ``prompts`` x ``samples`` completions of ``tokens`` tokens."""
    from rlray.models import load_tokenizer, resolve_model_path
    from rlray.rollout import Completion
    from rlray.run.experience import build_experience

    rows, prompt_ids = benchlib.gsm8k_prompts(model, prompts, grpo_vs_trl.MAX_PROMPT_TOKENS)
    tokenizer = load_tokenizer(resolve_model_path(model))
    rng = random.Random(0)
    vocab = min(len(tokenizer), 32000)
    completions = [Completion(p, s, [rng.randrange(vocab) for _ in range(tokens)],
                              [-rng.random() * 5 for _ in range(tokens)], "length", 0)
                   for p in range(prompts) for s in range(samples)]
    rewards = {"reward": [rng.random() for _ in completions], "correct": [0.0] * len(completions),
               "format": [0.0] * len(completions)}
    return build_experience(rows, prompt_ids, completions, rewards), tokenizer.pad_token_id or 0


def time_world(table: Any, pad_token_id: int, world: int, repeats: int) -> dict[str, Any]:
    """Returns the medians of put, slowest get, slowest collate and move for ``world`` ranks (warm-up dropped)."""
    import ray

    from rlray import schema

    ranks = [ray.remote(num_cpus=0)(Rank).remote(pad_token_id) for _ in range(world)]
    ray.get([r.take.remote([ray.put(table.slice(0, 1))]) for r in ranks])  # actors up, imports done
    put, get, coll, move = [], [], [], []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        refs = [ray.put(table.slice(s.start, s.stop - s.start)) for s in
                (schema.shard_rows(table.num_rows, r, world) for r in range(world))]
        put_s = time.perf_counter() - start
        got = ray.get([rank.take.remote([ref]) for rank, ref in zip(ranks, refs, strict=True)])
        move.append(time.perf_counter() - start)
        put.append(put_s)
        get.append(max(g["get_s"] for g in got))
        coll.append(max(g["collate_s"] for g in got))
        del refs
    for r in ranks:
        ray.kill(r)
    med = lambda xs: statistics.median(xs[1:])  # noqa: E731
    return {"world": world, "put_s": med(put), "get_s": med(get), "collate_s": med(coll), "move_s": med(move),
            "tensor_bytes": sum(g["tensor_bytes"] for g in got)}


def step_time(model: str, spec: grpo_vs_trl.RunSpec, given: float | None, timeout_s: float) -> tuple[float | None, str]:
    """Returns (rlray sync's median step time in seconds, where it comes from) for ``model`` at ``spec``'s sizes."""
    if given is not None:
        return given, "--step-s"
    saved = (benchlib.read_results("grpo_vs_trl") or {}).get("models", {}).get(model, {})
    same = all(saved.get("spec", {}).get(k) == getattr(spec, k)
               for k in ("prompts_per_step", "samples_per_prompt", "max_new_tokens"))
    seconds = saved.get("runs", {}).get("rlray-sync", {}).get("median_step_s")
    if same and seconds is not None:
        return seconds, "bench_results/grpo_vs_trl.json (rlray-sync)"
    print(f"  measuring rlray sync's step time on {model} (no matching bench_results/grpo_vs_trl.json)", flush=True)
    run = grpo_vs_trl.compare(model, spec, ["rlray-sync"], timeout_s, keep=False)["runs"]["rlray-sync"]
    return run.get("median_step_s"), "rlray-sync run by this script"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the measurement; prints the table and writes bench_results/experience.json; returns the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny-random at grpo_vs_trl's --quick sizes")
    parser.add_argument("--model", help="model alias (its sizes come from grpo_vs_trl.py)")
    parser.add_argument("--repeats", type=int, help="timed hand-overs after one warm-up")
    parser.add_argument("--scale-prompts", type=int, help="prompts of the larger step (0: none)")
    parser.add_argument("--step-s", type=float, help="the step time to compare with (skips looking it up)")
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="limit of an rlray sync run")
    args = parser.parse_args(argv)
    size = dict(SIZES["quick" if args.quick else "default"])
    size.update({k: v for k, v in vars(args).items() if k in size and v is not None})
    model = size["model"]
    sizes = grpo_vs_trl.SIZES["quick" if args.quick else "default"]
    spec = grpo_vs_trl.RunSpec(model=model, **sizes.get(model, grpo_vs_trl.SIZES["default"]["tiny-random"]))
    step_s, source = step_time(model, spec, args.step_s, args.timeout_s)
    cases = [("step", spec.prompts_per_step)] + ([("scaled", size["scale_prompts"])] if size["scale_prompts"] else [])
    benchlib.init_local_ray()
    rows_out: list[dict[str, Any]] = []
    try:
        for case, prompts in cases:
            table, pad = experience_table(model, prompts, spec.samples_per_prompt, spec.max_new_tokens)
            for world in WORLDS:
                r = time_world(table, pad, world, size["repeats"])
                r.update(case=case, rows=table.num_rows, arrow_bytes=table.nbytes, tokens=spec.max_new_tokens,
                         step_s=step_s if case == "step" else None)
                r["move_vs_step"] = benchlib.ratio(r["move_s"], r["step_s"])
                rows_out.append(r)
    finally:
        import ray

        ray.shutdown()
    headers = ["step", "rows", "Arrow KiB", "ranks", "put (ms)", "get (ms)", "collate (ms)", "move (ms)",
               "step time (s)", "move / step"]
    cells = [[r["case"], str(r["rows"]), benchlib.fmt(r["arrow_bytes"] / 1024, 0), str(r["world"]),
              benchlib.fmt(r["put_s"] * 1e3, 1), benchlib.fmt(r["get_s"] * 1e3, 1), benchlib.fmt(r["collate_s"] * 1e3, 1),
              benchlib.fmt(r["move_s"] * 1e3, 1), r["step_s"], benchlib.fmt_percent(r["move_vs_step"])] for r in rows_out]
    print(f"\n**experience** ({model}): {spec.prompts_per_step} prompts x {spec.samples_per_prompt} samples x "
          f"{spec.max_new_tokens} tokens per step ('scaled': {size['scale_prompts']} prompts); step time from "
          f"{source}; {size['repeats']} timed hand-overs after 1 warm-up\n")
    print(benchlib.markdown_table(headers, cells) + "\n")
    results = {"size": size, "spec": {"prompts_per_step": spec.prompts_per_step,
                                      "samples_per_prompt": spec.samples_per_prompt,
                                      "max_new_tokens": spec.max_new_tokens},
               "step_s": step_s, "step_s_source": source, "runs": rows_out}
    print(f"wrote {benchlib.write_results('experience', results)}")
    return results


if __name__ == "__main__":
    main()
