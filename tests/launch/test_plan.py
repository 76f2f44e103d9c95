"""Tests for the capacity planner (rlray.launch.plan, plan_roles, plan_report): the per-role arithmetic by hand, the
layout it assumes, the 1.5B and 7B plans on 8 x 80 GiB, the preflight's fit check, and the predictions against the
measured peak memory of real learner steps on the CPU (tests/launch/measure_peak.py, in subprocesses).

FSDP2 is checked by its arithmetic (``test_fsdp_rank_shards_the_model_state_and_gathers_a_root_and_two_layers``) and
measured on the CPU with two ranks over gloo, as DDP is."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlray.cli import main
from rlray.config import config_from_dict, load_config
from rlray.launch import plan as planner
from rlray.launch.placement import PlacementError
from rlray.launch.plan import Hardware, Plan, assumed_layout, check_fit, plan_run
from rlray.launch.plan_report import changes, format_plan
from rlray.launch.plan_roles import (
    CPU_PROCESS_GIB,
    CPU_RUNTIME_GIB,
    CUDA_RUNTIME_GIB,
    Models,
    context_tokens,
    microbatch,
)
from rlray.models.memory import GIB, ModelShape
from rlray.plan import resolve_plan

HAND = ModelShape(hidden_size=8, intermediate_size=12, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                  vocab_size=16, tied_embeddings=True)  # fmt: skip
# tests/models/test_memory.py counts it: 1128 parameters, 496 per layer, root unit 136, linear 1088
P = 1128
GPU8 = Hardware(8, 1, 80.0)
SMOLLM2_CONFIG = "configs/grpo_gsm8k_smollm2.yaml"


def _terms(role) -> dict[str, float]:
    """Returns {term name up to its first ':' or ' (' : bytes} of a role's counted terms."""
    return {t.name.split(":")[0].split(" (")[0]: t.gib * GIB for t in role.terms if t.phase != "shown"}


def _hand_plan(*overrides: str, hardware: Hardware | None = GPU8) -> Plan:
    cfg = config_from_dict({}, ["model.dtype=bfloat16", "learner.prompts_per_step=8", "data.max_prompt_tokens=8",
                                "rollout.max_new_tokens=2", "learner.sequences_per_microbatch=2", *overrides])
    return plan_run(resolve_plan(cfg), hardware, Models(HAND, "hand"))


def test_ddp_rank_holds_the_whole_state_buckets_and_bf16_copies():
    plan = _hand_plan("resources.learner.num_workers=2", "resources.learner.gpus=1", "resources.rollout.gpus=1",
                      "algo.kl_coef=0", "guard.kl_threshold=null")
    learner = plan.roles[0]
    got = _terms(learner)
    assert got["weights"] == pytest.approx(4 * P) and got["gradients"] == pytest.approx(4 * P)
    assert got["optimizer state"] == pytest.approx(8 * P) and got["DDP all-reduce buckets"] == pytest.approx(4 * P)
    assert got["AdamW step"] == pytest.approx(4 * P)  # foreach AdamW's sqrt(v) temporaries, on the GPU
    assert got["bf16 copies of the linear weights"] == pytest.approx(2 * 1088)
    # 2 sequences x (8 + 2) tokens = 20 tokens; bf16 (c = 2): 2 layers x 344 + the final norm's 64 per token
    assert got["activations"] == pytest.approx(20 * (2 * 344 + 64))
    assert got["logits"] == pytest.approx(2 * 3 * 16 * 8)  # 2 x (2 + 1) positions x V 16 x 8 bytes
    static = 4 * P + 4 * P + 8 * P + 4 * P
    update = 2 * 1088 + 20 * (2 * 344 + 64) + 2 * 3 * 16 * 8  # 17,984 bytes, more than the step's 4 * P = 4,512
    assert learner.total_gib == pytest.approx((static + update) / GIB + CUDA_RUNTIME_GIB)
    assert learner.budget_gib == pytest.approx(0.9 * 80) and learner.fits


