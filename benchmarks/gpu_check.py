"""GPU check on one CUDA device, with torch and transformers only (plus rlray.algos, which is pure torch).

    python benchmarks/gpu_check.py [--model HuggingFaceTB/SmolLM2-135M-Instruct] [--device cuda]

Checks, one table row each:
  1. a bf16-autocast learner step (GRPO's clipped policy loss from rlray.algos) on SmolLM2, with
     gradient checkpointing off and on: seconds and peak memory;
  2. the memory-fraction cap (torch.cuda.set_per_process_memory_fraction): an allocation above the
     cap fails, one below it succeeds;
  3. a forced CUDA out-of-memory error in a learner step under a tight cap, recovered by the
     fallback rlray uses (halve the micro-batch, turn gradient checkpointing on, retry);
  4. CPU/CUDA parity of rlray.algos outputs on the same random tensors (max |cpu - cuda|);
  5. the learner's shared-prompt forward (rlray.learner.logprobs: a group's prompt computed once) against
     one pass per row on the device: max |logprob difference|, relative gradient difference, and the
     seconds of a forward + backward each way (groups of 4 samples per prompt);
  6. the frozen reference with its linear weights stored in bf16 (rlray.learner.logprobs.store_frozen_for_autocast)
     against the float32 copy under bf16 autocast on the device: logits bit-identical, and the bytes saved;
  7. the capacity planner (rlray.launch.plan) against a real PolicyLearner step on the device, gradient
     checkpointing off and on: the predicted learner-rank tensors against torch.cuda.max_memory_allocated;
  8. the adapter-only weight sync (rollout.lora_sync=adapter) of a LoRA policy (rank 16, every linear
     layer) on the device: the bytes and export seconds of what a sync ships (bf16: the adapter alone, against the
     merged model), and the adapter applied over a base copy (rlray's hf rollout backend, peft) against the merged
     weights, in float32: max |logprob difference| (needs peft);
  9. the learner's packed rows (rlray.learner.packing: no padding, each group's prompt once, attention per segment
     through torch SDPA) against the padded, unshared rows on the device: max |logprob difference|, relative
     gradient difference, and the seconds of a forward + backward each way (groups with ragged responses);
 10. FSDP2 over NCCL, one process per visible GPU (benchmarks/gpu_fsdp.py; a world-1 fully_shard with one GPU):
     float32 steps and gathered weights against one unsharded learner, and a bf16 mixed-precision step with its
     sharded reference.

The model is a local Hugging Face folder or a hub id (downloaded by transformers). Every function
also runs on the CPU (``--device cpu``; rows 2 and 3 need CUDA), which is how tests/benchmarks/ checks it.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

try:
    from rlray import algos
except ImportError:  # run from a checkout without rlray installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from rlray import algos
if str(Path(__file__).resolve().parent) not in sys.path:  # this folder's modules, also when loaded from a file
    sys.path.append(str(Path(__file__).resolve().parent))

from gpu_fsdp import check_fsdp  # noqa: E402 - the sys.path lines above
from gpu_probes import GIB, allocated_bytes, full_length_batch, peak_bytes, reset_peak, sync  # noqa: E402


# --------------------------------------------------------------------------------------------
# A learner step with only torch + transformers + rlray.algos
# --------------------------------------------------------------------------------------------
def synthetic_batch(vocab: int, rows: int, prompt_tokens: int, response_tokens: int, seed: int = 0) -> dict:
    """Returns a GRPO-shaped batch: input_ids [B, P+T] int64, response_mask [B, T] bool, advantages [B, T] float32."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, vocab - 1, (rows, prompt_tokens + response_tokens), generator=g)
    lengths = torch.randint(response_tokens // 2, response_tokens + 1, (rows,), generator=g)
    mask = torch.arange(response_tokens)[None, :] < lengths[:, None]
    adv = torch.randn(rows, generator=g)[:, None].expand(rows, response_tokens) * mask
    return {"input_ids": ids, "response_mask": mask, "advantages": adv.float().contiguous()}


def learner_step(
    model: torch.nn.Module,
    batch: dict,
    *,
    microbatch: int,
    device: str,
    bf16: bool = True,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict:
    """Runs one learner step: forward/backward over the batch in micro-batches (gradient accumulation),
    then ``optimizer.step()`` when one is given.

    Returns {"loss", "seconds", "peak_gib"} (peak_gib is 0.0 on the CPU). The loss is GRPO's
    token-mean clipped surrogate (rlray.algos.ppo_clip_loss + aggregate_loss) with on-policy
    old logprobs, normalised by the whole batch's token count, so it does not depend on the
    micro-batch size.
    """
    t_resp = batch["response_mask"].shape[1]
    total_tokens = float(batch["response_mask"].sum())
    model.zero_grad(set_to_none=True)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss_sum = 0.0
    autocast = torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    for s in range(0, batch["input_ids"].shape[0], microbatch):
        mb = {k: v[s : s + microbatch].to(device) for k, v in batch.items()}
        with autocast:
            logits = model(input_ids=mb["input_ids"], logits_to_keep=t_resp + 1, use_cache=False).logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, mb["input_ids"][:, -t_resp:, None])[..., 0]
        per_token, _ = algos.ppo_clip_loss(lp, lp.detach(), mb["advantages"], mb["response_mask"],
                                           clip_eps_low=0.2, clip_eps_high=0.28)
        loss = algos.aggregate_loss(per_token, mb["response_mask"], "token-mean", num_tokens=total_tokens)
        loss.backward()
        loss_sum += float(loss.detach())
    if optimizer is not None:
        optimizer.step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / GIB if device.startswith("cuda") else 0.0
    return {"loss": loss_sum, "seconds": seconds, "peak_gib": peak}


def step_with_fallback(step: Callable[[int, bool], dict], microbatch: int, *, max_halvings: int = 4) -> tuple[dict, list[str]]:
    """Runs ``step(microbatch, checkpointing)``; on CUDA OOM halves the micro-batch and turns checkpointing on.

    Returns the successful step's result and a log of the attempts.

    Raises:
        torch.cuda.OutOfMemoryError: still out of memory after ``max_halvings`` halvings.
    """
    attempts: list[str] = []
    checkpointing = False
    for _ in range(max_halvings + 1):
        try:
            result = step(microbatch, checkpointing)
            attempts.append(f"mb={microbatch} ckpt={checkpointing}: ok")
            return result, attempts
        except torch.cuda.OutOfMemoryError:
            attempts.append(f"mb={microbatch} ckpt={checkpointing}: OOM")
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if microbatch == 1 and checkpointing:
                break
            microbatch, checkpointing = max(1, microbatch // 2), True
    raise torch.cuda.OutOfMemoryError("still out of memory after the fallback: " + "; ".join(attempts))


def set_checkpointing(model: torch.nn.Module, on: bool) -> None:
    """Turns transformers' gradient checkpointing on or off (non-reentrant)."""
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------
def check_checkpointing(model, batch, device: str, microbatch: int, optimizer=None) -> list[tuple[str, str, str]]:
    """Returns rows for the bf16 learner step with gradient checkpointing off and on (same loss, less memory)."""
    rows = []
    results = {}
    for on in (False, True):
        set_checkpointing(model, on)
        learner_step(model, batch, microbatch=microbatch, device=device, optimizer=optimizer)  # warm-up
        results[on] = r = learner_step(model, batch, microbatch=microbatch, device=device, optimizer=optimizer)
        rows.append((f"bf16 learner step, checkpointing {'on' if on else 'off'}", "ok",
                     f"{r['seconds']:.3f} s, peak {r['peak_gib']:.2f} GiB, loss {r['loss']:.5f}"))
    set_checkpointing(model, False)
    same = abs(results[True]["loss"] - results[False]["loss"]) <= 1e-3 * max(1.0, abs(results[False]["loss"]))
    less = results[True]["peak_gib"] <= results[False]["peak_gib"]
    rows.append(("checkpointing: same loss, less memory", "ok" if same and (less or device == "cpu") else "FAIL",
                 f"|dloss| {abs(results[True]['loss'] - results[False]['loss']):.2e}"))
    return rows


def check_memory_cap(device: str, fraction: float = 0.05) -> list[tuple[str, str, str]]:
    """Returns a row: with the cap set, an allocation above it fails and one below it succeeds."""
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    cap_gib = fraction * total / GIB
    try:
        under = torch.empty(int(0.5 * fraction * total), dtype=torch.uint8, device=device)
        del under
        try:
            over = torch.empty(int(1.2 * fraction * total), dtype=torch.uint8, device=device)
            del over
            status, detail = "FAIL", f"allocated 1.2 x the {cap_gib:.1f} GiB cap"
        except torch.cuda.OutOfMemoryError:
            status, detail = "ok", f"cap {cap_gib:.1f} GiB: 0.5 x fits, 1.2 x raises OutOfMemoryError"
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()
    return [("memory fraction cap", status, detail)]


def check_oom_fallback(model, batch, device: str, microbatch: int, optimizer=None) -> list[tuple[str, str, str]]:
    """Returns a row: a step that must OOM under a tight cap is recovered by the fallback."""
    total = torch.cuda.get_device_properties(device).total_memory
    set_checkpointing(model, True)
    small = learner_step(model, batch, microbatch=max(1, microbatch // 8), device=device, optimizer=optimizer)["peak_gib"]
    set_checkpointing(model, False)
    torch.cuda.empty_cache()
    # room for what the fallback's smallest attempt needs, with 50% margin; the first attempt
    # (8x the micro-batch, no checkpointing) needs several times more
    fraction = min(1.0, 1.5 * small * GIB / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)

    def step(mb: int, ckpt: bool) -> dict:
        set_checkpointing(model, ckpt)
        return learner_step(model, batch, microbatch=mb, device=device, optimizer=optimizer)

    try:
        result, attempts = step_with_fallback(step, microbatch)
        oom_first = attempts[0].endswith("OOM")
        status = "ok" if oom_first else "FAIL"
        detail = " -> ".join(attempts) + f" (cap {fraction * total / GIB:.2f} GiB, loss {result['loss']:.5f})"
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        set_checkpointing(model, False)
        torch.cuda.empty_cache()
    return [("forced OOM recovered by the fallback", status, detail)]


def algos_outputs(device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Returns rlray.algos outputs on ``device`` for fixed random inputs (generated on the CPU, then moved)."""
    g = torch.Generator().manual_seed(seed)
    b, t, groups = 16, 12, 4
    lp = (torch.randn(b, t, generator=g) * 0.3 - 1.0).to(device)
    old = (lp.cpu() + torch.randn(b, t, generator=g) * 0.1).to(device)
    ref = (lp.cpu() + torch.randn(b, t, generator=g) * 0.1).to(device)
    mask = (torch.rand(b, t, generator=g) > 0.2).to(device)
    rewards = torch.rand(b, generator=g).to(device)
    gid = torch.arange(b).div(b // groups, rounding_mode="floor").to(device)
    out: dict[str, torch.Tensor] = {}
    for name, fn in algos.GROUP_ADVANTAGES.items():
        out[f"advantages/{name}"] = fn(rewards, gid)
    adv = out["advantages/grpo"][:, None].expand(b, t) * mask
    for name, fn in algos.POLICY_LOSSES.items():
        per_token, _ = fn(lp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.28)
        out[f"loss/{name}"] = per_token * mask
        for mode in algos.AGGREGATION_MODES:
            out[f"loss/{name}/{mode}"] = algos.aggregate_loss(per_token, mask, mode, max_response_tokens=t)
    for est in algos.KL_ESTIMATORS:
        out[f"kl/{est}"] = algos.kl_penalty(lp, ref, est) * mask
    for mode in algos.ROLLOUT_CORRECTION_MODES:
        out[f"rollout_correction/{mode}"] = algos.rollout_correction_weights(old, lp, mask, mode=mode, ratio_min=0.5,
                                                                             ratio_max=2.0)[0]
    seq = lambda x: (x * mask).sum(-1)  # noqa: E731
    for name, fn in algos.PAIRWISE_LOSSES.items():
        out[f"pairwise/{name}"] = fn(seq(lp)[:8], seq(old)[:8], seq(ref)[:8], seq(ref)[8:], beta=0.1)
    return out


def check_algos_parity(device_a: str, device_b: str, atol: float = 1e-5) -> list[tuple[str, str, str]]:
    """Returns a row: the largest |a - b| over every rlray.algos output, and the worst function."""
    a, b = algos_outputs(device_a), algos_outputs(device_b)
    diffs = {k: (a[k].float().cpu() - b[k].float().cpu()).abs().max().item() for k in a}
    worst = max(diffs, key=diffs.get)
    status = "ok" if diffs[worst] <= atol else "FAIL"
    return [(f"rlray.algos parity {device_a} vs {device_b}", status,
             f"{len(diffs)} outputs, max |diff| {diffs[worst]:.2e} ({worst})")]


def check_shared_prompts(model, device: str, vocab: int, *, groups: int = 4, samples: int = 4, prompt_tokens: int = 256,
                         response_tokens: int = 256, bf16: bool = True) -> list[tuple[str, str, str]]:
    """Compares ``response_logits`` with shared prompts against one pass per row on ``device`` (row 5).

    The batch is ``groups`` prompts x ``samples`` responses (every response full length). Returns one row:
    ok when the logprobs agree within 1e-3 (bf16 autocast; 1e-5 in float32) and the gradients within 1e-2
    relative (bf16) of each other, with both timings.
    """
    from rlray.learner.logprobs import logprobs_from_logits, response_logits
    from rlray.schema import ModelInputs

    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, vocab - 1, (groups, prompt_tokens), generator=g).repeat_interleave(samples, 0)
    responses = torch.randint(10, vocab - 1, (groups * samples, response_tokens), generator=g)
    ids = torch.cat([prompts, responses], 1).to(device)
    n = ids.shape[1]
    batch = ModelInputs(input_ids=ids, attention_mask=torch.ones_like(ids),
                        position_ids=torch.arange(n, device=device).expand_as(ids).contiguous(),
                        response_ids=responses.to(device))
    out = {}
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=bf16):
            logits = response_logits(model, batch, share_prompts=share)
        lp, _ = logprobs_from_logits(logits.float(), batch.response_ids)
        lp.sum().backward()
        sync(device)
        grads = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
        out[share] = (time.perf_counter() - t0, lp.detach(), grads)
    model.zero_grad(set_to_none=True)
    lp_diff = float((out[True][1] - out[False][1]).abs().max())
    grad_rel = float((out[True][2] - out[False][2]).norm() / out[False][2].norm())
    ok = lp_diff <= (1e-3 if bf16 else 1e-5) and grad_rel <= (1e-2 if bf16 else 1e-5)
    return [("shared-prompt forward+backward", "ok" if ok else "FAILED",
             f"max |dlogprob| {lp_diff:.2e}, grad rel diff {grad_rel:.2e}; {out[False][0]:.3f} s per row -> "
             f"{out[True][0]:.3f} s shared ({groups}x{samples}, {prompt_tokens}+{response_tokens} tokens)")]


def check_packed_rows(model, device: str, vocab: int, *, groups: int = 4, samples: int = 4, prompt_tokens: int = 256,
                      response_tokens: int = 256, bf16: bool = True) -> list[tuple[str, str, str]]:
    """Compares packed rows with shared prompts (``rlray.learner.scoring.response_scores``, packed) against the padded,
    unshared rows on ``device`` (row 8). ``groups`` prompts x ``samples`` responses of ragged lengths (a quarter to
    all of ``response_tokens``). Returns one row: ok when the logprobs agree within 2e-2 (bf16 autocast; 1e-4 in
    float32) and the gradients within 2e-2 relative (bf16; 1e-4), with both timings and the tokens computed.
    """
    from rlray.learner.scoring import response_scores
    from rlray.schema import pack_sequences

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, vocab - 1, (prompt_tokens,), generator=g).tolist() for _ in range(groups)]
    lengths = torch.randint(response_tokens // 4, response_tokens + 1, (groups * samples,), generator=g).tolist()
    inputs = pack_sequences([p for p in prompts for _ in range(samples)],
                            [torch.randint(10, vocab - 1, (n,), generator=g).tolist() for n in lengths], 0).to(device)
    real = (torch.arange(inputs.response_ids.shape[1])[None] < torch.tensor(lengths)[:, None]).to(device)
    out = {}
    for packed in (False, True):
        model.zero_grad(set_to_none=True)
        sync(device)
        t0 = time.perf_counter()
        got = response_scores(model, inputs, dtype="bfloat16" if bf16 else "float32", temperature=1.0, packed=packed,
                              share_prefixes=packed)
        torch.where(real, got.logprobs, 0.0).sum().backward()
        sync(device)
        grads = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
        out[packed] = (time.perf_counter() - t0, got.logprobs.detach(), grads, got.tokens)
    model.zero_grad(set_to_none=True)
    lp_diff = float((out[True][1] - out[False][1])[real].abs().max())
    grad_rel = float((out[True][2] - out[False][2]).norm() / out[False][2].norm())
    tol = 2e-2 if bf16 else 1e-4
    ok = lp_diff <= tol and grad_rel <= tol
    padded, packed = out[False][3], out[True][3]
    return [("packed rows + shared prompts, forward+backward", "ok" if ok else "FAILED",
             f"max |dlogprob| {lp_diff:.2e}, grad rel diff {grad_rel:.2e}; padded {out[False][0]:.3f} s "
             f"({padded.real + padded.padding} tokens) -> packed {out[True][0]:.3f} s ({packed.real} tokens, "
             f"{packed.shared} shared) ({groups}x{samples}, {prompt_tokens}+<={response_tokens} tokens)")]


def check_frozen_bf16(model, device: str, vocab: int, *, rows: int = 4, tokens: int = 128) -> list[tuple[str, str, str]]:
    """Compares a frozen copy of ``model`` with its linear weights stored in bf16 (``store_frozen_for_autocast``,
    how the learner keeps its reference under bf16) against the float32 copy, under bf16 autocast on ``device``
    (row 6). Returns one row: ok when the logits are bit-identical, with the bytes saved.
    """
    import copy

    from rlray.learner.logprobs import store_frozen_for_autocast

    reference = copy.deepcopy(model).eval().requires_grad_(False)
    cast = copy.deepcopy(reference)
    saved = store_frozen_for_autocast(cast, "bfloat16")
    ids = torch.randint(10, vocab - 1, (rows, tokens), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad(), torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16):
        want, got = reference(ids).logits, cast(ids).logits
    same = torch.equal(want, got)
    diff = float((want.float() - got.float()).abs().max())
    return [("frozen reference in bf16 linear weights", "ok" if same else "FAILED",
             f"logits {'bit-identical' if same else f'differ (max |diff| {diff:.2e})'} under bf16 autocast "
             f"({rows}x{tokens} tokens); {saved / 2**20:.2f} MiB saved")]


def check_planner(model_dir: str, device: str, *, sequences: int = 8, prompt_tokens: int = 256,
                  response_tokens: int = 256, checkpointing: bool = False, bf16: bool = True,
                  tolerance: float = 0.25) -> list[tuple[str, str, str]]:
    """Compares the capacity planner's learner rank with a real ``PolicyLearner`` step on ``device`` (row 7).

    The config: ``model.path=model_dir``, micro-batches of ``sequences`` sequences of ``prompt_tokens`` +
    ``response_tokens`` tokens, two per mini-batch, the KL's reference on the learner (the defaults). The step runs
    twice (the first makes AdamW's state), the peak is read on the second: on CUDA ``torch.cuda.max_memory_allocated``
    less what was allocated before the learner was built, compared with the planner's total less its runtime term
    (CUDA context, NCCL and the allocator's slack are not allocations); on the CPU the resident peak (VmHWM, reset
    through /proc/self/clear_refs) less the resident bytes before, against the total less ``CPU_PROCESS_GIB``.
    Returns one row: ok when they agree within ``tolerance`` (relative to the measured peak).
    """
    from rlray.config import config_from_dict
    from rlray.launch.plan import Hardware, plan_run
    from rlray.launch.plan_roles import CPU_PROCESS_GIB, CUDA_RUNTIME_GIB
    from rlray.learner import PolicyLearner
    from rlray.learner.objective import Normaliser
    from rlray.plan import resolve_plan
    from rlray.run import build

    cuda = device.startswith("cuda")
    cfg = config_from_dict({}, [
        f"model.path={model_dir}", f"model.dtype={'bfloat16' if bf16 else 'float32'}",
        f"model.gradient_checkpointing={str(checkpointing).lower()}", f"learner.sequences_per_microbatch={sequences}",
        f"learner.sequences_per_minibatch={2 * sequences}", f"learner.prompts_per_step={sequences}",
        "rollout.samples_per_prompt=2", f"data.max_prompt_tokens={prompt_tokens}",
        f"rollout.max_new_tokens={response_tokens}", f"resources.learner.gpus={1 if cuda else 0}"])  # fmt: skip
    hardware = Hardware(1, 1, torch.cuda.get_device_properties(device).total_memory / GIB) if cuda else None
    learner_plan = plan_run(resolve_plan(cfg), hardware).roles[0]
    predicted = learner_plan.total_gib - (CUDA_RUNTIME_GIB if cuda else CPU_PROCESS_GIB)
    before = allocated_bytes(device)
    learner = PolicyLearner(model_dir, **build.learner_kwargs(cfg, 1))
    rows = 2 * sequences
    batch = full_length_batch(learner.module.config.vocab_size, rows, prompt_tokens, response_tokens)
    spec = build.update_spec(cfg, 1)
    norm = Normaliser(float(rows * response_tokens), float(rows))
    learner.train_minibatch(batch, spec.loss, norm, spec.batching)
    reset_peak(device)
    learner.train_minibatch(batch, spec.loss, norm, spec.batching)
    measured = (peak_bytes(device) - before) / GIB
    del learner
    if cuda:
        torch.cuda.empty_cache()
    ok = abs(predicted - measured) <= tolerance * measured
    name = f"planner vs measured learner step, checkpointing {'on' if checkpointing else 'off'}"
    return [(name, "ok" if ok else "FAILED",
             f"predicted {predicted:.2f} GiB, measured {measured:.2f} GiB ({predicted / measured - 1:+.0%}); "
             f"{sequences} x ({prompt_tokens} + {response_tokens}) tokens per micro-batch, 2 micro-batches")]


def check_adapter_sync(model, device: str, vocab: int, *, rank: int = 16, rows: int = 4,
                       tokens: int = 128) -> list[tuple[str, str, str]]:
    """Compares the adapter-only weight sync with the merged one for a LoRA policy over ``model`` on ``device`` (row 8).

    The learner side is a peft copy of ``model`` with LoRA of ``rank`` on every linear layer (alpha 2 x rank, seeded
    non-zero lora_B); its export is ``rlray.learner.lora.lora_adapter_weights`` (adapter alone) against
    ``merged_lora_state_dict`` (the whole model), both cast to bf16 on the CPU as ``ObjectStoreSync`` ships them. The
    engine side is a base copy with the adapter applied (``rlray.rollout.hf_backend.apply_adapter``) against a base
    copy loaded with the merged weights, float32, on ``rows`` x ``tokens`` random tokens. Returns one row: ok when the
    max |logprob difference| is within 1e-4 nats, the adapter changes the logprobs by more than 100 x that, and the
    adapter is under a tenth of the merged bytes.
    """
    import copy

    from peft import LoraConfig, get_peft_model

    from rlray.learner.lora import lora_adapter_weights, merged_lora_state_dict
    from rlray.rollout.hf_backend import apply_adapter

    policy = get_peft_model(copy.deepcopy(model).eval(), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.copy_(0.02 * torch.randn(param.shape, generator=g))
    shipped, seconds = {}, {}
    for kind, export in (("adapter", lambda: lora_adapter_weights(policy, torch.bfloat16).tensors),
                         ("merged", lambda: {k: v.to("cpu", torch.bfloat16) for k, v in merged_lora_state_dict(policy).items()})):
        sync(device)
        t0 = time.perf_counter()
        shipped[kind] = sum(t.numel() * t.element_size() for t in export().values())
        seconds[kind] = time.perf_counter() - t0
    adapted = apply_adapter(copy.deepcopy(model).eval(), lora_adapter_weights(policy, torch.float32))
    merged = copy.deepcopy(model).eval()
    merged.load_state_dict(merged_lora_state_dict(policy), strict=False)
    ids = torch.randint(10, vocab - 1, (rows, tokens), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        lp = {name: m(ids).logits.float().log_softmax(-1) for name, m in
              (("adapter", adapted), ("merged", merged), ("base", model.eval()))}
    diff = float((lp["adapter"] - lp["merged"]).abs().max())
    effect = float((lp["adapter"] - lp["base"]).abs().max())
    ok = diff <= 1e-4 and effect > 100 * diff and shipped["adapter"] * 10 < shipped["merged"]
    mib = 2**20
    return [(f"adapter-only sync (LoRA r{rank} all-linear)", "ok" if ok else "FAILED",
             f"ships {shipped['adapter'] / mib:.2f} MiB in {seconds['adapter']:.3f} s against {shipped['merged'] / mib:.1f} "
             f"MiB in {seconds['merged']:.3f} s merged (bf16 export); max |dlogprob| adapter vs merged {diff:.2e} "
             f"(float32, {rows}x{tokens} tokens; the adapter's own effect {effect:.2e})")]


def markdown_table(rows: list[tuple[str, str, str]]) -> str:
    """Returns the rows as a markdown table (check | status | detail)."""
    lines = ["| check | status | detail |", "|---|---|---|"]
    lines += [f"| {c} | {s} | {d} |" for c, s, d in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Runs every check on ``--device`` and prints the table; returns 1 if any check failed."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import cached_file

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct", help="local HF folder or hub id")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", type=int, default=32, help="sequences per learner step")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--response-tokens", type=int, default=256)
    p.add_argument("--microbatch", type=int, default=16)
    args = p.parse_args(argv)

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible; use --device cpu for the CPU parts")
    # row 7 first, alone on the device: the planner reads config.json from the local folder of the model
    folder = args.model if Path(args.model).is_dir() else str(Path(cached_file(args.model, "config.json")).parent)
    planner_rows = [row for ckpt in (False, True) for row in check_planner(
        folder, args.device, sequences=args.microbatch, prompt_tokens=args.prompt_tokens,
        response_tokens=args.response_tokens, checkpointing=ckpt, bf16=cuda)]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device)
    model.config.use_cache = False
    model.train()
    # lr 0: AdamW allocates its states (they count in the peak) but the weights stay put, so the
    # checkpointing-off and -on steps see the same model and must give the same loss
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    batch = synthetic_batch(model.config.vocab_size, args.rows, args.prompt_tokens, args.response_tokens)
    rows = [("device", "ok", torch.cuda.get_device_name(args.device) if cuda else "cpu")]
    rows += check_checkpointing(model, batch, args.device, args.microbatch, optimizer)
    if cuda:
        rows += check_memory_cap(args.device)
        rows += check_oom_fallback(model, batch, args.device, args.microbatch, optimizer)
    rows += check_algos_parity("cpu", args.device if cuda else "cpu")
    rows += check_shared_prompts(model, args.device, model.config.vocab_size, bf16=cuda)
    rows += check_frozen_bf16(model, args.device, model.config.vocab_size)
    rows += planner_rows
    rows += check_adapter_sync(model, args.device, model.config.vocab_size)
    rows += check_packed_rows(model, args.device, model.config.vocab_size, bf16=cuda)
    rows += check_fsdp(folder, args.device)
    print(markdown_table(rows))
    return 0 if all(s == "ok" for _, s, _ in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
