"""GRPO on GSM8K three ways, side by side in one run: TRL GRPOTrainer, rlray sync, rlray async.

    python benchmarks/grpo_vs_trl.py                 # tiny-random and SmolLM2-135M-Instruct, default sizes
    python benchmarks/grpo_vs_trl.py --quick         # seconds-scale sizes, tiny-random only (smoke test)
    python benchmarks/grpo_vs_trl.py --trl-vllm      # also TRL with vLLM colocate (long start-up; see below)
    python benchmarks/grpo_vs_trl.py --models smollm2-135m-instruct --steps 6

Every run gets the same model, prompts (the first GSM8K train questions, in file order, no
shuffling), samples per prompt, max new tokens, learning rate (constant, AdamW, grad-norm clip 1.0),
KL (k3, the same beta, a reference model on both sides), loss (token-mean over the step, clip 0.2 /
0.28), precision (``--dtype``: by default what rlray's ``model.dtype=auto`` picks on this machine, bf16 autocast
over float32 master weights on a GPU or a CPU with native bf16 (AMX / AVX512-BF16), else float32; TRL gets
``bf16=`` the same), one optimizer step per RL step, and
the same reward: rlray's GSM8K verifiers (``gsm8k_correct`` + ``gsm8k_format``, 1.0 correct + 0.2 format)
wrapped as a TRL reward function.

- ``trl``: GRPOTrainer with its default transformers generation, one process, torch on every core.
- ``trl-vllm`` (opt-in, ``--trl-vllm``): GRPOTrainer with ``use_vllm=True, vllm_mode="colocate"``; on
  CPU with vLLM's linear layers patched to stay loadable (``keep_vllm_cpu_weights_loadable``: without
  it TRL's first weight push fails), which costs vLLM its packed CPU GEMMs.
- ``rlray-sync``: ``rlray train`` (Ray, a vLLM rollout actor, a Ray Train learner), rollout.max_staleness=0.
- ``rlray-async``: the same with rollout.max_staleness=1 (step t+1's rollout overlaps step t's update where
  ``rollout.overlap=auto`` overlaps: not where rollout and learner share a small machine's cores; add
  ``--overrides rollout.overlap=on`` to overlap anyway).

The rlray runs use the defaults a user gets (``--placement defaults``, the default): no thread or core
setting is given, ``rlray train``'s own choice applies. ``--placement pinned`` pins, on a CPU machine, the
rollout actor to the last core (resources.rollout.cpu_threads) and the learner to the other cores
(learner.cpu_affinity, one torch thread per core), in both modes. TRL runs in one process whose
generation and update take turns on every core. On a CUDA machine
(torch.cuda.is_available()) TRL trains on GPU 0 and rlray shares GPU 0 between rollout and learner
(colocated, CUDA IPC weight sync) or puts them on GPUs 0 and 1 when there are two.

Each run is a fresh child process; this process samples the memory of the child's whole process tree
(Ray's head, raylet and workers included). Step time is the wall time between consecutive step ends
(everything a step costs, logging included); the first ``--warmup`` steps do not count.
Prints one markdown table per model and writes bench_results/grpo_vs_trl.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import benchlib
from grpo_tables import learner_lines, memory_table, scaling_table, slope, table  # noqa: F401 - also grpo_vs_trl's names

VARIANTS = ("trl", "rlray-sync", "rlray-async")
MODELS = ("tiny-random", "smollm2-135m-instruct")
CORRECT_WEIGHT, FORMAT_WEIGHT = 1.0, 0.2  # the demo's reward (configs/grpo_gsm8k_smollm2.yaml)
MAX_PROMPT_TOKENS = 256


@dataclass
class RunSpec:
    """What every variant of one comparison runs with (plain values; travels to the child as JSON)."""

    model: str
    prompts_per_step: int
    samples_per_prompt: int
    max_new_tokens: int
    steps: int
    warmup: int
    sequences_per_microbatch: int
    lr: float = 1e-5
    kl_coef: float = 0.01
    temperature: float = 1.0
    seed: int = 0
    dtype: str = "float32"
    placement: str = "defaults"
    overrides: tuple[str, ...] = ()
    data_file: str = ""
    workdir: str = ""

    @property
    def sequences_per_step(self) -> int:
        """Returns prompts_per_step * samples_per_prompt (one optimizer step takes them all)."""
        return self.prompts_per_step * self.samples_per_prompt


# sizes per model: the default sizes keep `make bench` under 30 minutes on the 2-core CPU machine
SIZES = {
    "quick": {"tiny-random": dict(prompts_per_step=2, samples_per_prompt=2, max_new_tokens=8, steps=3, warmup=1,
                                  sequences_per_microbatch=4)},
    "default": {
        "tiny-random": dict(prompts_per_step=4, samples_per_prompt=4, max_new_tokens=64, steps=6, warmup=2,
                            sequences_per_microbatch=8),
        "smollm2-135m-instruct": dict(prompts_per_step=4, samples_per_prompt=4, max_new_tokens=64, steps=5, warmup=2,
                                      sequences_per_microbatch=8),
    },
}


# --------------------------------------------------------------------------------------------
# Data: the same prompts for every variant
# --------------------------------------------------------------------------------------------
def write_prompt_file(spec: RunSpec, dest: Path) -> list[int]:
    """Writes the first GSM8K train rows whose rendered prompt fits MAX_PROMPT_TOKENS to ``dest`` (JSONL);
    returns each written row's prompt length in tokens (chat template and instruction included)."""
    from rlray.data import load_prompt_rows, render_prompt
    from rlray.models import load_tokenizer, resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(spec.model))
    instruction = benchlib.gsm8k_instruction()
    source = benchlib.gsm8k_train_file()
    wanted = spec.prompts_per_step * (spec.steps + 2)  # async mode takes one step ahead
    raw = [json.loads(line) for line in source.read_text().splitlines()[: wanted * 2]]
    rows = load_prompt_rows([str(source)], prompt_column="question")[: len(raw)]
    lines, lengths = [], []
    for record, row in zip(raw, rows, strict=True):
        n = len(render_prompt(tokenizer, row.prompt, instruction=instruction, system_prompt=None))
        if n <= MAX_PROMPT_TOKENS:
            lines.append(json.dumps({"question": record["question"], "answer": record["answer"]}))
            lengths.append(n)
        if len(lines) == wanted:
            break
    dest.write_text("\n".join(lines) + "\n")
    return lengths


