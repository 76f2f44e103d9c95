"""FSDP2 rows of benchmarks/gpu_check.py: rlray's sharded learner over NCCL, one process per GPU.

    python benchmarks/gpu_fsdp.py --model FOLDER [--device cuda] [--world N]

``check_fsdp`` starts one child process per rank (``--rank``; N = every visible GPU on CUDA, one of them being a
world-1 ``fully_shard`` smoke test, 2 over gloo on the CPU) and reads back what each measured:

  1. FSDP2 in float32 (``rlray.learner.parallel.FSDP2`` through ``rlray.run.build.learner_kwargs``, as a run with
     ``resources.learner.strategy=fsdp`` builds it): two optimizer steps on a global batch split over the ranks, then
     rank 0 repeats them on one unsharded learner. ok when the losses and gradient norms agree to 1e-4 (relative) and
     the gathered weights (``export_weights``, what a weight sync sends) to 1e-5; the detail gives each rank's peak
     memory of the second step against the unsharded learner's.
  2. FSDP2 with bf16 mixed precision (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)``): a step's
     seconds and peak memory per rank, and the sharded bf16 reference against the policy at initialisation (ok when
     their logprobs are bit-identical, the KL's starting point).

Peak memory is ``torch.cuda.max_memory_allocated`` on CUDA and the resident peak (VmHWM) on the CPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the checkout's rlray
    sys.path.insert(0, str(REPO))
if str(REPO / "benchmarks") not in sys.path:  # this folder's modules, also when loaded from a file
    sys.path.append(str(REPO / "benchmarks"))

from gpu_probes import GIB, full_length_batch, peak_bytes, reset_peak  # noqa: E402 - the sys.path lines above


def check_fsdp(model_dir: str, device: str, *, world: int | None = None, rows_per_rank: int = 4,
               prompt_tokens: int = 128, response_tokens: int = 128, timeout_s: float = 900.0) -> list[tuple[str, str, str]]:
    """Returns the FSDP2 rows (check, status, detail) from ``world`` child processes on ``device`` ("cuda" or "cpu").

    Raises:
        RuntimeError: a rank's process failed (its output is in the message).
    """
    cuda = device.startswith("cuda")
    world = world or (torch.cuda.device_count() if cuda else 2)
    with tempfile.TemporaryDirectory(prefix="rlray-fsdp-check-") as tmp:
        args = [sys.executable, __file__, "--model", model_dir, "--device", device, "--world", str(world),
                "--store", f"{tmp}/store", "--out", tmp, "--rows-per-rank", str(rows_per_rank),
                "--prompt-tokens", str(prompt_tokens), "--response-tokens", str(response_tokens)]
        procs = [subprocess.Popen([*args, "--rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(world)]
        outs = [p.communicate(timeout=timeout_s)[0] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError("an FSDP2 rank failed:\n" + "\n".join(out[-3000:] for out in outs))
        ranks = [json.loads(Path(tmp, f"rank_{r}.json").read_text()) for r in range(world)]
    return _rows(ranks, "nccl" if cuda else "gloo")


def _rows(ranks: list[dict], backend: str) -> list[tuple[str, str, str]]:
    """Returns the two rows from every rank's measurements (rank 0 also holds the unsharded comparison)."""
    r0, world = ranks[0], len(ranks)
    loss_rel = abs(r0["fsdp_loss"] - r0["whole_loss"]) / max(abs(r0["whole_loss"]), 1e-12)
    norm_rel = abs(r0["fsdp_grad_norm"] - r0["whole_grad_norm"]) / max(r0["whole_grad_norm"], 1e-12)
    ok = loss_rel < 1e-4 and norm_rel < 1e-4 and r0["weights_max_diff"] < 1e-5
    peaks = ", ".join(f"{r['fsdp_peak_gib']:.2f}" for r in ranks)
    first = (f"FSDP2 float32 ({backend}, {world} rank{'s' if world > 1 else ''}) vs one unsharded learner",
             "ok" if ok else "FAILED",
             f"loss {loss_rel:.1e}, grad norm {norm_rel:.1e} relative; weights max |diff| {r0['weights_max_diff']:.1e}; "
             f"peak per rank {peaks} GiB vs unsharded {r0['whole_peak_gib']:.2f} GiB")
    same = all(r["reference_equal"] for r in ranks)
    finite = all(r["bf16_finite"] for r in ranks)
    bf16_peaks = ", ".join(f"{r['bf16_peak_gib']:.2f}" for r in ranks)
    second = (f"FSDP2 bf16 mixed precision ({backend}, {world} rank{'s' if world > 1 else ''})",
              "ok" if same and finite else "FAILED",
              f"step {max(r['bf16_step_s'] for r in ranks):.2f} s, peak per rank {bf16_peaks} GiB; sharded bf16 "
              f"reference vs policy at init: {'bit-identical' if same else 'DIFFERENT'}")
    return [first, second]


# --------------------------------------------------------------------------------------------
# One rank (a child process)
# --------------------------------------------------------------------------------------------
def _config(model_dir: str, world: int, rows: int, prompt_tokens: int, response_tokens: int, *, bf16: bool, cuda: bool):
    from rlray.config import config_from_dict

    return config_from_dict({}, [
        f"model.path={model_dir}", f"model.dtype={'bfloat16' if bf16 else 'float32'}", "algo.kl_coef=0.05",
        f"learner.sequences_per_microbatch={rows // 2}", f"learner.sequences_per_minibatch={rows * world}",
        f"learner.prompts_per_step={rows * world // 2}", "rollout.samples_per_prompt=2",
        f"data.max_prompt_tokens={prompt_tokens}", f"rollout.max_new_tokens={response_tokens}",
        f"resources.learner.gpus={1 if cuda else 0}", f"resources.learner.num_workers={world}",
        "resources.learner.strategy=fsdp"])  # fmt: skip


