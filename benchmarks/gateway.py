"""The agent gateway's cost: one task trained as a native environment and as a gateway agent, and what one gateway
serves.

    python benchmarks/gateway.py              # SmolLM2-135M-Instruct, each variant twice (~25 min on 2 cores), then capacity
    python benchmarks/gateway.py --quick      # tiny-random, seconds-scale sizes (smoke test)
    python benchmarks/gateway.py --capacity   # the capacity table alone (seconds)

1. Overhead. ``configs/envs/retry_arith_smollm2.yaml`` trained as each variant ``--repeats`` times (ABBA order), each
   run in a fresh child process, with the same sizes, seed and rows: ``native`` runs ``RetryArithmeticEnv`` in
   rlray's episode loop (``env.environments``); ``agent`` runs the same class driven by an ``openai`` client loop
   through the gateway (``benchmarks/env_agent.py:retry_arith_agent`` in ``env.agents``): every turn is an HTTP chat call, its messages
   matched against the recorded conversation and extended token-exactly. Both sample with the same engine settings,
   so a step's cost differs by the gateway's work and by what was sampled (the agent's calls carry no per-turn seed:
   their tokens differ). The table gives the median step and rollout time after warm-up (the runs of a variant
   pooled; one run's median step moves by up to a fifth between identical runs here), the generated tokens and
   the rollout time per generated token; overhead = agent / native - 1, of the step time and of the rollout time per
   generated token (the second takes out how much each run happened to sample).
   Then the same two rollouts interleaved on one engine (``--rounds``, in one child process: one rollout actor, one
   host running both the environment and the agent, the same rows and sampling for both in each round, the order
   alternating): on a machine that other jobs load, this is the steadier measure of the gateway's cost, since the
   learner's work is the same in both runs.
2. Capacity. One ``AgentHost`` in this process with an instant scripted engine (every call answered at once with a
   short reply): N concurrent agents, each making ``--calls`` chat calls that extend its conversation. Calls answered
   per second is the gateway's own ceiling on this machine (HTTP, the ``openai`` client, message matching, token
   bookkeeping, batching); prompts per engine call is how far the tick batcher gathers concurrent calls.

Prints the tables (with the CPU's model name) and writes bench_results/gateway.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchlib
import grpo_vs_trl as grpo

CONFIG = benchlib.REPO / "configs/envs/retry_arith_smollm2.yaml"
AGENT = f"{benchlib.BENCH_DIR / 'env_agent.py'}:retry_arith_agent"
CHAT_AGENT = f"{benchlib.BENCH_DIR / 'env_agent.py'}:chat_calls_agent"
VARIANTS = ("native", "agent")
SIZES = {
    "quick": dict(model="tiny-random", dtype="float32", prompts=2, samples=2, steps=3, warmup=1, backend="hf"),
    "default": dict(model="smollm2-135m-instruct", dtype="auto", prompts=8, samples=4, steps=6, warmup=2, backend="vllm"),
}
CONCURRENCY = (1, 16, 64, 256, 1024)


def overrides(variant: str, size: dict[str, Any], workdir: Path) -> list[str]:
    """Returns the dotted overrides of one overhead run (``variant`` "native" or "agent")."""
    out = [f"model.path={size['model']}", f"model.dtype={size['dtype']}", f"rollout.backend={size['backend']}",
           f"run.max_steps={size['steps']}", "run.max_wall_time_s=259200", f"learner.prompts_per_step={size['prompts']}",
           f"rollout.samples_per_prompt={size['samples']}",
           f"learner.sequences_per_minibatch={size['prompts'] * size['samples']}",
           f"learner.sequences_per_microbatch={size['prompts'] * size['samples']}", "guard.kl_threshold=null",
           f"run.output_dir={workdir}/out", f"tracking.mlflow_uri=sqlite:///{workdir}/mlflow.db", "monitor.port=0"]
    if variant == "agent":
        out += ["env.environments={}", "env.agents={retry_arith: " + AGENT + "}"]  # the rows name retry_arith
    return out


def child_run(variant: str, size: dict[str, Any], result_path: Path) -> None:
    """Trains one variant (in this child process) and writes its per-step figures to ``result_path``."""
    from rlray.config import load_config
    from rlray.launch.driver import run_training

    workdir = result_path.parent
    cfg = load_config(CONFIG, overrides(variant, size, workdir))
    steps_path = workdir / "steps.jsonl"
    started = benchlib.process_started()
    benchlib.init_local_ray()
    result = run_training(cfg, step_hooks=[benchlib.StepRecorder(str(steps_path))])
    extra = ("env/turns_mean", "env/gateway_calls_mean", "env/template_drift", "env/failed", "reward/env")
    result_path.write_text(json.dumps(grpo.rlray_result(result.status, started, steps_path, extra)))


def summarise(runs: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Returns the medians over the steps after ``warmup`` of every run in ``runs`` (one variant's repeats, pooled):
    step and rollout seconds, generated tokens, rollout seconds per 1,000 generated tokens, turns and gateway calls
    per episode, drift; and each run's own median step time."""
    failed = [r["error"] for r in runs if r.get("error")]
    if failed:
        return {"error": failed[0]}
    step_s, rollout_s, tokens, per_k, per_run = [], [], [], [], []
    series: dict[str, list[Any]] = {}
    for run in runs:
        t, n = run["timings"], len(run["generated_tokens"])
        kept = range(warmup, n)
        step_s += [t["timing/step_s"][i] for i in kept]
        rollout_s += [t["timing/rollout_s"][i] for i in kept]
        tokens += [run["generated_tokens"][i] for i in kept]
        per_k += [1000 * t["timing/rollout_s"][i] / max(run["generated_tokens"][i], 1.0) for i in kept]
        per_run.append(statistics.median(t["timing/step_s"][i] for i in kept))
        for key, values in run["series"].items():
            series.setdefault(key, []).extend(values)

    def median(values: list[Any]) -> float | None:
        got = [v for v in values if v is not None]
        return statistics.median(got) if got else None

    return {
        "steps": len(step_s), "runs": len(runs), "step_s": median(step_s), "step_s_per_run": per_run,
        "rollout_s": median(rollout_s), "generated_tokens": median(tokens), "rollout_s_per_1k_tokens": median(per_k),
        "turns_mean": median(series["env/turns_mean"]), "gateway_calls_mean": median(series["env/gateway_calls_mean"]),
        "template_drift": sum(v or 0.0 for v in series["env/template_drift"]),
        "failed": sum(v or 0.0 for v in series["env/failed"]),
        "peak_pss_gib": max((r.get("peak_pss_gib") or 0.0 for r in runs), default=None) or None,
    }


