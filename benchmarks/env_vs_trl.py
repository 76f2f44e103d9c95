"""Multi-turn tool calling side by side: TRL 1.16 ``GRPOTrainer(environment_factory=...)`` vs rlray, one environment.

    python benchmarks/env_vs_trl.py                  # SmolLM2-135M-Instruct, default sizes (~25 min on 2 cores)
    python benchmarks/env_vs_trl.py --quick          # tiny-random, seconds-scale sizes (smoke test)
    python benchmarks/env_vs_trl.py --steps 6 --variants trl rlray-sync

Both runs get the same environment class, unchanged: ``benchmarks/multiply_env.py:MultiplyEnv`` in TRL's
``environment_factory`` shape (``reset(**row)`` appends a hint to the prompt, the public method ``multiply`` is
the tool, ``get_reward`` scores the episode); rlray runs it through ``rlray.envs.trl`` (``env.environments``).
Same model, the same seeded questions ("What is 37 x 45?", no shuffling), the ``smollm2-tools`` chat template
(SmolLM2's ChatML with Hermes ``<tool_call>`` blocks; TRL parses them with its ``qwen3_template`` response
template, the same Hermes format), samples per prompt, learning rate, KL, loss and precision as
``grpo_vs_trl.py`` (``grpo_vs_trl.trl_args`` / ``rlray_overrides``), and the environment's reward only.

Turn limits, matched as closely as the two APIs allow: rlray samples at most ``--max-turns`` assistant turns of
``max_new_tokens`` each (``env.max_turns``, ``rollout.max_new_tokens``); TRL calls tools at most
``max_turns - 1`` times (``max_tool_calling_iterations``) within a completion of ``max_turns * max_new_tokens``
tokens, tool results included (``max_completion_length``). Both end an episode on the first turn without a tool
call. The table gives the work each did per step (generated tokens, tool calls per episode) next to the time, so
a run that did less is visible.

SmolLM2-135M-Instruct never writes a parsable tool call on its own (0 of 32 samples at temperature 1, with and
without a worked example of the call in the prompt), which would make every episode single-turn. So the model is
first taught the call format (``--teach-steps``, default 10): TRL's SFTTrainer, in a child process, on questions
with another seed than the benchmark's, the rendered prompt (tool schema included) completed with the Hermes call
``<tool_call>{"name": "multiply", "arguments": {...}}</tool_call>``; both runs start from that model. ``--teach-steps
0`` benchmarks the model as it is.

- ``trl``: GRPOTrainer with transformers generation, one process, torch on every core.
- ``rlray-sync``: ``rlray train`` on the defaults (a vLLM rollout actor, environment actors, a Ray Train learner).

Prints a markdown table (step time, generated tokens/s, tool calls per episode, peak PSS, ratios to TRL) and the
per-process memory table; writes bench_results/env_vs_trl.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import benchlib
import grpo_vs_trl as grpo

VARIANTS = ("trl", "rlray-sync")
ENV_FILE = Path(__file__).resolve().parent / "multiply_env.py"
MAX_PROMPT_TOKENS = 512  # the opening: the system turn with the tool's schema (~300 tokens) and the question


@dataclass
class EnvRunSpec(grpo.RunSpec):
    """``grpo_vs_trl.RunSpec`` plus the episode's turn limit; ``max_new_tokens`` is per assistant turn."""

    max_turns: int = 3


SIZES = {
    "quick": {"tiny-random": dict(prompts_per_step=2, samples_per_prompt=2, max_new_tokens=16, steps=3, warmup=1,
                                  sequences_per_microbatch=4)},
    "default": {"smollm2-135m-instruct": dict(prompts_per_step=4, samples_per_prompt=4, max_new_tokens=64, steps=5,
                                              warmup=2, sequences_per_microbatch=8)},
}


def write_env_rows(spec: grpo.RunSpec, dest: Path) -> list[int]:
    """Writes the seeded questions every run gets to ``dest`` (JSONL; ``multiply_env.rows``); returns no prompt
    lengths (the rendered opening depends on the tool schema each side renders; trained tokens are not compared)."""
    sys.path.insert(0, str(ENV_FILE.parent))
    import multiply_env

    multiply_env.write_rows(dest, spec.prompts_per_step * (spec.steps + 2), seed=spec.seed)
    return []