def test_fsdp_rank_shards_the_model_state_and_gathers_a_root_and_two_layers():
    plan = _hand_plan("resources.learner.num_workers=4", "resources.learner.gpus=1", "resources.learner.strategy=fsdp",
                      "resources.rollout.gpus=1")
    got = _terms(plan.roles[0])
    assert got["weights"] == pytest.approx(4 * P / 4) and got["gradients"] == pytest.approx(4 * P / 4)
    assert got["optimizer state"] == pytest.approx(8 * P / 4) and got["AdamW step"] == pytest.approx(4 * P / 4)
    # root unit 136 and 2 layers of 496 in bf16, root and 1 layer of gradients in float32 before the reduce-scatter
    assert got["FSDP gathered"] == pytest.approx((136 + 2 * 496) * 2 + (136 + 496) * 4)
    assert "DDP all-reduce buckets" not in got and "bf16 copies of the linear weights" not in got
    # the reference is sharded too (rlray.learner.parallel.FSDP2.frozen): 1/4 of its parameters, all in bf16
    assert got["reference"] == pytest.approx(2 * P / 4)
    assert "reference: a frozen copy sharded over the 4 learner ranks (algo.kl_coef=" in format_plan(plan)


def test_lora_trains_only_the_adapters_and_one_rank_has_no_buckets():
    plan = _hand_plan("model.lora.rank=2", "resources.learner.gpus=1", "resources.rollout.gpus=1")
    got = _terms(plan.roles[0])
    assert got["weights"] == pytest.approx(4 * P) and got["LoRA adapters"] == pytest.approx(4 * 464)
    assert got["gradients"] == pytest.approx(4 * 464) and got["optimizer state"] == pytest.approx(8 * 464)
    assert "DDP all-reduce buckets" not in got and "reference" not in got  # LoRA's reference: adapters off


def test_checkpointing_counts_the_layer_inputs_and_shows_the_other_figure():
    terms = _hand_plan("model.gradient_checkpointing=true", "resources.learner.gpus=1").roles[0].terms
    acts = {t.phase: t.gib * GIB for t in terms if "activations" in t.name}
    # counted: each layer's float32 input 4h = 32, one layer recomputed, the final norm; shown: all layers
    assert acts == {"update": pytest.approx(20 * (2 * 32 + 344 + 64)), "shown": pytest.approx(20 * (2 * 344 + 64))}


def test_rollout_engine_kv_cache_and_budget():
    plan = _hand_plan("resources.learner.gpus=1", "resources.rollout.gpus=1", "resources.rollout.num_workers=2",
                      "eval.num_problems=0")
    rollout = plan.roles[1]
    got = _terms(rollout)
    assert got["weights"] == pytest.approx(2 * P)  # bf16
    # 8 prompts x 4 samples over 2 engines = 16 sequences of 8 + 2 tokens (eval off)...
    assert context_tokens(plan.run) == 8 + 2
    assert got["KV cache"] == pytest.approx(16 * 16 * 32)  # ... in one 16-token block each, 32 bytes per token
    assert rollout.budget_gib == pytest.approx(0.5 * 80) and rollout.fits


