"""rlray.launch.driver.eval_setup: what it checks before it starts anything (the benchmark runs the real thing)."""

import pytest

from rlray.config import config_from_dict
from rlray.launch.driver import eval_setup, evaluate_checkpoint


def test_zero_problems_is_refused_before_ray_starts(monkeypatch):
    monkeypatch.setattr("rlray.launch.driver.init_ray", lambda **_: pytest.fail("Ray started"))
    cfg = config_from_dict({"eval": {"num_problems": 0}})
    with pytest.raises(ValueError, match="eval.num_problems=0"), eval_setup(cfg, "tiny-random"):
        pass
    with pytest.raises(ValueError, match="eval.num_problems=0"):
        evaluate_checkpoint(cfg, "tiny-random")