def prompt_tokens_per_step(lengths: list[int], spec: RunSpec) -> list[int]:
    """Returns the prompt tokens the learner sees per step: step k's prompts, each repeated samples_per_prompt times."""
    p = spec.prompts_per_step
    return [spec.samples_per_prompt * sum(lengths[k * p : (k + 1) * p]) for k in range(spec.steps)]


# --------------------------------------------------------------------------------------------
# Children
# --------------------------------------------------------------------------------------------
def rlray_overrides(spec: RunSpec, max_staleness: int, device: str, gpus: int) -> list[str]:
    """Returns the dotted config overrides of an rlray run of ``spec`` (CPU: rollout and learner on their own cores)."""
    import os

    work = Path(spec.workdir)
    out = [
        f"model.path={spec.model}", f"model.dtype={spec.dtype}",
        f"data.train_files=[{spec.data_file}]", f"data.eval_files=[{spec.data_file}]", "data.shuffle=false",
        f"data.max_prompt_tokens={MAX_PROMPT_TOKENS}",
        f"rollout.samples_per_prompt={spec.samples_per_prompt}", f"rollout.max_new_tokens={spec.max_new_tokens}",
        f"rollout.temperature={spec.temperature}", "rollout.top_p=1.0", f"rollout.max_staleness={max_staleness}",
        "data.prompt_column=question", f"data.instruction={json.dumps(benchlib.gsm8k_instruction())}",
        f"reward.functions=[{{function: gsm8k_correct, weight: {CORRECT_WEIGHT}}}, "
        f"{{function: gsm8k_format, weight: {FORMAT_WEIGHT}}}]",
        "algo.name=grpo", f"algo.kl_coef={spec.kl_coef}", "algo.kl_estimator=k3", "algo.loss_agg=token-mean",
        "algo.clip_eps_low=0.2", "algo.clip_eps_high=0.28",
        f"learner.prompts_per_step={spec.prompts_per_step}", f"learner.lr={spec.lr}", "learner.warmup_steps=0",
        f"learner.sequences_per_minibatch={spec.sequences_per_step}",
        f"learner.sequences_per_microbatch={spec.sequences_per_microbatch}",
        "eval.num_problems=0", "guard.kl_threshold=null",
        f"run.max_steps={spec.steps}", f"run.seed={spec.seed}", f"run.output_dir={work / 'rlray-out'}",
        f"checkpoint.uri={work / 'snapshots'}", "checkpoint.every_steps=100000",
        f"tracking.mlflow_uri=sqlite:///{work / 'mlflow.db'}", "tracking.experiment=bench", "monitor.port=0",
    ]
    if spec.placement == "defaults":
        return out + list(spec.overrides)
    if device == "cpu":
        cores = sorted(os.sched_getaffinity(0))
        learner_cores = cores[:-1] or cores
        out += [f"resources.rollout.cpu_threads={cores[-1]}", f"learner.torch_threads={len(learner_cores)}",
                f"learner.cpu_affinity={','.join(map(str, learner_cores))}"]
    elif gpus >= 2:
        out += ["resources.rollout.gpus=1", "resources.learner.gpus=1"]
    else:
        out += ["resources.colocate=true", "resources.rollout.gpus=0.4", "resources.learner.gpus=0.5",
                "rollout.gpu_memory_utilization=0.3"]
    return out + list(spec.overrides)