def overhead(size: dict[str, Any], timeout_s: float, repeats: int) -> dict[str, Any]:
    """Trains each variant ``repeats`` times, in ABBA order (native, agent, agent, native, ...: a machine that slows
    down or speeds up over the runs affects both alike); returns each variant's pooled summary and the agent's
    overheads. One run's median step moves by up to a fifth between identical runs on 2 shared cores, hence the
    repeats."""
    raw: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for r in range(repeats):
        for variant in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            workdir = Path(tempfile.mkdtemp(prefix=f"rlray-gateway-{variant}-"))
            result_path = workdir / "result.json"
            raw[variant].append(benchlib.run_script_child(__file__, ["run", variant, json.dumps(size), str(result_path)],
                                                          result_path=result_path, log_path=workdir / "log.txt",
                                                          timeout_s=timeout_s, label=f"{variant} {r + 1}/{repeats}"))
    runs = {variant: summarise(raw[variant], size["warmup"]) for variant in VARIANTS}
    native, agent = runs["native"], runs["agent"]
    ratio = {k: benchlib.ratio(agent.get(k), native.get(k)) for k in ("step_s", "rollout_s_per_1k_tokens")}
    return {"runs": runs, "overhead": {k: None if v is None else v - 1.0 for k, v in ratio.items()}}


