"""Config of the operations sections: defaults, validation naming the keys, and secrets never logged."""

import pytest

from rlray.cli import build_parser
from rlray.config import ConfigError, config_from_dict


def test_operations_defaults():
    cfg = config_from_dict({"run": {"output_dir": "/data/run"}})
    assert (cfg.checkpoint.every_steps, cfg.checkpoint.keep_last) == (1000, 3)
    assert (cfg.checkpoint.max_age_days, cfg.checkpoint.log_max_age_days) == (30.0, 7.0)
    assert cfg.checkpoint_uri == "/data/run/snapshots"  # derived while checkpoint.uri is unset
    assert (cfg.guard.kl_threshold, cfg.guard.on_trip, cfg.run.max_wall_time_s) == (0.03, "stop", 72 * 3600)
    assert (cfg.monitor.port, cfg.monitor.host, cfg.monitor.heartbeat_s, cfg.monitor.restart_delay_s) == (8888, "127.0.0.1", 300.0, 30.0)
    assert config_from_dict({"checkpoint": {"uri": "s3://b/p/"}}).checkpoint_uri == "s3://b/p"


def test_secrets_are_masked_in_params_and_yaml_but_reach_s3fs():
    cfg = config_from_dict({"checkpoint": {"uri": "s3://b/p", "s3": {"access_key_id": "AKIAXYZ", "secret_access_key": "s3cr3t",
                                                                        "endpoint_url": "http://127.0.0.1:9000"}},
                            "monitor": {"alerts": ["log", "webhook"], "webhook_url": "https://hooks.example/T0k3n"}})
    flat = cfg.flat()
    assert flat["checkpoint.s3.secret_access_key"] == "**********" and flat["monitor.webhook_url"] == "**********"
    text = cfg.to_yaml() + str(flat) + repr(cfg)
    assert "s3cr3t" not in text and "AKIAXYZ" not in text and "T0k3n" not in text
    assert cfg.checkpoint.s3.storage_options() == {"endpoint_url": "http://127.0.0.1:9000", "key": "AKIAXYZ", "secret": "s3cr3t"}
    # the python-mode dump the driver hands to Ray Train keeps them
    from rlray.config import validate_tree

    assert validate_tree(cfg.model_dump()).checkpoint.s3.secret_access_key.get_secret_value() == "s3cr3t"


def test_operations_validation_names_the_keys():
    with pytest.raises(ConfigError, match="checkpoint.s3.access_key_id and checkpoint.s3.secret_access_key must be set together"):
        config_from_dict({"checkpoint": {"s3": {"access_key_id": "a"}}})
    with pytest.raises(ConfigError, match="monitor.alerts has 'webhook' but monitor.webhook_url is unset"):
        config_from_dict({"monitor": {"alerts": ["webhook"]}})
    with pytest.raises(ConfigError, match=r"checkpoint.every_steps=0"):
        config_from_dict({"checkpoint": {"every_steps": 0}})
    with pytest.raises(ConfigError, match=r"guard.on_trip='pause'"):
        config_from_dict({"guard": {"on_trip": "pause"}})
    with pytest.raises(ConfigError, match=r"monitor.port=70000"):
        config_from_dict({"monitor": {"port": 70000}})


def test_watchdog_defaults_reach_the_plan_and_bad_deadlines_name_the_key():
    from rlray.plan import resolve_plan

    cfg = config_from_dict({})
    w = cfg.watchdog
    assert (w.env_call_s, w.engine_call_s, w.weight_push_s, w.reference_call_s) == (600.0, 1800.0, 600.0, 1800.0)
    assert (w.learner_step_s, w.on_hang, w.stacks_timeout_s) == (7200.0, "restart", 10.0)
    d = resolve_plan(config_from_dict({"watchdog": {"reference_call_s": 42.5, "on_hang": "stop"}})).deadlines
    assert (d.reference_call_s, d.engine_call_s, d.on_hang) == (42.5, 1800.0, "stop")
    with pytest.raises(ConfigError, match=r"watchdog.reference_call_s=0: Input should be greater than 0"):
        config_from_dict({"watchdog": {"reference_call_s": 0}})
    with pytest.raises(ConfigError, match=r"watchdog.reference_call_s='soon'"):
        config_from_dict({"watchdog": {"reference_call_s": "soon"}})


def test_config_errors_never_print_a_secret():
    """A validator's error names the keys but not the section's input; other errors on a section that holds a
    secret show '**********' (the s3 error used to print {'secret_access_key': ...})."""
    with pytest.raises(ConfigError) as err:
        config_from_dict({"checkpoint": {"s3": {"secret_access_key": "s3cr3t-value"}}})
    assert "s3cr3t-value" not in str(err.value)
    assert "  - checkpoint.s3: checkpoint.s3.access_key_id and checkpoint.s3.secret_access_key must be set" in str(err.value)
    with pytest.raises(ConfigError) as err:
        config_from_dict({"checkpoint": {"s3": ["s3cr3t-value"]}})
    assert "checkpoint.s3='**********': Input should be a valid dictionary" in str(err.value) and "s3cr3t" not in str(err.value)
    with pytest.raises(ConfigError, match=r"monitor.webhook_url='\*{10}': Input should be a valid string"):
        config_from_dict({"monitor": {"webhook_url": 12345}})
    with pytest.raises(ConfigError, match=r"monitor.port=70000: Input should be less than or equal to 65535"):
        config_from_dict({"monitor": {"port": 70000}})  # a section without secrets still shows the input


