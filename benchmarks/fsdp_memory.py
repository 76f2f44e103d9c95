"""What FSDP2 buys on the learner: per-rank memory under DDP and under FSDP with 2 ranks, same config (SmolLM2-135M).

    python benchmarks/fsdp_memory.py                  # SmolLM2-135M-Instruct: the table, then the two capped runs
    python benchmarks/fsdp_memory.py --quick          # tiny-random, the table only
    python benchmarks/fsdp_memory.py --cap-gib 3.0    # another learner memory cap for the runs

1. The table. For each strategy, 2 learner ranks over gloo (one child process each, as Ray Train's workers are),
   each built as a run builds it (``rlray.run.build.learner_kwargs``: DDP as ``ray.train.torch.prepare_model`` wraps
   on the CPU, or ``rlray.learner.parallel.FSDP2``), run two optimizer steps on their share of a full-length
   mini-batch (the planner's padded worst case). Each rank counts the bytes of its own parameters, gradients and
   AdamW state (a DTensor's local shard under FSDP) and samples its proportional set size (PSS, every 20 ms); rank 0
   then exports the policy for a weight sync (``export_weights`` in bf16 and ``rollout.wire.pack_weights``) and
   reports the PSS that adds. The planner's prediction (``rlray plan``) stands beside each measurement.
2. The cap, as a user meets it: ``rlray train`` on the same config (2 steps, rollouts on transformers) with
   ``guard.memory_cap_gib`` between the two: the DDP run is stopped by the memory guard after its first step (its
   status and message from MLflow), the FSDP run finishes. The preflight's fit check warns about the DDP config
   first (the planner predicts it over the cap).

Prints markdown tables and writes bench_results/fsdp_memory.json. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import benchlib

CONFIG = benchlib.REPO / "configs" / "grpo_gsm8k_smollm2.yaml"
SIZES = {
    "quick": dict(model="tiny-random", prompt_tokens=64, response_tokens=32, runs=False),
    "default": dict(model="smollm2-135m-instruct", prompt_tokens=256, response_tokens=64, runs=True),
}
CAP_GIB = 4.0
"""The learner cap of the runs: between the DDP and FSDP ranks' peak PSS measured with this config (5.56 and 2.70 GiB
on this project's CPU machine, README) and the planner's figures (4.92 and 3.05 GiB)."""


def overrides(model: str, strategy: str, prompt_tokens: int, response_tokens: int) -> list[str]:
    """Returns the config both parts use: 2 learner ranks of ``strategy``, 16 sequences per mini-batch (8 per rank, 2
    micro-batches of 4), the KL's reference on the learner."""
    return [f"model.path={model}", "resources.learner.num_workers=2", f"resources.learner.strategy={strategy}",
            "learner.prompts_per_step=4", "rollout.samples_per_prompt=4", "learner.sequences_per_minibatch=16",
            "learner.sequences_per_microbatch=4", f"data.max_prompt_tokens={prompt_tokens}",
            f"rollout.max_new_tokens={response_tokens}", "learner.torch_threads=1"]  # fmt: skip