def overhead_table(result: dict[str, Any]) -> str:
    """Returns the overhead comparison as a markdown table."""
    rows = []
    for variant, r in result["runs"].items():
        if "error" in r:
            rows.append([variant, r["error"], "", "", "", "", "", "", "", ""])
            continue
        rows.append([variant, f"{r['runs']} x {r['steps'] // r['runs']}", benchlib.fmt(r["step_s"]),
                     "; ".join(benchlib.fmt(x) for x in r["step_s_per_run"]), benchlib.fmt(r["rollout_s"]),
                     benchlib.fmt(r["generated_tokens"], 0),
                     benchlib.fmt(r["rollout_s_per_1k_tokens"]), benchlib.fmt(r["turns_mean"]),
                     benchlib.fmt(r["gateway_calls_mean"]), benchlib.fmt(r["template_drift"], 0)])
    o = result["overhead"]
    rows.append(["agent / native - 1", "", benchlib.fmt_percent(o["step_s"]), "", "", "",
                 benchlib.fmt_percent(o["rollout_s_per_1k_tokens"]), "", "", ""])
    return benchlib.markdown_table(["run", "runs x timed steps", "step s (median)", "each run's median step s", "rollout s",
                                    "generated tokens", "rollout s / 1k tokens",
                                    "turns / episode", "gateway calls / episode", "drift"], rows)


def interleaved(size: dict[str, Any], rounds: int) -> dict[str, Any]:
    """Returns the rollout seconds and generated tokens of ``rounds`` rollouts of each variant, interleaved on one
    engine (this process starts a local Ray cluster): one rollout actor and one host that runs the environment and
    the agent, the same rows and sampling for both in each round, the order alternating between rounds, so a busy
    machine slows both alike. The learner's work is the same in both variants; only the rollout differs."""
    import ray

    from rlray.config import load_config
    from rlray.data import load_prompt_rows, prepare_prompts
    from rlray.envs.agents.agent_host import AgentHost
    from rlray.launch.actors import agent_host_kwargs, start_rollout_actors
    from rlray.launch.driver import max_model_len
    from rlray.models import load_tokenizer, resolve_model_path
    from rlray.plan import resolve_plan
    from rlray.rollout.fleet import RolloutFleet
    from rlray.run import build

    workdir = Path(tempfile.mkdtemp(prefix="rlray-gateway-interleaved-"))
    column = ["env.column=benchmark_variant"]  # no row has it: each rollout sends every row to its default
    native_cfg = load_config(CONFIG, overrides("native", size, workdir) + column + ["env.default=retry_arith"])
    agent_cfg = load_config(CONFIG, overrides("native", size, workdir) + column + [
        "env.agents={agent: " + AGENT + "}", "env.default=agent"])
    benchlib.init_local_ray()
    model_dir = resolve_model_path(native_cfg.model.path)
    tokenizer = load_tokenizer(model_dir, native_cfg.model.chat_template)
    actors = start_rollout_actors(resolve_plan(native_cfg), model_dir, max_model_len(native_cfg))
    host = ray.remote(AgentHost).options(max_concurrency=8).remote(
        dict(native_cfg.env.environments), tool_parser=native_cfg.env.tool_parser,
        step_timeout_s=native_cfg.env.step_timeout_s, **agent_host_kwargs(resolve_plan(agent_cfg), model_dir))
    fleet = RolloutFleet(actors)
    rollouts = {"native": build.rollouts(native_cfg, fleet, [host], tokenizer),
                "agent": build.rollouts(agent_cfg, fleet, [host], tokenizer)}
    rows = load_prompt_rows(native_cfg.data.train_files)
    rows, ids, _ = prepare_prompts(rows, tokenizer, max_prompt_tokens=native_cfg.data.max_prompt_tokens, instruction="",
                                   system_prompt=native_cfg.data.system_prompt)
    got: dict[str, list[dict[str, float]]] = {"native": [], "agent": []}
    for r in range(rounds + 1):  # round 0 warms both up and does not count
        batch = slice(r * size["prompts"], (r + 1) * size["prompts"])
        sampling = build.sampling_for_step(native_cfg, r)
        for variant in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            started = time.perf_counter()
            done = rollouts[variant].generate(ids[batch], sampling, rows[batch])
            wall = time.perf_counter() - started
            if r:
                got[variant].append({"rollout_s": wall, "tokens": float(sum(sum(c.loss_mask) for c in done)),
                                     "turns": statistics.mean(c.episode.num_turns for c in done),
                                     "drift": float(sum(c.episode.agent.template_drift for c in done if c.episode.agent))})
        print(f"  round {r}: " + ", ".join(f"{v} {got[v][-1]['rollout_s']:.1f} s" for v in VARIANTS if r), flush=True)
    ray.shutdown()
    return {v: {"rollout_s": statistics.median(x["rollout_s"] for x in runs),
                "rollout_s_per_1k_tokens": statistics.median(1000 * x["rollout_s"] / max(x["tokens"], 1) for x in runs),
                "sampled_tokens": statistics.median(x["tokens"] for x in runs),
                "turns_mean": statistics.mean(x["turns"] for x in runs), "drift": sum(x["drift"] for x in runs),
                "rounds": len(runs)} for v, runs in got.items()}