def placement_note(variant: str, device: str, gpus: int, placement: str = "pinned") -> str:
    """Returns how a variant uses the hardware, for the table (``placement``: "defaults" or "pinned")."""
    import os

    if variant.startswith("trl"):
        return "1 process, all cores" if device == "cpu" else "1 process, GPU 0"
    if placement == "defaults":
        return "rlray defaults"
    if device == "cpu":
        cores = sorted(os.sched_getaffinity(0))
        learner = ",".join(map(str, cores[:-1] or cores))
        return f"rollout core {cores[-1]}, learner core {learner}"
    return "rollout GPU 1, learner GPU 0" if gpus >= 2 else "rollout+learner GPU 0 (colocated)"


def child_rlray(spec: RunSpec, max_staleness: int, result_path: Path) -> None:
    """Runs rlray train on ``spec`` and writes per-step end times, tokens and timings to ``result_path``. Ray starts
    as under ``rlray train``: beside the driver's imports and checks (``benchlib.start_ray``)."""
    started = benchlib.process_started()
    ray_start = benchlib.start_ray(include_dashboard=None if spec.placement == "defaults" else False)
    import torch

    from rlray.config import config_from_dict
    from rlray.launch.driver import run_training

    device = benchlib.device()
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    cfg = config_from_dict({}, rlray_overrides(spec, max_staleness, device, gpus))
    steps_path = Path(spec.workdir) / "steps.jsonl"
    result = run_training(cfg, step_hooks=[benchlib.StepRecorder(str(steps_path))], ray_start=ray_start)
    result_path.write_text(json.dumps({**rlray_result(result.status, started, steps_path), "startup": result.startup}))


LEARNER_TOKEN_KEYS = ("perf/learner_tokens_real", "perf/learner_tokens_padding", "perf/learner_tokens_shared")


def rlray_result(status: str, started: float, steps_path: Path, extra_metrics: tuple[str, ...] = ()) -> dict[str, Any]:
    """Returns the result JSON of a finished rlray run from its ``StepRecorder`` file: step ends, generated tokens,
    reward, stage timings, and the metrics ``extra_metrics`` per step (``series``)."""
    steps = benchlib.read_steps(steps_path)
    return {
        "status": status,
        "started": started,
        "ends": [s["time"] for s in steps],
        "generated_tokens": [s["metrics"]["rollout/generated_tokens"] for s in steps],
        "reward_mean": [s["metrics"]["reward/mean"] for s in steps],
        "timings": {k: [s["metrics"].get(k) for s in steps] for k in
                    ("timing/rollout_s", "timing/reward_s", "timing/logprobs_s", "timing/update_s",
                     "timing/weight_sync_s", "timing/step_s")},
        "series": {key: [s["metrics"].get(key) for s in steps] for key in extra_metrics},
        "learner_tokens": {key: [s["metrics"].get(key) for s in steps] for key in LEARNER_TOKEN_KEYS},
    }