def test_cli_resume_and_ops_commands_parse():
    p = build_parser()
    a = p.parse_args(["train", "c.yaml", "learner.lr=1e-5", "--resume", "latest"])
    assert (a.config, a.overrides, a.resume) == ("c.yaml", ["learner.lr=1e-5"], "latest")
    r = p.parse_args(["rollback", "abc123", "--to", "v3", "--set", "tracking.experiment=x"])
    assert (r.ref, r.to, r.overrides) == ("abc123", "v3", ["tracking.experiment=x"])
    assert p.parse_args(["models", "show", "7"]).version == "7"
    assert p.parse_args(["snapshots", "lifecycle", "--apply"]).apply


def test_monitor_bands_defaults_and_errors():
    """Defaults hold for every algorithm (finite losses and gradient norms, reward not falling); a policy-loss
    range is opt-in; a band with low above high names the key and the fix."""
    from rlray.config import config_from_dict

    bands = config_from_dict({}).monitor.bands
    assert [(b.metric, b.low, b.high, b.finite, b.min_slope, b.window) for b in bands] == [
        ("learner/pg_loss", None, None, True, None, 20), ("learner/value_loss", None, None, True, None, 20),
        ("learner/grad_norm", None, None, True, None, 20), ("reward/mean", None, None, True, 0.0, 20)]
    cfg = config_from_dict({"monitor": {"bands": [{"metric": "learner/pg_loss", "low": 0.1, "high": 0.5}]}})
    assert [(b.metric, b.low, b.high) for b in cfg.monitor.bands] == [("learner/pg_loss", 0.1, 0.5)]
    with pytest.raises(ConfigError, match="monitor.bands.*low=0.5 is above high=0.1; swap them"):
        config_from_dict({"monitor": {"bands": [{"metric": "learner/pg_loss", "low": 0.5, "high": 0.1}]}})
    with pytest.raises(ConfigError, match="monitor.bands.0.window"):
        config_from_dict({"monitor": {"bands": [{"metric": "reward/mean", "min_slope": 0.0, "window": 1}]}})


def test_monitor_defaults_are_the_sections_defaults_as_plain_data():
    """``rlray monitor RUN_ID`` reads a stored run's missing monitor keys from these (rlray.observe.stored)."""
    from rlray.config import monitor_defaults

    d = monitor_defaults()
    assert (d["heartbeat_s"], d["port"], d["alerts"], d["webhook_url"]) == (300.0, 8888, ["log", "mlflow"], None)
    assert d["bands"] == [{"metric": m, "low": None, "high": None, "finite": True, "min_slope": None, "window": 20}
                          for m in ("learner/pg_loss", "learner/value_loss", "learner/grad_norm")] + [
        {"metric": "reward/mean", "low": None, "high": None, "finite": True, "min_slope": 0.0, "window": 20}]


def test_resume_tree_resumes_from_the_snapshot_without_secrets():
    """``rlray rollback``: resume_from set, S3 keys and the webhook (its alert too) cleared, the rest kept; the input is
    not changed; a tree that does not validate names the key."""
    from rlray.config import normalized_tree, resume_tree

    given = config_from_dict({"learner": {"lr": 5e-4},
                              "checkpoint": {"s3": {"access_key_id": "AKIAXYZ", "secret_access_key": "s3cr3t"}},
                              "monitor": {"alerts": ["webhook", "log"], "webhook_url": "https://hooks.example/T0k3n"}})
    tree = normalized_tree(given.model_dump())
    assert tree["checkpoint"]["s3"]["secret_access_key"] == "**********" and tree["learner"]["lr"] == 5e-4
    out = resume_tree(tree, "/snaps/run-a/step_00000002")
    assert out["checkpoint"]["resume_from"] == "/snaps/run-a/step_00000002"
    assert (out["checkpoint"]["s3"]["access_key_id"], out["checkpoint"]["s3"]["secret_access_key"]) == (None, None)
    assert (out["monitor"]["webhook_url"], out["monitor"]["alerts"]) == (None, ["log"])
    assert out["learner"] == tree["learner"] and tree["checkpoint"]["resume_from"] is None  # a copy
    assert config_from_dict(out).checkpoint.resume_from == "/snaps/run-a/step_00000002"
    tree["learner"]["lr"] = -1.0
    with pytest.raises(ConfigError, match="learner.lr"):
        resume_tree(tree, "/snaps/run-a/step_00000002")
    with pytest.raises(ConfigError, match="learner.lr"):
        normalized_tree(tree)