def _steps(learner, batch, cfg, world: int, device: str) -> tuple[float, float, float, float]:
    """Runs two optimizer steps on ``batch``; returns (loss of the first summed over ranks / world, its grad norm,
    the second step's seconds, its peak GiB)."""
    from rlray.learner.objective import Normaliser
    from rlray.run import build

    spec = build.update_spec(cfg, world)
    rows, t = batch.response_mask.shape
    norm = Normaliser(float(rows * t * world), float(rows * world), world)
    first = learner.train_minibatch(batch, spec.loss, norm, spec.batching)
    loss = torch.tensor([first["loss"]], dtype=torch.float64, device=device)
    if world > 1:  # rank 0's unsharded comparison (world 1) runs alone
        torch.distributed.all_reduce(loss)
    reset_peak(device)
    start = time.perf_counter()
    learner.train_minibatch(batch, spec.loss, norm, spec.batching)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return float(loss) / world, first["grad_norm"], time.perf_counter() - start, peak_bytes(device) / GIB


def _rank_main(a: argparse.Namespace) -> None:
    from rlray.learner import PolicyLearner
    from rlray.learner.batching import MicroBatching
    from rlray.learner.parallel import FSDP2
    from rlray.run import build

    cuda = a.device.startswith("cuda")
    device = f"cuda:{a.rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(a.rank)
    torch.distributed.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{a.store}", rank=a.rank,
                                         world_size=a.world)
    out: dict = {}
    for bf16 in (False, True):
        cfg = _config(a.model, a.world, a.rows_per_rank, a.prompt_tokens, a.response_tokens, bf16=bf16, cuda=cuda)
        kwargs = build.learner_kwargs(cfg, a.world)
        kwargs["parallel"] = FSDP2(mixed_precision=bf16, gpu=cuda)  # also with one GPU: a world-1 fully_shard
        torch.manual_seed(0)
        learner = PolicyLearner(a.model, **kwargs)
        whole = full_length_batch(learner.module.config.vocab_size, a.rows_per_rank * a.world, a.prompt_tokens,
                                  a.response_tokens)
        mine = whole.rows(slice(a.rank * a.rows_per_rank, (a.rank + 1) * a.rows_per_rank))
        if bf16:
            ref = learner.logprobs(mine.inputs, reference=True, batching=MicroBatching(a.rows_per_rank))
            policy = learner.logprobs(mine.inputs, reference=False, batching=MicroBatching(a.rows_per_rank))
            loss, _, seconds, peak = _steps(learner, mine, cfg, a.world, device)
            out.update(reference_equal=bool(torch.equal(ref, policy)), bf16_finite=bool(torch.isfinite(torch.tensor(loss))),
                       bf16_step_s=seconds, bf16_peak_gib=peak)
        else:
            loss, norm, _, peak = _steps(learner, mine, cfg, a.world, device)
            out.update(fsdp_loss=loss, fsdp_grad_norm=norm, fsdp_peak_gib=peak)
            fsdp_weights = learner.export_weights(torch.float32)
        del learner
        if cuda:
            torch.cuda.empty_cache()
    if a.rank == 0:
        out.update(_unsharded(a, fsdp_weights, cuda, device))
    Path(a.out, f"rank_{a.rank}.json").write_text(json.dumps(out))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _unsharded(a: argparse.Namespace, fsdp_weights: dict[str, torch.Tensor], cuda: bool, device: str) -> dict:
    """Rank 0: the float32 steps on the whole batch with one unsharded learner; returns its figures and the weights'
    largest difference from the FSDP2 run's."""
    from rlray.learner import PolicyLearner
    from rlray.learner.parallel import Single
    from rlray.run import build

    cfg = _config(a.model, 1, a.rows_per_rank * a.world, a.prompt_tokens, a.response_tokens, bf16=False, cuda=cuda)
    kwargs = build.learner_kwargs(cfg, 1)
    kwargs["parallel"] = Single(gpu=cuda)
    torch.manual_seed(0)
    learner = PolicyLearner(a.model, **kwargs)
    batch = full_length_batch(learner.module.config.vocab_size, a.rows_per_rank * a.world, a.prompt_tokens,
                              a.response_tokens)
    loss, norm, _, peak = _steps(learner, batch, cfg, 1, device)
    weights = learner.export_weights(torch.float32)
    diff = max(float((weights[k] - fsdp_weights[k]).abs().max()) for k in weights)
    return {"whole_loss": loss, "whole_grad_norm": norm, "whole_peak_gib": peak, "weights_max_diff": diff}


def main(argv: list[str] | None = None) -> int:
    """Runs one rank (``--rank``) or, without it, every rank and prints the rows; returns 1 if a row failed."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local Hugging Face folder")
    p.add_argument("--device", default="cuda")
    p.add_argument("--world", type=int, default=0, help="ranks (default: every GPU; 2 on the CPU)")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--store", default="")
    p.add_argument("--out", default="")
    p.add_argument("--rows-per-rank", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--response-tokens", type=int, default=128)
    a = p.parse_args(argv)
    if a.rank >= 0:
        _rank_main(a)
        return 0
    rows = check_fsdp(a.model, a.device, world=a.world or None, rows_per_rank=a.rows_per_rank,
                      prompt_tokens=a.prompt_tokens, response_tokens=a.response_tokens)
    for row in rows:
        print(" | ".join(row))
    return 0 if all(s == "ok" for _, s, _ in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