def keep_vllm_cpu_weights_loadable() -> None:
    """Makes vLLM's CPU linear layers keep their weights (plain ``F.linear``) in this process; TRL needs it.

    On CPU vLLM repacks every linear weight for oneDNN after loading and replaces ``layer.weight`` with
    an empty Parameter, so TRL's colocated weight push (``model.load_weights``) fails with "'Parameter'
    object has no attribute 'weight_loader'" (../shared/ENVIRONMENT.md). With this patch the layers keep
    their loadable weights and compute with ``torch.nn.functional.linear`` (vLLM's own fallback), which
    is slower than the packed GEMMs: TRL-vLLM on CPU is measured with that handicap. rlray reloads
    through vLLM's own loader instead and keeps the packed GEMMs.
    """
    import torch.nn.functional as F
    from vllm.model_executor.layers import utils

    def plain_linear(layer: Any, remove_weight: bool) -> None:
        layer.cpu_linear = F.linear

    utils.dispatch_cpu_unquantized_gemm = plain_linear


def trl_step_clock() -> Any:
    """Returns a TrainerCallback that records each optimizer step's end time (``ends``) and the logs of the steps
    (``logs``: the ones carrying ``completions/mean_length``)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.logs: list[dict] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.time())

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                self.logs.append(dict(logs))

    return StepClock()


def trl_args(spec: RunSpec, use_vllm: bool, **extra: Any) -> Any:
    """Returns the GRPOConfig every TRL run of ``spec`` gets (the settings the module docstring lists); ``extra``
    adds or replaces fields (the environment benchmark's tool-calling limits)."""
    from trl import GRPOConfig

    device = benchlib.device()
    fields = dict(
        output_dir=str(Path(spec.workdir) / "trl-out"),
        per_device_train_batch_size=spec.sequences_per_microbatch,
        gradient_accumulation_steps=spec.sequences_per_step // spec.sequences_per_microbatch,
        num_generations=spec.samples_per_prompt,
        max_completion_length=spec.max_new_tokens,
        learning_rate=spec.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        bf16=spec.dtype == "bfloat16", use_cpu=device == "cpu", model_init_kwargs={"dtype": "float32"},
        beta=spec.kl_coef, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="group",
        gradient_checkpointing=False, max_steps=spec.steps, logging_steps=1, save_strategy="no", report_to="none",
        shuffle_dataset=False, temperature=spec.temperature, top_p=1.0, top_k=0, seed=spec.seed,
        dataloader_num_workers=0, disable_tqdm=True, log_completions=False,
        use_vllm=use_vllm, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3 if device == "cuda" else 0.05,
        vllm_max_model_length=MAX_PROMPT_TOKENS + spec.max_new_tokens,
    )
    # (on CPU vLLM's gpu_memory_utilization is the share of the machine's RAM it reserves: 0.05 of 23.5 GiB
    # is ~1.2 GiB of KV cache (rlray sizes its own to the step: rollout.kv_cache_gib=None); 0.3 would ask for 7 GiB.)
    return GRPOConfig(**{**fields, **extra})


def trl_result(clock: Any, spec: RunSpec, started: float, extra_logs: tuple[str, ...] = ()) -> dict[str, Any]:
    """Returns the result JSON of a finished TRL run from its ``trl_step_clock``: step ends, generated tokens per step
    (completions/mean_length x sequences), tokens seen, reward, and the logged keys ``extra_logs`` per step (``series``)."""
    seen = [log.get("num_tokens", 0.0) for log in clock.logs]
    return {
        "status": "FINISHED",
        "started": started,
        "ends": clock.ends,
        "generated_tokens": [log["completions/mean_length"] * spec.sequences_per_step for log in clock.logs],
        "trained_tokens_logged": [b - a for a, b in itertools.pairwise([0.0, *seen])],
        "reward_mean": [log.get("reward", float("nan")) for log in clock.logs],
        "series": {key: [log.get(key) for log in clock.logs] for key in extra_logs},
    }


def child_trl(spec: RunSpec, use_vllm: bool, result_path: Path) -> None:
    """Runs TRL's GRPOTrainer on ``spec`` and writes per-step end times and tokens to ``result_path``."""
    started = benchlib.process_started()
    from datasets import Dataset
    from trl import GRPOTrainer

    from rlray.data import load_prompt_rows
    from rlray.models import load_tokenizer, resolve_model_path
    from rlray.reward.verifiers import gsm8k_correct, gsm8k_format

    model_dir = resolve_model_path(spec.model)
    instruction = benchlib.gsm8k_instruction()
    rows = load_prompt_rows([spec.data_file], prompt_column="question")
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": f"{r.prompt}\n\n{instruction}"}], "answer": r.columns["answer"]} for r in rows]
    )

    def gsm8k(prompts: list, completions: list, answer: list[str], **_: Any) -> list[float]:
        correct = gsm8k_correct(prompts, completions, answer=answer)  # rlray's built-in verifiers, TRL's signature
        fmt = gsm8k_format(prompts, completions)
        return [CORRECT_WEIGHT * c + FORMAT_WEIGHT * f for c, f in zip(correct, fmt, strict=True)]

    if use_vllm and benchlib.device() == "cpu":
        keep_vllm_cpu_weights_loadable()
    clock = trl_step_clock()
    trainer = GRPOTrainer(model=model_dir, reward_funcs=[gsm8k], args=trl_args(spec, use_vllm), train_dataset=dataset,
                          processing_class=load_tokenizer(model_dir), callbacks=[clock])
    trainer.train()
    result_path.write_text(json.dumps(trl_result(clock, spec, started)))