# --------------------------------------------------------------------------------------------
# 1. One learner rank (a child process)
# --------------------------------------------------------------------------------------------
class PssSampler:
    """Samples this process's PSS (``/proc/self/smaps_rollup``) every ``interval_s`` in a thread; keeps the peak."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s, self.peak = interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> int:
        """Returns this process's PSS in bytes."""
        with open("/proc/self/smaps_rollup") as f:
            return int(next(line for line in f if line.startswith("Pss:")).split()[1]) * 1024

    def start(self) -> PssSampler:
        self.peak = self.now()
        self._thread.start()
        return self

    def reset(self) -> None:
        self.peak = self.now()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self.now())


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def rank_main(a: argparse.Namespace) -> None:
    """One learner rank: builds the learner, steps twice, measures; writes rank_<r>.json into ``a.out``."""
    import torch
    import transformers  # noqa: F401  (in the baseline, as in every learner process)
    from gpu_check import full_length_batch

    from rlray.config import config_from_dict
    from rlray.learner import PolicyLearner
    from rlray.learner.objective import Normaliser
    from rlray.learner.parallel import DDP
    from rlray.models import resolve_model_path
    from rlray.rollout.wire import pack_weights
    from rlray.run import build

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{a.store}", rank=a.rank, world_size=2)
    cfg = config_from_dict({}, overrides(a.model, a.strategy, a.prompt_tokens, a.response_tokens))
    sampler = PssSampler().start()
    baseline = sampler.now()
    kwargs = build.learner_kwargs(cfg, 2)
    if a.strategy == "ddp":
        kwargs["parallel"] = DDP(wrap_model=torch.nn.parallel.DistributedDataParallel)  # prepare_model's wrap on the CPU
    learner = PolicyLearner(resolve_model_path(cfg.model.path), **kwargs)
    rows = cfg.learner.sequences_per_minibatch // 2
    whole = full_length_batch(learner.module.config.vocab_size, 2 * rows, a.prompt_tokens, a.response_tokens)
    mine = whole.rows(slice(a.rank * rows, (a.rank + 1) * rows))
    spec = build.update_spec(cfg, 2)
    norm = Normaliser(float(2 * rows * a.response_tokens), float(2 * rows), 2)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        learner.train_minibatch(mine, spec.loss, norm, spec.batching)
        times.append(time.perf_counter() - start)
    step_peak = sampler.peak
    params = list(learner.module.parameters())
    frozen = [p for m in (learner.reference, learner.teacher) if m is not None for p in m.module.parameters()]
    out = {
        "strategy": a.strategy, "rank": a.rank, "baseline_gib": baseline / benchlib.GIB,
        "peak_pss_gib": step_peak / benchlib.GIB, "step_s": times[-1],
        "parameters_gib": _local_bytes(params) / benchlib.GIB,
        "gradients_gib": _local_bytes(p.grad for p in params if p.grad is not None) / benchlib.GIB,
        "optimizer_gib": _local_bytes(v for s in learner.optimizer.state.values() for v in s.values()
                                      if isinstance(v, torch.Tensor) and v.dim() > 0) / benchlib.GIB,
        "reference_gib": _local_bytes(frozen) / benchlib.GIB,
    }
    torch.distributed.barrier()
    before = sampler.now()
    sampler.reset()
    weights = learner.export_weights(torch.bfloat16)  # a collective under FSDP: every rank exports
    payload = pack_weights(weights)  # the wire format: views of the exported tensors, no copy
    out["push_peak_gib"] = (sampler.peak - before) / benchlib.GIB
    out["exported_gib"] = sum(t.nbytes for t in weights.values()) / benchlib.GIB
    del payload, weights
    sampler.stop()
    Path(a.out, f"rank_{a.rank}.json").write_text(json.dumps(out))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def measure(strategy: str, size: dict[str, Any], work: Path) -> list[dict[str, Any]]:
    """Runs the 2 ranks of ``strategy``; returns their measurements (and the planner's rank prediction on rank 0's)."""
    import subprocess

    from rlray.config import config_from_dict
    from rlray.launch.plan import plan_run
    from rlray.plan import resolve_plan

    folder = work / strategy
    folder.mkdir()
    args = [sys.executable, __file__, "--rank-of", strategy, "--store", str(folder / "store"), "--out", str(folder),
            "--model", size["model"], "--prompt-tokens", str(size["prompt_tokens"]),
            "--response-tokens", str(size["response_tokens"])]
    procs = [subprocess.Popen([*args, "--rank", str(r)], env=benchlib.child_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{strategy} ranks failed:\n" + "\n".join(o[-3000:] for o in outs))
    ranks = [json.loads((folder / f"rank_{r}.json").read_text()) for r in range(2)]
    cfg = config_from_dict({}, overrides(size["model"], strategy, size["prompt_tokens"], size["response_tokens"]))
    ranks[0]["planned_gib"] = plan_run(resolve_plan(cfg)).roles[0].total_gib
    return ranks


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    """Returns the per-rank table: DDP's and FSDP's rank 0 and rank 1 side by side."""
    rows = []
    for strategy, ranks in results.items():
        for r in ranks:
            rows.append([strategy.upper(), r["rank"], benchlib.fmt(r["parameters_gib"]), benchlib.fmt(r["gradients_gib"]),
                         benchlib.fmt(r["optimizer_gib"]), benchlib.fmt(r["reference_gib"]),
                         benchlib.fmt(r["peak_pss_gib"]), benchlib.fmt(r.get("planned_gib")),
                         benchlib.fmt(r["push_peak_gib"]), benchlib.fmt(r["step_s"], 1)])
    return benchlib.markdown_table(["strategy", "rank", "params GiB", "grads GiB", "AdamW GiB", "reference GiB",
                                    "peak PSS GiB", "planned GiB", "push +PSS GiB", "step s"], rows)


# --------------------------------------------------------------------------------------------
# 2. The capped runs (rlray train)
# --------------------------------------------------------------------------------------------
def capped_run(strategy: str, size: dict[str, Any], cap_gib: float, work: Path) -> dict[str, Any]:
    """Runs ``rlray train`` with ``guard.memory_cap_gib=cap_gib``; returns its status, stop message and peaks."""
    from rlray.observe.tracking import get_run

    folder = work / f"run-{strategy}"
    uri = f"sqlite:///{folder}/mlflow.db"
    argv = [sys.executable, "-m", "rlray.cli", "train", str(CONFIG),
            *overrides(size["model"], strategy, size["prompt_tokens"], size["response_tokens"]),
            "run.max_steps=2", "eval.num_problems=0", "rollout.backend=hf", "checkpoint.every_steps=100",
            f"guard.memory_cap_gib={cap_gib}", f"run.output_dir={folder}/out", f"checkpoint.uri={folder}/ckpt",
            f"tracking.mlflow_uri={uri}", f"data.train_files=[{benchlib.gsm8k_train_file()}]"]
    run = benchlib.run_child(argv, log_path=folder / "run.log", timeout_s=3600)
    log = Path(run["log"]).read_text()
    summary = json.loads(log[log.rindex("{\n"):]) if "{\n" in log else {}
    tags = get_run(uri, summary["run_id"]).data.tags if "run_id" in summary else {}
    learners = {k: v for k, v in run["peak_by_process"].items() if k == "ray::RayTrainWorker"}  # benchlib.process_label
    return {"strategy": strategy, "status": summary.get("status", f"exit code {run['returncode']}"),
            "stop_message": tags.get("rlray.stop_message", ""), "wall_s": run["wall_s"],
            "preflight_warning": next((line for line in log.splitlines() if "needs" in line and "GiB" in line), ""),
            "learner_rss_at_peak_gib": {k: v["rss_gib"] for k, v in learners.items()}}


def cpu_model() -> str:
    """Returns lscpu's "Model name" of this machine, or "unknown"."""
    import subprocess

    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "unknown")


def main(argv: list[str] | None = None) -> int:
    """Runs the measurements (or one rank with ``--rank-of``); prints the tables; returns 0."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--cap-gib", type=float, default=CAP_GIB)
    p.add_argument("--no-runs", action="store_true", help="the table only")
    p.add_argument("--rank-of", choices=["ddp", "fsdp"], help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--prompt-tokens", type=int, help=argparse.SUPPRESS)
    p.add_argument("--response-tokens", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.rank_of:
        a.strategy = a.rank_of
        rank_main(a)
        return 0
    size = SIZES["quick" if a.quick else "default"]
    machine = {**benchlib.machine(), "cpu": cpu_model()}
    print(f"CPU: {machine['cpu']}", flush=True)
    with tempfile.TemporaryDirectory(prefix="rlray-fsdp-memory-") as tmp:
        results = {s: measure(s, size, Path(tmp)) for s in ("ddp", "fsdp")}
        print(table(results), flush=True)
        runs = []
        if size["runs"] and not a.no_runs:
            runs = [capped_run(s, size, a.cap_gib, Path(tmp)) for s in ("ddp", "fsdp")]
            print(benchlib.markdown_table(
                ["strategy", f"guard.memory_cap_gib={a.cap_gib:g}", "stop message"],
                [[r["strategy"].upper(), r["status"], r["stop_message"] or "-"] for r in runs]))
            for r in runs:
                print(f"{r['strategy']}: preflight: {r['preflight_warning'] or '-'}; learner RSS at the run's peak "
                      f"{ {k: round(v, 2) for k, v in r['learner_rss_at_peak_gib'].items()} }")
    benchlib.write_results("fsdp_memory", {"machine": machine, "size": size, "ranks": results, "runs": runs,
                                           "cap_gib": a.cap_gib})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
