"""What benchmarks/gpu_check.py and benchmarks/gpu_fsdp.py share: the device's memory probes and a full-length
learner batch (torch only at import; rlray.schema inside ``full_length_batch``).

Peak memory is ``torch.cuda.max_memory_allocated`` on CUDA and this process's resident peak (VmHWM, reset through
/proc/self/clear_refs) on the CPU.
"""

from __future__ import annotations

import torch

GIB = 2**30


def full_length_batch(vocab: int, rows: int, prompt_tokens: int, response_tokens: int, seed: int = 0):
    """Returns a learner mini-batch (``rlray.schema.StepBatch``, ``pack_sequences`` layout) of ``rows`` distinct
    prompts and responses, all full length (the planner's padded worst case): response_mask [B, T] bool all True,
    advantages [B, T] float32 random, zero ref_logprobs and rollout_logprobs [B, T] float32."""
    from rlray.schema import StepBatch, pack_sequences

    g = torch.Generator().manual_seed(seed)
    inputs = pack_sequences(torch.randint(10, vocab - 1, (rows, prompt_tokens), generator=g).tolist(),
                            torch.randint(10, vocab - 1, (rows, response_tokens), generator=g).tolist(), 0)
    zeros = torch.zeros(rows, response_tokens)
    return StepBatch(inputs, response_mask=zeros == 0, reward=torch.zeros(rows), group_id=torch.arange(rows),
                     policy_version=torch.zeros(rows, dtype=torch.long), rollout_logprobs=zeros, ref_logprobs=zeros,
                     advantages=torch.randn(rows, response_tokens, generator=g))


def allocated_bytes(device: str) -> int:
    """Returns the bytes held now: CUDA allocations, or this process's resident bytes on the CPU."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    return _status_bytes("VmRSS")


def reset_peak(device: str) -> None:
    """Resets the peak that ``peak_bytes`` reads (CUDA's peak statistics, or the CPU's VmHWM)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def peak_bytes(device: str) -> int:
    """Returns the peak bytes since ``reset_peak``."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    return _status_bytes("VmHWM")


def _status_bytes(field: str) -> int:
    """Returns a /proc/self/status size field (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def sync(device: str) -> None:
    """Waits for the device's queued work (CUDA), so that wall-clock timings are complete."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