def run_child_main(argv: list[str]) -> None:
    """Entry point of a child process: ``--child VARIANT SPEC_JSON RESULT_JSON``."""
    variant, spec_json, result_json = argv
    spec = RunSpec(**json.loads(Path(spec_json).read_text()))
    if variant.startswith("trl"):
        child_trl(spec, variant == "trl-vllm", Path(result_json))
    else:
        child_rlray(spec, 1 if variant == "rlray-async" else 0, Path(result_json))


# --------------------------------------------------------------------------------------------
# Parent: run the variants, summarise, compare
# --------------------------------------------------------------------------------------------
def summarise(raw: dict[str, Any], spec: RunSpec, prompt_tokens: list[int]) -> dict[str, Any]:
    """Returns the table figures of one finished run: median step time after warm-up, tokens/s, time to step 1."""
    durations = benchlib.step_durations(raw["ends"])
    kept = durations[spec.warmup - 1 :]
    gen = raw["generated_tokens"][spec.warmup :]
    trained = [g + p for g, p in zip(raw["generated_tokens"], prompt_tokens, strict=False)][spec.warmup :]
    out = {
        "median_step_s": benchlib.median_after_warmup(durations, spec.warmup),
        "generated_tokens_per_s": benchlib.per_second(gen, kept),
        "trained_tokens_per_s": benchlib.per_second(trained, kept),
        "first_step_end_s": raw["ends"][0] - raw["started"] if raw["ends"] else None,
        "step_s": durations,
        "steps_done": len(raw["ends"]),
        "reward_mean": raw.get("reward_mean"),
    }
    if "timings" in raw:  # rlray's own stage timings, median over the counted steps
        out["stage_median_s"] = {k: benchlib.median_after_warmup(v[1:], spec.warmup) for k, v in raw["timings"].items()
                                 if all(x is not None for x in v)}
    if "learner_tokens" in raw:  # what the learner's forwards computed per step (real, padding, shared)
        out["learner_tokens_median"] = {k: benchlib.median_after_warmup(v[1:], spec.warmup)
                                        for k, v in raw["learner_tokens"].items() if all(x is not None for x in v)}
    if "trained_tokens_logged" in raw:
        out["trained_tokens_logged"] = raw["trained_tokens_logged"]
    if raw.get("startup"):  # rlray's startup/* seconds (where the time before step 1 went; rlray.observe.startup)
        out["startup"] = raw["startup"]
    if "series" in raw:  # a benchmark's own per-step figures (env_vs_trl: tool calls and turns per episode)
        out["series"] = raw["series"]
    return out


def run_variant(variant: str, spec: RunSpec, timeout_s: float, script: str | Path = __file__) -> dict[str, Any]:
    """Runs one variant in a child process of ``script`` and returns its raw result plus memory, or the error."""
    work = Path(spec.workdir)
    spec_path, result_path = work / "spec.json", work / f"{variant}.result.json"
    spec_path.write_text(json.dumps(asdict(spec)))
    return benchlib.run_script_child(script, [variant, spec_path, result_path], result_path=result_path,
                                     log_path=work / f"{variant}.log", timeout_s=timeout_s, label=variant)