def interleaved_table(result: dict[str, Any]) -> str:
    """Returns the interleaved rollouts as a markdown table, with the agent's overhead."""
    rows = [[v, r["rounds"], benchlib.fmt(r["rollout_s"]), benchlib.fmt(r["sampled_tokens"], 0),
             benchlib.fmt(r["rollout_s_per_1k_tokens"]), benchlib.fmt(r["turns_mean"]), benchlib.fmt(r["drift"], 0)]
            for v, r in result.items()]
    over = {k: benchlib.ratio(result["agent"][k], result["native"][k]) for k in ("rollout_s", "rollout_s_per_1k_tokens")}
    rows.append(["agent / native - 1", "", benchlib.fmt_percent(None if over["rollout_s"] is None else over["rollout_s"] - 1),
                 "", benchlib.fmt_percent(None if over["rollout_s_per_1k_tokens"] is None
                                          else over["rollout_s_per_1k_tokens"] - 1), "", ""])
    return benchlib.markdown_table(["rollout", "rounds", "rollout s (median)", "sampled tokens", "rollout s / 1k sampled tokens",
                                    "turns / episode", "drift"], rows)


class InstantSampler:
    """An engine that answers every prompt at once with the same 5 tokens (capacity: the gateway's own cost)."""

    reply: list[int] = []

    def __init__(self, actors: list[Any], sampling: Any, min_version: int | None = None) -> None:
        self.num_actors = max(len(actors), 1)

    async def sample(self, actor: int, prompts: list[list[int]], max_new_tokens: int, stop: tuple[str, ...]) -> list[Any]:
        from rlray.envs.agents.conversation import Sampled

        return [Sampled(list(self.reply), [-0.5] * len(self.reply), "stop", 0) for _ in prompts]


