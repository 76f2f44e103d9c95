"""The CPU-runnable parts of benchmarks/gpu_check.py and its FSDP2 rows, benchmarks/gpu_fsdp.py (the script itself
needs a CUDA device)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_learner_step_is_independent_of_microbatch_and_checkpointing(gpu_check, tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).train()
    batch = gpu_check.synthetic_batch(model.config.vocab_size, rows=6, prompt_tokens=5, response_tokens=7)
    full = gpu_check.learner_step(model, batch, microbatch=6, device="cpu", bf16=False)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    gpu_check.set_checkpointing(model, True)
    split = gpu_check.learner_step(model, batch, microbatch=2, device="cpu", bf16=False)
    gpu_check.set_checkpointing(model, False)
    # token-mean over the whole batch's tokens: micro-batch losses add up to the full-batch loss
    assert split["loss"] == pytest.approx(full["loss"], abs=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], atol=1e-6, rtol=1e-5)
    assert full["peak_gib"] == 0.0 and full["seconds"] > 0


def test_fallback_halves_the_microbatch_and_turns_checkpointing_on(gpu_check):
    calls = []

    def step(mb: int, ckpt: bool) -> dict:
        calls.append((mb, ckpt))
        if mb > 4 or not ckpt:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return {"loss": 1.0}

    result, attempts = gpu_check.step_with_fallback(step, 16)
    assert result == {"loss": 1.0}
    assert calls == [(16, False), (8, True), (4, True)]
    assert attempts == ["mb=16 ckpt=False: OOM", "mb=8 ckpt=True: OOM", "mb=4 ckpt=True: ok"]

    def never(mb: int, ckpt: bool) -> dict:
        raise torch.cuda.OutOfMemoryError("injected")

    with pytest.raises(torch.cuda.OutOfMemoryError, match="still out of memory after the fallback: mb=4 ckpt=False: OOM"):
        gpu_check.step_with_fallback(never, 4)


def test_algos_parity_row_and_table(gpu_check):
    rows = gpu_check.check_algos_parity("cpu", "cpu")
    (name, status, detail), = rows
    assert (name, status) == ("rlray.algos parity cpu vs cpu", "ok")
    n_outputs = int(detail.split()[0])
    assert n_outputs >= 20 and "max |diff| 0.00e+00" in detail
    assert gpu_check.markdown_table(rows).splitlines()[:2] == ["| check | status | detail |", "|---|---|---|"]


def test_shared_prompt_row_passes_on_cpu_in_float32(gpu_check, tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).train()
    rows = gpu_check.check_shared_prompts(model, "cpu", model.config.vocab_size, groups=2, samples=3, prompt_tokens=9,
                                          response_tokens=5, bf16=False)
    assert [(name, status) for name, status, _ in rows] == [("shared-prompt forward+backward", "ok")]
    assert "2x3, 9+5 tokens" in rows[0][2]


def test_frozen_bf16_row_passes_on_cpu_and_counts_the_saved_bytes(gpu_check, tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).train()
    rows = gpu_check.check_frozen_bf16(model, "cpu", model.config.vocab_size, rows=2, tokens=9)
    assert [(name, status) for name, status, _ in rows] == [("frozen reference in bf16 linear weights", "ok")]
    cfg = model.config  # 2 bytes saved per value of every untied linear weight (lm_head is tied)
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    saved = 2 * cfg.num_hidden_layers * (2 * h * h + 2 * h * kv + 3 * h * cfg.intermediate_size)
    assert f"bit-identical under bf16 autocast (2x9 tokens); {saved / 2**20:.2f} MiB saved" in rows[0][2]
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())  # the model is untouched


def test_planner_row_runs_a_real_learner_step_and_reports_the_planner_figure(gpu_check, tiny_model_path):
    from rlray.config import config_from_dict
    from rlray.launch.plan import plan_run
    from rlray.launch.plan_roles import CPU_PROCESS_GIB
    from rlray.plan import resolve_plan

    # In a fresh process: on the CPU the measure is the resident peak (VmHWM) less the resident size before, and a
    # process that already ran other tests reuses freed memory, so its resident size barely grows
    script = ("import json, sys; sys.path.insert(0, 'benchmarks'); import gpu_check; print(json.dumps("
              f"gpu_check.check_planner({tiny_model_path!r}, 'cpu', sequences=2, prompt_tokens=16, "
              "response_tokens=8, bf16=False)))")
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [tuple(r) for r in json.loads(out.stdout.strip().splitlines()[-1])]
    (name, status, detail), = rows
    assert name == "planner vs measured learner step, checkpointing off" and status in ("ok", "FAILED")
    cfg = config_from_dict({}, [f"model.path={tiny_model_path}", "model.dtype=float32", "learner.sequences_per_microbatch=2",
                                "learner.sequences_per_minibatch=4", "learner.prompts_per_step=2",
                                "rollout.samples_per_prompt=2", "data.max_prompt_tokens=16", "rollout.max_new_tokens=8"])
    predicted = plan_run(resolve_plan(cfg)).roles[0].total_gib - CPU_PROCESS_GIB  # the same config, planned here
    assert detail.startswith(f"predicted {predicted:.2f} GiB, measured ")
    measured = float(detail.split("measured ")[1].split(" GiB")[0])
    assert measured > 0.05  # at least the weights, gradients and AdamW state of 6.6M float32 parameters (0.1 GiB)
    assert detail.endswith("2 x (16 + 8) tokens per micro-batch, 2 micro-batches")


def test_packed_rows_row_on_the_cpu(gpu_check, tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).train()
    (row,) = gpu_check.check_packed_rows(model, "cpu", model.config.vocab_size, groups=2, samples=3, prompt_tokens=9,
                                         response_tokens=12, bf16=False)
    assert row[0].startswith("packed rows") and row[1] == "ok", row
    assert "shared" in row[2] and "grad rel diff" in row[2]


def test_adapter_sync_row_passes_on_cpu_and_counts_the_shipped_bytes(gpu_check, tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).train()
    rows = gpu_check.check_adapter_sync(model, "cpu", model.config.vocab_size, rank=8, rows=2, tokens=9)
    assert [(name, status) for name, status, _ in rows] == [("adapter-only sync (LoRA r8 all-linear)", "ok")]
    cfg = model.config  # bf16 adapter: rank x (in + out) per linear layer, 2 bytes each
    h, kv, inter = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    adapter = 2 * 8 * cfg.num_hidden_layers * (2 * (h + h) + 2 * (h + kv) + 3 * (h + inter))
    assert rows[0][2].startswith(f"ships {adapter / 2**20:.2f} MiB in ") and "(float32, 2x9 tokens;" in rows[0][2]
    assert all(p.dtype == torch.float32 for p in model.parameters()) and not any("lora" in n for n, _ in model.named_parameters())


def test_fsdp_rows_pass_on_the_cpu_over_gloo(tiny_model_path):
    # the same two rank processes a GPU gets, over gloo: FSDP2 float32 against one unsharded learner, bf16 mixed
    # precision with its sharded reference
    spec = importlib.util.spec_from_file_location("gpu_fsdp", REPO / "benchmarks" / "gpu_fsdp.py")
    gpu_fsdp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_fsdp)
    rows = gpu_fsdp.check_fsdp(tiny_model_path, "cpu", world=2, rows_per_rank=2, prompt_tokens=8, response_tokens=8)
    assert [(name, status) for name, status, _ in rows] == [
        ("FSDP2 float32 (gloo, 2 ranks) vs one unsharded learner", "ok"), ("FSDP2 bf16 mixed precision (gloo, 2 ranks)", "ok")]
    assert "bit-identical" in rows[1][2]