def compare(model: str, spec: RunSpec, variants: list[str], timeout_s: float, keep: bool, *,
            write_data: Any = None, script: str | Path = __file__) -> dict[str, Any]:
    """Runs every variant on ``model`` one after another; returns {spec, runs: {variant: figures}}.

    ``write_data(spec, path)`` writes the prompt file and returns each prompt's length in tokens (default
    ``write_prompt_file``: GSM8K); ``script`` is the benchmark whose ``--child`` runs one variant."""
    device = benchlib.device()
    import torch

    gpus = torch.cuda.device_count() if device == "cuda" else 0
    root = Path(tempfile.mkdtemp(prefix=f"bench-{Path(script).stem}-{model}-"))
    spec.data_file = str(root / "prompts.jsonl")
    lengths = (write_data or write_prompt_file)(spec, Path(spec.data_file))
    prompt_tokens = prompt_tokens_per_step(lengths, spec)
    runs: dict[str, Any] = {}
    for variant in variants:
        spec.workdir = str(root / variant)
        Path(spec.workdir).mkdir(parents=True, exist_ok=True)
        raw = run_variant(variant, spec, timeout_s, script)
        figures = {"placement": placement_note(variant, device, gpus, spec.placement), "wall_s": raw["wall_s"],
                   "peak_rss_gib": raw["peak_rss_gib"], "peak_pss_gib": raw["peak_pss_gib"],
                   "peak_processes": raw["peak_processes"], "peak_by_process": raw.get("peak_by_process", {}),
                   "affinity": raw["affinity"]}
        if "error" in raw:
            figures.update(error=raw["error"], log_tail=raw["log_tail"])
        else:
            figures.update(summarise(raw, spec, prompt_tokens))
        runs[variant] = figures
    if not keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return {"spec": {k: v for k, v in asdict(spec).items() if k not in ("data_file", "workdir")},
            "prompt_tokens_per_step": prompt_tokens, "runs": runs}


def add_ratios(runs: dict[str, Any]) -> None:
    """Adds each run's ratios against TRL (and async against sync) in place.

    step_time_vs_trl < 1 and tokens_per_s_vs_trl > 1 mean faster than TRL; rss_vs_trl < 1 means less memory.
    """
    base = runs.get("trl", {})
    for r in runs.values():
        r["step_time_vs_trl"] = benchlib.ratio(r.get("median_step_s"), base.get("median_step_s"))
        r["generated_tokens_per_s_vs_trl"] = benchlib.ratio(r.get("generated_tokens_per_s"), base.get("generated_tokens_per_s"))
        r["trained_tokens_per_s_vs_trl"] = benchlib.ratio(r.get("trained_tokens_per_s"), base.get("trained_tokens_per_s"))
        r["peak_rss_vs_trl"] = benchlib.ratio(r.get("peak_rss_gib"), base.get("peak_rss_gib"))
        r["peak_pss_vs_trl"] = benchlib.ratio(r.get("peak_pss_gib"), base.get("peak_pss_gib"))
    if "rlray-async" in runs and "rlray-sync" in runs:
        runs["rlray-async"]["step_time_vs_sync"] = benchlib.ratio(
            runs["rlray-async"].get("median_step_s"), runs["rlray-sync"].get("median_step_s"))


