"""rlray.launch.ray_setup.init_ray against a stand-in ``ray`` module (no Ray starts): which settings an embedded Ray gets,
and that a `ray start` cluster found without RAY_ADDRESS is joined as it is."""

from __future__ import annotations

import pytest

from rlray.launch import ray_setup


class FakeRay:
    """Records ``init`` calls; ``refuse_system_config`` answers as Ray does when ``ray.init()`` finds a running cluster."""

    def __init__(self, refuse_system_config: bool = False) -> None:
        self.calls: list[dict] = []
        self.refuse = refuse_system_config

    def is_initialized(self) -> bool:
        return False

    def init(self, **kwargs):
        self.calls.append(kwargs)
        if self.refuse and kwargs.get("_system_config"):
            raise ValueError("When connecting to an existing cluster, _system_config must not be provided.")
        return type("Ctx", (), {"dashboard_url": "127.0.0.1:8265", "address_info": {"session_dir": "/tmp/s"}})()


@pytest.fixture
def fake_ray(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    monkeypatch.delenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", raising=False)

    def install(**kwargs) -> FakeRay:
        fake = FakeRay(**kwargs)
        monkeypatch.setattr(ray_setup, "ray", fake)
        return fake

    return install


def test_an_embedded_ray_starts_no_idle_workers_and_no_preemption_watcher(fake_ray):
    fake = fake_ray()
    info = ray_setup.init_ray()
    (call,) = fake.calls
    assert call["_system_config"] == {"prestart_worker_first_driver": False}
    assert call["dashboard_host"] == "127.0.0.1"
    env = call["runtime_env"]["env_vars"]
    assert env["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] == "0" and env["TOKENIZERS_PARALLELISM"] == "false"
    assert info == ray_setup.RayInfo("127.0.0.1:8265", "/tmp/s/logs")


def test_a_running_cluster_found_without_ray_address_is_joined_without_system_config(fake_ray):
    fake = fake_ray(refuse_system_config=True)
    ray_setup.init_ray()
    assert [("_system_config" in c) for c in fake.calls] == [True, False]
    assert fake.calls[1]["runtime_env"] == fake.calls[0]["runtime_env"]


def test_a_cluster_in_ray_address_gets_neither_system_config_nor_embedded_settings(fake_ray, monkeypatch):
    fake = fake_ray()
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    ray_setup.init_ray()
    (call,) = fake.calls
    assert call["address"] == "10.0.0.1:6379" and "_system_config" not in call
    assert "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER" not in call["runtime_env"]["env_vars"]


def test_another_value_error_of_ray_init_is_raised(fake_ray, monkeypatch):
    fake = fake_ray()
    monkeypatch.setattr(fake, "init", lambda **_: (_ for _ in ()).throw(ValueError("bad num_cpus")))
    with pytest.raises(ValueError, match="bad num_cpus"):
        ray_setup.init_ray()


def test_ray_start_runs_init_in_a_thread_and_answers_with_its_info(fake_ray, monkeypatch):
    fake = fake_ray()
    threads = []
    monkeypatch.setattr(fake, "init", lambda **kw: threads.append(__import__("threading").current_thread().name)
                        or FakeRay.init(fake, **kw))
    start = ray_setup.RayStart(log_to_driver=False)
    assert start.result() == ray_setup.RayInfo("127.0.0.1:8265", "/tmp/s/logs")
    assert threads == ["rlray-ray-start"]
    assert fake.calls[0]["log_to_driver"] is False  # rlray train without -v: workers' output stays in Ray's files


def test_ray_start_raises_inits_error_on_the_callers_thread(fake_ray, monkeypatch):
    fake = fake_ray()
    monkeypatch.setattr(fake, "init", lambda **_: (_ for _ in ()).throw(ConnectionError("port 6379 taken")))
    start = ray_setup.RayStart()
    with pytest.raises(ConnectionError, match="port 6379 taken"):
        start.result()


def test_a_cancelled_start_shuts_the_ray_it_started_down(fake_ray, monkeypatch):
    fake = fake_ray()
    shutdowns = []
    monkeypatch.setattr(fake, "is_initialized", lambda: bool(fake.calls) and not shutdowns, raising=False)
    monkeypatch.setattr(fake, "shutdown", lambda: shutdowns.append(1), raising=False)
    start = ray_setup.RayStart()
    start.cancel()
    assert len(fake.calls) == 1 and shutdowns == [1]


def test_with_ray_already_running_nothing_is_started_or_stopped(fake_ray, monkeypatch):
    fake = fake_ray()
    monkeypatch.setattr(fake, "is_initialized", lambda: True)
    monkeypatch.setattr(fake, "shutdown", lambda: pytest.fail("the caller's Ray was shut down"), raising=False)
    monkeypatch.setattr(ray_setup.ray, "_private", type("P", (), {"worker": type("W", (), {"_global_node": None})}),
                        raising=False)
    start = ray_setup.RayStart()
    start.cancel()
    assert start.result() == ray_setup.RayInfo("", "") and fake.calls == []


def test_rays_off_main_thread_note_is_dropped_and_others_kept():
    note = ray_setup._NotMainThreadNote()
    record = lambda msg: __import__("logging").LogRecord("ray._private.worker", 30, "f", 1, msg, (), None)  # noqa: E731
    assert not note.filter(record("SIGTERM handler is not set because current thread is not the main thread."))
    assert note.filter(record("Started a local Ray instance."))