def test_assumed_layout_splits_the_gpus_and_a_gpu_config_is_kept():
    cfg = config_from_dict({}, [])
    laid, overrides = assumed_layout(resolve_plan(cfg), GPU8)
    assert overrides == ("resources.learner.num_workers=4", "resources.learner.gpus=1",
                         "resources.rollout.num_workers=4", "resources.rollout.gpus=1")
    assert (laid.settings.resources.learner.num_workers, laid.settings.resources.rollout.num_workers) == (4, 4)
    # 6 GPUs: 3 engines; 3 learner ranks do not divide 8 prompts, 2 do
    assert assumed_layout(resolve_plan(cfg), Hardware(6, 1, 80.0))[1][0] == "resources.learner.num_workers=2"
    one = assumed_layout(resolve_plan(cfg), Hardware(1, 1, 80.0))[0]
    assert one.settings.resources.colocate and one.settings.resources.learner.gpus == 0.5
    offline = config_from_dict({}, ["algo.name=dpo", "offline.pairs_per_step=8", "offline.pairs_per_microbatch=1"])
    assert assumed_layout(resolve_plan(offline), GPU8)[1] == ("resources.learner.num_workers=8", "resources.learner.gpus=1")
    gpu_cfg = config_from_dict({}, ["resources.learner.gpus=1"])
    gpu_run, run = resolve_plan(gpu_cfg), resolve_plan(cfg)
    assert assumed_layout(gpu_run, GPU8) == (gpu_run, ())
    assert assumed_layout(run, None) == (run, ())


def test_microbatch_tokens_and_context_match_the_driver():
    from rlray.launch.driver import max_model_len

    for overrides in ([], ["eval.max_new_tokens=400"], ["env.environments={a: 'x.py:Env'}", "env.max_turns=3"]):
        cfg = config_from_dict({}, overrides)
        assert context_tokens(resolve_plan(cfg)) == max_model_len(cfg)
    mb = microbatch(resolve_plan(config_from_dict({}, [])))  # defaults: 8 sequences x (256 + 160)
    assert (mb.tokens, mb.logit_positions) == (8 * 416, 8 * 161)
    off = microbatch(resolve_plan(config_from_dict({}, ["algo.name=dpo"])))
    assert (off.sequences, off.prompt_tokens, off.response_tokens) == (8, 256, 128)
    budget = microbatch(resolve_plan(config_from_dict({}, ["learner.tokens_per_microbatch=1000"])))
    assert budget.tokens == 3 * 416 and "tokens_per_microbatch=1,000" in budget.source  # ceil(1000 / 416) rows


def test_cpu_rollout_kv_cache_is_the_actors_size(tiny_model_path):
    from rlray.launch.actors import auto_kv_cache_gib
    from rlray.launch.driver import max_model_len

    cfg = config_from_dict({}, ["model.dtype=float32", "resources.rollout.num_workers=2"])
    rollout = plan_run(resolve_plan(cfg)).roles[1]
    kv = next(t.gib for t in rollout.terms if t.name.startswith("KV cache"))
    assert kv == auto_kv_cache_gib(resolve_plan(cfg), tiny_model_path, max_model_len(cfg))


def _fixture_plan(name: str) -> Plan:
    return plan_run(resolve_plan(load_config(SMOLLM2_CONFIG, [f"model.path=configs/models/{name}"])), GPU8)


def test_the_1p5b_plan_fits_8_x_80_gib():
    plan = _fixture_plan("qwen2.5-1.5b")
    assert plan.fits and plan.dtype == "bfloat16" and plan.assumed[0] == "resources.learner.num_workers=4"
    learner = plan.roles[0]
    assert _terms(learner)["weights"] == pytest.approx(4 * 1_543_714_304)
    assert 40 < learner.total_gib < 60  # 48.2 GiB of 72


def test_the_7b_plan_does_not_fit_ddp_and_names_what_does():
    plan = _fixture_plan("qwen2.5-7b")
    learner, rollout = plan.roles[:2]
    assert not plan.fits and not learner.fits and rollout.fits
    assert _terms(rollout)["weights"] == pytest.approx(2 * 7_615_616_512)  # 7.6B x 2 bytes in bf16, one GPU each
    assert _terms(learner)["optimizer state"] == pytest.approx(8 * 7_615_616_512)
    found = {c.overrides: c for c in changes(plan, learner)}
    assert found[("model.lora.rank=16",)].fits
    fsdp = found[("resources.learner.strategy=fsdp",)]
    assert fsdp.fits and fsdp.total_gib < learner.total_gib / 2  # a 1/4 shard of everything, the reference too
    text = format_plan(plan)
    assert "layout assumed (the config asks for no GPUs); to run it, add: resources.learner.num_workers=4" in text
    assert "to make the learner rank fit: each change alone, then the changes together" in text
    together = found[("model.gradient_checkpointing=true", "resources.learner.strategy=fsdp")]
    assert together.fits and together.total_gib < 72  # full fine-tuning fits too
    assert "checkpointing on: not counted" in text and text.endswith("DOES NOT FIT")


