"""SamplingSpec validation and seeds; the rollout package imports without starting vLLM."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlray.rollout import SamplingSpec


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"n": 0}, "n"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": -1}, "seed"),
    ],
)
def test_sampling_spec_rejects_out_of_range(kwargs: dict, field: str):
    base = {"n": 2, "max_new_tokens": 8, "temperature": 1.0}
    with pytest.raises(ValueError, match=f"SamplingSpec.{field}="):
        SamplingSpec(**{**base, **kwargs})


def test_import_does_not_import_vllm():
    code = "import sys, rlray.rollout; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