def env_overrides(spec: EnvRunSpec) -> tuple[str, ...]:
    """Returns the rlray overrides that turn ``grpo_vs_trl``'s GSM8K run into this benchmark's environment run."""
    return (
        "model.chat_template=smollm2-tools", "data.prompt_column=prompt", 'data.instruction=""',
        f"data.max_prompt_tokens={MAX_PROMPT_TOKENS}", "reward.functions=[]",
        f"env.environments={{multiply: '{ENV_FILE}:MultiplyEnv'}}", f"env.max_turns={spec.max_turns}",
    )


def child_rlray(spec: EnvRunSpec, result_path: Path) -> None:
    """Runs rlray train on the environment and writes step ends, tokens and episode figures to ``result_path``. Ray
    starts as under ``rlray train``: beside the driver's imports and checks (``benchlib.start_ray``)."""
    started = benchlib.process_started()
    ray_start = benchlib.start_ray(include_dashboard=None if spec.placement == "defaults" else False)
    import torch

    from rlray.config import config_from_dict
    from rlray.launch.driver import run_training

    device = benchlib.device()
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    spec.overrides = (*env_overrides(spec), *spec.overrides)
    cfg = config_from_dict({}, grpo.rlray_overrides(spec, 0, device, gpus))
    steps_path = Path(spec.workdir) / "steps.jsonl"
    result = run_training(cfg, step_hooks=[benchlib.StepRecorder(str(steps_path))], ray_start=ray_start)
    raw = grpo.rlray_result(result.status, started, steps_path, ("env/tool_calls_mean", "env/turns_mean"))
    raw["series"] = {"tool_calls_per_episode": raw["series"]["env/tool_calls_mean"],
                     "turns_per_episode": raw["series"]["env/turns_mean"]}
    result_path.write_text(json.dumps(raw))


def child_trl(spec: EnvRunSpec, result_path: Path) -> None:
    """Runs TRL's GRPOTrainer with ``environment_factory=MultiplyEnv`` and writes step ends, tokens and tool calls
    to ``result_path``."""
    import os

    started = benchlib.process_started()
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    from datasets import Dataset
    from trl import GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from rlray.models import load_tokenizer, resolve_model_path

    sys.path.insert(0, str(ENV_FILE.parent))
    from multiply_env import MultiplyEnv

    model_dir = resolve_model_path(spec.model)
    tokenizer = load_tokenizer(model_dir, chat_template="smollm2-tools")
    tokenizer.response_template = qwen3_template  # Hermes <tool_call> blocks, as smollm2-tools renders them
    rows = [json.loads(line) for line in Path(spec.data_file).read_text().splitlines()]
    dataset = Dataset.from_list([{**r, "prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows])
    args = grpo.trl_args(spec, False, max_completion_length=spec.max_turns * spec.max_new_tokens,
                         max_tool_calling_iterations=spec.max_turns - 1)
    clock = grpo.trl_step_clock()
    trainer = GRPOTrainer(model=model_dir, args=args, train_dataset=dataset, processing_class=tokenizer,
                          environment_factory=MultiplyEnv, callbacks=[clock])
    trainer.train()
    raw = grpo.trl_result(clock, spec, started, ("tools/call_frequency",))
    raw["series"] = {"tool_calls_per_episode": raw["series"]["tools/call_frequency"]}  # TRL logs no turn count
    result_path.write_text(json.dumps(raw))


TEACH_SEED = 1000  # the teaching questions' seed: other questions than the benchmark's (seed 0)


def call_text(a: int, b: int) -> str:
    """Returns the Hermes tool call of ``multiply(a, b)`` as the ``smollm2-tools`` template renders assistant calls."""
    return "<tool_call>\n" + json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}}) + "\n</tool_call>"


