"""rlray.rollout.vllm_worker: the weight-sync extension vLLM mixes into its worker, on fake workers."""

from __future__ import annotations

import importlib
import logging
from types import SimpleNamespace

import pytest
import torch

from rlray.rollout import vllm_worker
from rlray.rollout.vllm_worker import WeightSyncExtension, _tied_weight_modules, quiet_benign_reload_warnings


class Repack:
    """A stand-in for a vLLM quant_method: records which modules it re-processed."""

    def __init__(self, log: list[str], name: str):
        self.log, self.name = log, name

    def process_weights_after_loading(self, module):
        self.log.append(self.name)


def _tied_model(log: list[str]) -> torch.nn.Module:
    """embed and head share one weight Parameter; proj has its own; norm shares embed's weight but has no quant_method."""
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(10, 4)
    model.proj = torch.nn.Linear(4, 4)
    model.head = torch.nn.Linear(4, 10, bias=False)
    model.head.weight = model.embed.weight
    model.norm = torch.nn.Module()
    model.norm.weight = model.embed.weight
    for name in ("embed", "proj", "head"):
        getattr(model, name).quant_method = Repack(log, name)
    return model


def test_extension_path_names_the_class():
    module, _, name = vllm_worker.EXTENSION.rpartition(".")
    assert getattr(importlib.import_module(module), name) is WeightSyncExtension


def test_tied_weight_modules_are_those_sharing_a_weight_with_a_quant_method():
    model = _tied_model([])
    assert _tied_weight_modules(model) == [model.embed, model.head]  # proj: untied; norm: no quant_method


def test_benign_reload_warnings_are_dropped_once_installed():
    log = logging.getLogger(vllm_worker._LAYERWISE_LOGGER)
    before = list(log.filters)
    try:
        quiet_benign_reload_warnings()
        quiet_benign_reload_warnings()
        (flt,) = [f for f in log.filters if isinstance(f, vllm_worker._BenignReloadWarnings)]  # installed once

        def record(msg, *args):
            return logging.LogRecord(log.name, logging.WARNING, __file__, 1, msg, args, None)

        assert not flt.filter(record("%s: Failed to load weights", "RotaryEmbedding"))
        assert not flt.filter(record("%s: Failed to load weights", "ParallelLMHead"))
        assert flt.filter(record("%s: Failed to load weights", "QKVParallelLinear"))  # a real missing weight shows
        assert flt.filter(record("something else %s", "RotaryEmbedding"))
    finally:
        log.filters[:] = before


def test_load_weights_reloads_then_repacks_tied_modules():
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig

    log: list[str] = []
    model = _tied_model(log)
    worker = WeightSyncExtension()
    worker.vllm_config = VllmConfig()
    worker.model_runner = SimpleNamespace(get_model=lambda: model)
    worker.reload_weights = lambda **kwargs: log.append(("reload", kwargs))
    weights = [("model.embed_tokens.weight", torch.zeros(10, 4))]
    handler = logging.getLogger(vllm_worker._LAYERWISE_LOGGER)
    before = list(handler.filters)
    try:
        worker.rlray_load_weights(weights)
    finally:
        handler.filters[:] = before
    assert log == [("reload", {"weights_iterator": weights, "is_checkpoint_format": True}), "embed", "head"]