def capacity(calls: int, levels: tuple[int, ...]) -> list[dict[str, Any]]:
    """Returns calls answered per second and prompts per engine call at each concurrency in ``levels``."""
    from rlray.envs.agents import AgentRequest
    from rlray.envs.agents.agent_host import AgentBatch, AgentHost
    from rlray.models import load_tokenizer, resolve_model_path

    model_dir = resolve_model_path("tiny-random")  # SmolLM2's tokenizer; the engine is scripted
    tok = load_tokenizer(model_dir)
    InstantSampler.reply = tok("The answer is 4.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    host = AgentHost({}, agents={"chat": CHAT_AGENT}, model_dir=model_dir, sampler_factory=InstantSampler,
                     max_turns=calls + 1, max_episode_tokens=100_000, step_timeout_s=600.0, episode_timeout_s=3600.0)
    out = []
    try:
        for n in levels:
            before = host.gateway_stats()
            batch = AgentBatch([AgentRequest(f"c{n}-{i}", "chat", {"prompt": f"Task {i}", "calls": calls}, i)
                                for i in range(n)], [None], None, 16)
            started = time.perf_counter()
            replies = host.run_agents(batch)
            wall = time.perf_counter() - started
            after = host.gateway_stats()
            answered = sum(r.calls for r in replies)
            engine_calls = after.engine_calls - before.engine_calls
            out.append({"agents": n, "calls": answered, "wall_s": wall, "calls_per_s": answered / wall,
                        "prompts_per_engine_call": answered / max(engine_calls, 1),
                        "drift": sum(r.drift for r in replies), "failed": sum(r.stop_reason != "done" for r in replies)})
            print(f"  {n} agents: {answered / wall:.0f} calls/s", flush=True)
    finally:
        host.shutdown()
    return out


def capacity_table(rows: list[dict[str, Any]]) -> str:
    """Returns the capacity results as a markdown table."""
    return benchlib.markdown_table(
        ["concurrent agents", "calls", "wall s", "calls answered / s", "prompts / engine call", "drift", "failed"],
        [[r["agents"], r["calls"], benchlib.fmt(r["wall_s"]), benchlib.fmt(r["calls_per_s"], 0),
          benchlib.fmt(r["prompts_per_engine_call"], 1), r["drift"], r["failed"]] for r in rows])


def cpu_name() -> str:
    """Returns the CPU's model name (lscpu's "Model name"), or "unknown"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark; prints the tables and writes bench_results/gateway.json; returns the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="seconds-scale sizes, tiny-random")
    parser.add_argument("--capacity", action="store_true", help="only the capacity table (no training runs)")
    parser.add_argument("--repeats", type=int, default=2, help="training runs of each variant, in ABBA order")
    parser.add_argument("--rounds", type=int, default=8, help="interleaved rollouts of each variant (0: none)")
    parser.add_argument("--calls", type=int, default=4, help="chat calls per agent in the capacity table")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="limit per training run")
    args = parser.parse_args(argv)
    size = SIZES["quick" if args.quick else "default"]
    results: dict[str, Any] = {"cpu": cpu_name(), "size": size}
    print(f"CPU: {results['cpu']}", flush=True)
    if not args.capacity:
        results["overhead"] = overhead(size, args.timeout_s, 1 if args.quick else args.repeats)
        print("\n" + overhead_table(results["overhead"]) + "\n", flush=True)
    if not args.capacity and args.rounds:
        workdir = Path(tempfile.mkdtemp(prefix="rlray-gateway-interleaved-"))
        raw = benchlib.run_script_child(__file__, ["interleaved", json.dumps(size), str(args.rounds), str(workdir / "r.json")],
                                        result_path=workdir / "r.json", log_path=workdir / "log.txt",
                                        timeout_s=args.timeout_s, label="interleaved")
        results["interleaved"] = {v: raw[v] for v in VARIANTS} if "error" not in raw else raw
        if "error" not in raw:
            print("\n" + interleaved_table(results["interleaved"]) + "\n", flush=True)
    results["capacity"] = capacity(args.calls, CONCURRENCY[:3] if args.quick else CONCURRENCY)
    print("\n" + capacity_table(results["capacity"]) + "\n", flush=True)
    path = benchlib.write_results("gateway", results)
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child" and sys.argv[2] == "run":
        child_run(sys.argv[3], json.loads(sys.argv[4]), Path(sys.argv[5]))
    elif len(sys.argv) > 2 and sys.argv[1] == "--child" and sys.argv[2] == "interleaved":
        Path(sys.argv[5]).write_text(json.dumps(interleaved(json.loads(sys.argv[3]), int(sys.argv[4]))))
    else:
        main()