def test_a_70b_rollout_engine_needs_tensor_parallelism_and_more_gpus():
    plan = _fixture_plan("llama-3.1-70b")
    rollout = plan.roles[1]
    assert _terms(rollout)["weights"] == pytest.approx(2 * 70_553_706_496) and not rollout.fits  # 131 GiB of 40
    found = {c.overrides: c for c in changes(plan, rollout)}
    tp2, tp4 = found[("resources.rollout.tensor_parallel_size=2",)], found[("resources.rollout.tensor_parallel_size=4",)]
    assert not tp2.fits and tp4.fits and tp4.note == "needs more GPUs"  # 4 engines x 4 GPUs + 4 learner ranks > 8
    assert ("rollout.gpu_memory_utilization=0.9",) in found


def test_cli_plan_exit_codes(capsys, monkeypatch):
    assert main(["plan", SMOLLM2_CONFIG, "model.path=configs/models/qwen2.5-1.5b", "--gpus", "8",
                 "--gpu-memory-gib", "80"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("fits")
    assert main(["plan", SMOLLM2_CONFIG, "model.path=configs/models/qwen2.5-7b", "--gpus", "8",
                 "--gpu-memory-gib", "80"]) == 1
    monkeypatch.setattr(planner.shutil, "which", lambda name: None)  # no nvidia-smi: no GPU size known
    assert planner.local_gpu_memory_gib() is None
    assert main(["plan", SMOLLM2_CONFIG, "--gpus", "8"]) == 2
    assert "give the GPUs' memory (--gpu-memory-gib M)" in capsys.readouterr().err
    assert main(["plan", SMOLLM2_CONFIG, "model.path=/nonexistent", "--gpus", "1", "--gpu-memory-gib", "80"]) == 2


def test_preflight_fit_check_warns_over_the_cap_and_fails_beyond_the_tolerance(tiny_model_path):
    base = ["model.dtype=float32"]
    assert check_fit(resolve_plan(config_from_dict({}, base))) == []  # CPU without guard.memory_cap_gib: not checked
    need = plan_run(resolve_plan(config_from_dict({}, base))).roles[0].total_gib
    assert check_fit(resolve_plan(config_from_dict({}, [*base, f"guard.memory_cap_gib={need * 1.01}"]))) == []
    warned = check_fit(resolve_plan(config_from_dict({}, [*base, f"guard.memory_cap_gib={need / 1.1}"])))
    assert len(warned) == 1 and warned[0].startswith(f"learner rank (1 rank x CPU) needs {need:.2f} GiB, over its")
    with pytest.raises(PlacementError, match=r"learner rank .* \(guard.memory_cap_gib\) \(more than the planner's 25%"):
        check_fit(resolve_plan(config_from_dict({}, [*base, f"guard.memory_cap_gib={need / 1.5}"])))


# --------------------------------------------------------------------------------------------
# Predicted against measured (CPU, float32, subprocesses)
# --------------------------------------------------------------------------------------------
TINY = ["model.path=tiny-random", "model.dtype=float32", "learner.sequences_per_microbatch=4",
        "learner.sequences_per_minibatch=16", "learner.prompts_per_step=4", "rollout.samples_per_prompt=4",
        "data.max_prompt_tokens=64", "rollout.max_new_tokens=64"]  # fmt: skip
SMOLLM2 = ["model.path=smollm2-135m-instruct", "model.dtype=float32", "learner.sequences_per_microbatch=2",
           "learner.sequences_per_minibatch=4", "learner.prompts_per_step=2", "rollout.samples_per_prompt=2",
           "data.max_prompt_tokens=128", "rollout.max_new_tokens=64"]  # fmt: skip


def _measure(repo_root, overrides: list[str], world: int = 1, tmp_path=None) -> list[dict]:
    """Runs tests/launch/measure_peak.py (``world`` ranks over gloo); returns each rank's {baseline, peak} in bytes."""
    script = str(repo_root / "tests" / "launch" / "measure_peak.py")
    env_args = [] if world == 1 else ["--world", str(world), "--store", str(tmp_path / "store")]
    procs = [subprocess.Popen([sys.executable, script, *env_args, *(["--rank", str(r)] if world > 1 else []), *overrides],
                              stdout=subprocess.PIPE, text=True, cwd=repo_root) for r in range(world)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


def _model_part(overrides: list[str], world: int = 1) -> float:
    """Returns the planner's learner rank without the process's import baseline (GiB)."""
    cfg = config_from_dict({}, [*overrides, f"resources.learner.num_workers={world}"])
    return plan_run(resolve_plan(cfg)).roles[0].total_gib - CPU_PROCESS_GIB


@pytest.mark.parametrize(("world", "strategy"), [(1, "ddp"), (2, "ddp"), (2, "fsdp")])
def test_tiny_random_model_part_within_25_percent(repo_root, tmp_path, tiny_model_path, world, strategy):
    # tiny-random's tensors (~0.25 GiB: 6.6M parameters, 65 x 49,152 logits per sequence) are smaller than the CPU
    # process's own 0.56 GiB, so the part that depends on the model is compared: peak minus the baseline after the
    # imports, against the planner's total minus CPU_PROCESS_GIB (its allocator slack, CPU_ALLOCATOR_GIB, stays in)
    overrides = [*TINY, f"resources.learner.strategy={strategy}"]
    for m in _measure(repo_root, overrides, world, tmp_path):
        measured = (m["peak"] - m["baseline"]) / GIB
        assert _model_part(overrides, world) == pytest.approx(measured, rel=0.25)


@pytest.mark.parametrize("extra", [pytest.param([], id="full"), pytest.param(["model.gradient_checkpointing=true"],
                                                                    id="checkpointing", marks=pytest.mark.slow)])
def test_smollm2_total_within_25_percent(repo_root, extra):
    # SmolLM2-135M in float32: 2.0 GiB of weights, gradients and AdamW state, 0.5 GiB reference (the KL guard),
    # 0.54 GiB of activations without checkpointing; the real total, baseline included
    (m,) = _measure(repo_root, SMOLLM2 + extra)
    predicted = plan_run(resolve_plan(config_from_dict({}, SMOLLM2 + extra))).roles[0].total_gib
    assert predicted == pytest.approx(m["peak"] / GIB, rel=0.25)
    assert predicted - CPU_RUNTIME_GIB > 2.5  # the model's own part dominates the comparison


@pytest.mark.slow  # 85 s; tiny-random's FSDP ranks are measured in make test
def test_smollm2_fsdp_rank_within_25_percent_and_below_ddp(repo_root, tmp_path):
    # two ranks over gloo, each with half of the 2.0 GiB of weights, gradients and AdamW state and half of the
    # reference, plus the gathered root unit (the 28M-parameter tied embedding) and layers
    overrides = [*SMOLLM2, "resources.learner.num_workers=2"]
    fsdp = [*overrides, "resources.learner.strategy=fsdp"]
    predicted = plan_run(resolve_plan(config_from_dict({}, fsdp))).roles[0].total_gib
    for m in _measure(repo_root, fsdp, 2, tmp_path):
        assert predicted == pytest.approx(m["peak"] / GIB, rel=0.25)
    assert predicted < plan_run(resolve_plan(config_from_dict({}, overrides))).roles[0].total_gib - 1.0  # DDP's rank, same config