SCALING = {"prompts_per_step": (4, 8, 16), "max_new_tokens": (64, 128, 256)}
def scaling(model: str, base: dict[str, Any], variants: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Runs ``variants`` at each point of ``SCALING`` (one size doubles, the others stay at ``base``); returns
    {"points": [{grows, value, runs}], "slopes": {grows: {run: {"step_s_per_unit", "pss_gib_per_unit"}}}}."""
    points, slopes = [], {}
    done: dict[tuple, dict[str, Any]] = {}  # the base point is on both lines: run once
    for grows, values in SCALING.items():
        rows = []
        for value in values:
            size = {**base, grows: value}
            key = tuple(sorted(size.items()))
            if key not in done:
                spec = RunSpec(model=model, dtype=run_dtype(args.dtype), placement=args.placement,
                               overrides=tuple(args.overrides), **size)
                print(f"{model}: {grows}={value}: {', '.join(variants)}", flush=True)
                result = compare(model, spec, variants, args.timeout_s, args.keep)
                add_ratios(result["runs"])
                done[key] = result["runs"]
                print("  " + "; ".join(f"{v}: median step {benchlib.fmt(r.get('median_step_s'))} s, peak PSS "
                                       f"{benchlib.fmt(r.get('peak_pss_gib'))} GiB" for v, r in result["runs"].items()),
                      flush=True)  # each point as it lands: a long sweep cut short keeps what it measured
            rows.append({"grows": grows, "value": value, "runs": done[key]})
        points += rows
        slopes[grows] = {v: {"step_s_per_unit": slope(list(values), [r["runs"][v].get("median_step_s") for r in rows]),
                             "pss_gib_per_unit": slope(list(values), [r["runs"][v].get("peak_pss_gib") for r in rows])}
                         for v in variants}
    return {"points": points, "slopes": slopes}


def run_dtype(dtype: str) -> str:
    """Returns the precision every run gets: ``dtype``, with "auto" resolved as rlray resolves ``model.dtype=auto``
    here (``rlray.models.resolve_dtype``: bf16 on a GPU or a CPU with native bf16, else float32)."""
    from rlray.models.loading import resolve_dtype

    return resolve_dtype(dtype, gpu=benchlib.device() == "cuda")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the comparison; prints the tables and writes bench_results/grpo_vs_trl.json; returns the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="seconds-scale sizes, tiny-random only")
    parser.add_argument("--models", nargs="+", default=None, help=f"models to compare (default: {' '.join(MODELS)})")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), help="runs per model")
    parser.add_argument("--trl-vllm", action="store_true", help="also run TRL with vLLM colocate")
    parser.add_argument("--steps", type=int, help="steps per run (overrides the size table)")
    parser.add_argument("--warmup", type=int, help="steps that do not count (at least 1)")
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="limit per run")
    parser.add_argument("--keep", action="store_true", help="keep the runs' folders (logs, MLflow store)")
    parser.add_argument("--name", default="grpo_vs_trl", help="results file name under bench_results/")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                        help="precision of every run (auto: what rlray's model.dtype=auto picks on this machine)")
    parser.add_argument("--scaling", action="store_true",
                        help="instead of the comparison: step time and peak PSS of trl and rlray-sync as prompts per "
                             "step (4, 8, 16) and max new tokens (64, 128, 256) double, with the slope of each line")
    parser.add_argument("--placement", choices=("defaults", "pinned"), default="defaults",
                        help="rlray runs on the defaults a user gets, or pinned by hand (CPU: rollout last core)")
    parser.add_argument("--overrides", nargs="+", default=[], metavar="KEY=VALUE",
                        help="extra dotted config overrides of the rlray runs (last wins), e.g. learner.torch_threads=1")
    args = parser.parse_args(argv)
    sizes = SIZES["quick" if args.quick else "default"]
    models = args.models or list(sizes)
    variants = list(args.variants) + (["trl-vllm"] if args.trl_vllm and "trl-vllm" not in args.variants else [])
    results: dict[str, Any] = {"variants": variants, "models": {}}
    if args.scaling:
        model = (args.models or ["smollm2-135m-instruct"])[0]
        base = dict(SIZES["default"].get(model, SIZES["default"]["tiny-random"]))
        base.update({k: v for k, v in (("steps", args.steps or 4), ("warmup", args.warmup or 2))})
        variants = [v for v in args.variants if v in ("trl", "rlray-sync")] or ["trl", "rlray-sync"]
        results = {"scaling": scaling(model, base, variants, args), "model": model}
        print("\n" + scaling_table(results["scaling"]) + "\n", flush=True)
        path = benchlib.write_results(f"{args.name}_scaling", results)
        print(f"wrote {path}")
        return results
    for model in models:
        size = dict(sizes.get(model, SIZES["default"].get(model, SIZES["default"]["tiny-random"])))
        size.update({k: v for k, v in (("steps", args.steps), ("warmup", args.warmup)) if v is not None})
        size["warmup"] = max(1, min(size["warmup"], size["steps"] - 1))
        spec = RunSpec(model=model, dtype=run_dtype(args.dtype), placement=args.placement, overrides=tuple(args.overrides), **size)
        print(f"{model}: {', '.join(variants)}", flush=True)
        results["models"][model] = result = compare(model, spec, variants, args.timeout_s, args.keep)
        add_ratios(result["runs"])
        print("\n" + table(model, result) + "\n", flush=True)
    path = benchlib.write_results(args.name, results)
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        run_child_main(sys.argv[2:])
    else:
        main()