def child_teach(model: str, steps: int, dest: Path) -> None:
    """Teaches ``model`` the tool-call format with TRL's SFTTrainer (``steps`` steps of 8 examples, lr 5e-5, loss on
    the completion only) and saves it to ``dest`` (safetensors, float32, with the base tokenizer)."""
    import os

    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from rlray.envs.tools import tool_schemas
    from rlray.models import load_tokenizer, resolve_model_path

    sys.path.insert(0, str(ENV_FILE.parent))
    import multiply_env

    model_dir = resolve_model_path(model)
    tokenizer = load_tokenizer(model_dir, chat_template="smollm2-tools")
    env = multiply_env.MultiplyEnv()
    tools = tool_schemas([env.multiply])
    examples = []
    for row in multiply_env.rows(steps * 8, seed=TEACH_SEED):
        content = row["prompt"] + env.reset(**row)  # what both runs show the model
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": content}], tools=tools, tokenize=False,
                                               add_generation_prompt=True)
        examples.append({"prompt": prompt, "completion": call_text(row["a"], row["b"]) + tokenizer.eos_token})
    args = SFTConfig(output_dir=str(dest / "sft-out"), per_device_train_batch_size=8, max_steps=steps,
                     learning_rate=5e-5, lr_scheduler_type="constant", warmup_steps=0, logging_steps=10,
                     save_strategy="no", report_to="none", use_cpu=benchlib.device() == "cpu", bf16=False,
                     model_init_kwargs={"dtype": "float32"}, disable_tqdm=True, seed=0, max_length=1024)
    trainer = SFTTrainer(model=model_dir, args=args, train_dataset=Dataset.from_list(examples),
                         processing_class=tokenizer)
    trainer.train()
    trainer.model.save_pretrained(str(dest), safe_serialization=True)
    load_tokenizer(model_dir).save_pretrained(str(dest))  # the base template; the runs choose smollm2-tools


def teach(model: str, steps: int, root: Path, timeout_s: float) -> str:
    """Returns the folder of ``model`` taught the call format (``child_teach`` in a child process), or ``model``
    itself when ``steps`` is 0.

    Raises:
        RuntimeError: the teaching child failed (the message names its log)."""
    if steps <= 0:
        return model
    dest = root / "taught-model"
    result = root / "teach.result.json"
    raw = benchlib.run_script_child(__file__, ["teach", model, steps, dest, result], result_path=result,
                                    log_path=root / "teach.log", timeout_s=timeout_s, label=f"teach ({steps} SFT steps)")
    if "error" in raw:
        raise RuntimeError(f"teaching {model} the tool-call format failed ({raw['error']}); log {root / 'teach.log'}")
    return str(dest)


def run_child_main(argv: list[str]) -> None:
    """Entry point of a child process: ``--child VARIANT SPEC_JSON RESULT_JSON`` or ``--child teach MODEL STEPS DEST
    RESULT_JSON``."""
    if argv[0] == "teach":
        _, model, steps, dest, result_json = argv
        started = time.time()
        child_teach(model, int(steps), Path(dest))
        Path(result_json).write_text(json.dumps({"teach_s": time.time() - started}))
        return
    variant, spec_json, result_json = argv
    spec = EnvRunSpec(**json.loads(Path(spec_json).read_text()))
    spec.overrides = tuple(spec.overrides)
    if variant == "trl":
        child_trl(spec, Path(result_json))
    else:
        child_rlray(spec, Path(result_json))


HEADERS = ["run", "median step (s)", "generated tok/s", "tool calls / episode", "turns / episode", "reward",
           "peak PSS (GiB)", "step time / TRL", "gen tok/s / TRL", "PSS / TRL"]


def mean_after_warmup(values: list[float | None] | None, warmup: int) -> float | None:
    """Returns the mean of ``values`` over steps warmup+1..N (None entries and a missing list give None)."""
    kept = [v for v in (values or [])[warmup:] if v is not None]
    return sum(kept) / len(kept) if kept else None


def table(model: str, result: dict[str, Any]) -> str:
    """Returns the markdown table of the runs (a failed run shows its error) and the per-process memory table."""
    rows = []
    warmup = result["spec"]["warmup"]
    for name, r in result["runs"].items():
        if "error" in r:
            rows.append([name, f"FAILED: {r['error']}", *["n/a"] * (len(HEADERS) - 2)])
            continue
        rows.append([name, r["median_step_s"], benchlib.fmt(r["generated_tokens_per_s"], 1),
                     benchlib.fmt(mean_after_warmup(r.get("series", {}).get("tool_calls_per_episode"), warmup)),
                     benchlib.fmt(mean_after_warmup(r.get("series", {}).get("turns_per_episode"), warmup)),
                     benchlib.fmt(mean_after_warmup(r.get("reward_mean"), warmup)), r["peak_pss_gib"],
                     r["step_time_vs_trl"], r["generated_tokens_per_s_vs_trl"], r["peak_pss_vs_trl"]])
    s = result["spec"]
    head = (f"**{model}**, multi-turn tool calling (`benchmarks/multiply_env.py`): {s['prompts_per_step']} prompts x "
            f"{s['samples_per_prompt']} samples, up to {s['max_turns']} turns of {s['max_new_tokens']} new tokens, "
            f"{s['steps']} steps (first {s['warmup']} not counted), "
            f"{'bf16 autocast' if s.get('dtype') == 'bfloat16' else 'float32'}")
    return "\n".join([head, "", benchlib.markdown_table(HEADERS, rows), *grpo.learner_lines(result), "",
                      "Memory per process at each run's peak:", "", grpo.memory_table(result)])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the comparison; prints the tables and writes bench_results/env_vs_trl.json; returns the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="seconds-scale sizes, tiny-random only")
    parser.add_argument("--model", default=None, help="model (default: smollm2-135m-instruct; --quick: tiny-random)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, help="runs")
    parser.add_argument("--steps", type=int, help="steps per run (overrides the size table)")
    parser.add_argument("--warmup", type=int, help="steps that do not count (at least 1)")
    parser.add_argument("--max-turns", type=int, default=3, help="assistant turns per episode (TRL: tool calls + 1)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="limit per run")
    parser.add_argument("--keep", action="store_true", help="keep the runs' folders (logs, MLflow store)")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                        help="precision of every run (auto: what rlray's model.dtype=auto picks on this machine)")
    parser.add_argument("--teach-steps", type=int, default=None,
                        help="SFT steps teaching the tool-call format first (default 10; --quick: 0)")
    parser.add_argument("--overrides", nargs="+", default=[], metavar="KEY=VALUE",
                        help="extra dotted config overrides of the rlray run (last wins)")
    args = parser.parse_args(argv)
    sizes = SIZES["quick" if args.quick else "default"]
    model = args.model or next(iter(sizes))
    size = dict(sizes.get(model, next(iter(sizes.values()))))
    size.update({k: v for k, v in (("steps", args.steps), ("warmup", args.warmup)) if v is not None})
    size["warmup"] = max(1, min(size["warmup"], size["steps"] - 1))
    teach_steps = args.teach_steps if args.teach_steps is not None else (0 if args.quick else 10)
    root = Path(tempfile.mkdtemp(prefix="bench-env-teach-"))
    taught = teach(model, teach_steps, root, args.timeout_s)
    spec = EnvRunSpec(model=taught, dtype=grpo.run_dtype(args.dtype), overrides=tuple(args.overrides),
                      max_turns=args.max_turns, **size)
    print(f"{model}{f' (taught the call format, {teach_steps} SFT steps)' if teach_steps else ''}: "
          f"{', '.join(args.variants)}", flush=True)
    result = grpo.compare(model, spec, list(args.variants), args.timeout_s, args.keep, write_data=write_env_rows,
                          script=__file__)
    grpo.add_ratios(result["runs"])
    print("\n" + table(model, result) + "\n", flush=True)
    if not args.keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    path = benchlib.write_results("env_vs_trl", {"model": model, "teach_steps": teach_steps, **result})
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        run_child_main(sys.argv[2:])
    else:
        main()
