"""Resources per role, the fit check before anything starts, and per-actor core lists."""

from __future__ import annotations

import pytest

from rlray.config import ConfigError, config_from_dict
from rlray.cores import plan_cores, split_cores
from rlray.launch.actors import rollout_cpu_threads
from rlray.launch.placement import (
    PlacementError,
    RoleRequest,
    check_fit,
    role_requests,
)
from rlray.plan import resolve_plan
from rlray.run.build import core_plan


def test_defaults_fit_two_rollouts_two_learners_and_a_reward_replica_on_two_cpus():
    cfg = config_from_dict({
        "resources": {"rollout": {"num_workers": 2}, "learner": {"num_workers": 2}, "reference": {"placement": "actor"}},
        "reward": {"server": {"enabled": True}},
    })
    reqs = role_requests(resolve_plan(cfg))
    assert [(r.role, r.count, r.per_worker) for r in reqs] == [
        ("rollout", 2, {"CPU": 0.25}), ("learner", 2, {"CPU": 0.25}), ("reward", 1, {"CPU": 0.25}),
        ("reference", 1, {"CPU": 0.25}),
    ]
    check_fit(reqs, {"CPU": 2.0}, [{"CPU": 2.0}])  # 0.5 + 0.5 + 0.25 + 0.25 = 1.5 <= 2


def test_roles_that_are_off_ask_for_nothing():
    cfg = config_from_dict({"algo": {"kl_coef": 0.0}, "resources": {"reference": {"placement": "actor"}}})
    assert [r.role for r in role_requests(resolve_plan(cfg))] == ["rollout", "learner"]


def test_a_teacher_actor_asks_for_its_resources_and_a_learner_teacher_for_none():
    cfg = config_from_dict({"teacher": {"path": "tiny-random@1"}, "algo": {"kl_coef": 0.0},
                            "resources": {"teacher": {"placement": "actor", "cpus": 0.5, "gpus": 1}}})
    assert [(r.role, r.count, r.per_worker) for r in role_requests(resolve_plan(cfg))][2:] == [("teacher", 1, {"CPU": 0.5, "GPU": 1})]
    on_learner = config_from_dict({"teacher": {"path": "tiny-random@1"}, "algo": {"kl_coef": 0.0}})
    assert [r.role for r in role_requests(resolve_plan(on_learner))] == ["rollout", "learner"]
    off = config_from_dict({"algo": {"kl_coef": 0.0}, "resources": {"teacher": {"placement": "actor"}}})
    assert [r.role for r in role_requests(resolve_plan(off))] == ["rollout", "learner"]  # no teacher.path: no actor


def test_custom_resources_join_each_role_request():
    cfg = config_from_dict({"algo": {"kl_coef": 0.0}, "resources": {
        "rollout": {"num_workers": 2, "custom_resources": {"rollout_node": 1}},
        "learner": {"custom_resources": {"learner_node": 1}}}})
    assert [(r.role, r.per_worker) for r in role_requests(resolve_plan(cfg))] == [
        ("rollout", {"CPU": 0.25, "rollout_node": 1}), ("learner", {"CPU": 0.25, "learner_node": 1})]
    # two rollout nodes of 1 rollout_node each fit; one node offering it does not
    nodes = [{"CPU": 2.0}, {"CPU": 1.0, "rollout_node": 1.0}, {"CPU": 1.0, "rollout_node": 1.0, "learner_node": 1.0}]
    check_fit(role_requests(resolve_plan(cfg)), {"CPU": 4.0, "rollout_node": 2.0, "learner_node": 1.0}, nodes)
    with pytest.raises(PlacementError) as err:
        check_fit(role_requests(resolve_plan(cfg)), {"CPU": 4.0, "rollout_node": 1.0}, [{"CPU": 2.0}, {"CPU": 2.0, "rollout_node": 1.0}])
    assert "together they want {CPU: 0.75, learner_node: 1, rollout_node: 2}, but the cluster has " \
           "{CPU: 4, GPU: 0, learner_node: 0, rollout_node: 1}" in str(err.value)
    assert "one learner worker ({CPU: 0.25, learner_node: 1}) fits on no single node" in str(err.value)


def test_tensor_parallel_multiplies_rollout_gpus():
    cfg = config_from_dict({"resources": {"rollout": {"num_workers": 2, "gpus": 1, "tensor_parallel_size": 4}}})
    assert role_requests(resolve_plan(cfg))[0].per_worker == {"CPU": 0.25, "GPU": 4}


def test_a_request_that_does_not_fit_names_each_role_and_the_cluster():
    reqs = [RoleRequest("rollout", 4, {"CPU": 0.5, "GPU": 1}), RoleRequest("learner", 2, {"CPU": 1.0, "GPU": 1})]
    with pytest.raises(PlacementError) as err:
        check_fit(reqs, {"CPU": 16.0, "GPU": 4.0}, [{"CPU": 8.0, "GPU": 2.0}, {"CPU": 8.0, "GPU": 2.0}])
    msg = str(err.value)
    assert "rollout wants 4 x {CPU: 0.5, GPU: 1} = {CPU: 2, GPU: 4}" in msg
    assert "learner wants 2 x {CPU: 1, GPU: 1} = {CPU: 2, GPU: 2}" in msg
    assert "together they want {CPU: 4, GPU: 6}, but the cluster has {CPU: 16, GPU: 4}" in msg


def test_a_bundle_larger_than_every_node_is_named():
    reqs = [RoleRequest("rollout", 1, {"CPU": 1.0, "GPU": 4})]
    with pytest.raises(PlacementError, match=r"one rollout worker \({CPU: 1, GPU: 4}\) fits on no single node"):
        check_fit(reqs, {"CPU": 16.0, "GPU": 4.0}, [{"CPU": 8.0, "GPU": 2.0}, {"CPU": 8.0, "GPU": 2.0}])


def test_split_cores():
    assert split_cores(2, [0, 1]) == ["0", "1"]
    assert split_cores(1, [0, 1]) == ["0-1"]
    assert split_cores(2, [0, 1, 2, 3, 4]) == ["0-1", "2-4"]
    assert split_cores(3, [0, 1]) == ["0", "1", "0"]
    assert split_cores(1, [0, 2, 3]) == ["0,2,3"]


def test_rollout_cpu_threads_per_actor():
    one = config_from_dict({"resources": {"rollout": {"num_workers": 2, "cpu_threads": "0-1"}}})
    assert rollout_cpu_threads(resolve_plan(one)) == ["0-1", "0-1"]
    each = config_from_dict({"resources": {"rollout": {"num_workers": 2, "cpu_threads": ["1", "0"]}}})
    assert rollout_cpu_threads(resolve_plan(each)) == ["1", "0"]
    with pytest.raises(ConfigError, match=r"cpu_threads=\['0'\] has 1 entries for resources.rollout.num_workers=2"):
        config_from_dict({"resources": {"rollout": {"num_workers": 2, "cpu_threads": ["0"]}}})
    with pytest.raises(ConfigError, match=r"cpu_threads='0-x' is not a core list"):
        config_from_dict({"resources": {"rollout": {"cpu_threads": "0-x"}}})
    assert config_from_dict({"resources": {"rollout": {"cpu_threads": "nobind"}}}).resources.rollout.cpu_threads == "nobind"


def test_learner_cpu_affinity_is_checked_like_the_rollout_cores():
    cfg = config_from_dict({"resources": {"learner": {"num_workers": 2}}, "learner": {"cpu_affinity": ["0", "1"]}})
    assert cfg.learner.cpu_affinity == ["0", "1"]
    with pytest.raises(ConfigError, match=r"learner.cpu_affinity=\['0'\] has 1 entries for resources.learner.num_workers=2; "
                                          r"give one core list per worker"):
        config_from_dict({"resources": {"learner": {"num_workers": 2}}, "learner": {"cpu_affinity": ["0"]}})
    with pytest.raises(ConfigError, match=r"learner.cpu_affinity='auto' is not a core list; use e.g. '0', '0-1' or '0,2-3'"):
        config_from_dict({"learner": {"cpu_affinity": "auto"}})  # 'auto'/'nobind' are vLLM words, not the learner's


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ({"learner": {"optimizer": "adamw_8bit"}}, "learner.optimizer='adamw_8bit' runs on CUDA only"),
        ({"rollout": {"weight_sync": "nccl"}}, "rollout.weight_sync='nccl' needs GPUs on rollout and learner"),
        ({"resources": {"colocate": True}}, "resources.colocate=true shares GPUs"),
    ],
)
def test_gpu_only_options_fail_at_load_naming_the_key(tree, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(tree)


def test_weight_sync_auto_resolves_by_placement():
    assert config_from_dict({}).weight_sync_backend == "object_store"
    gpu = {"rollout": {"gpus": 1}, "learner": {"gpus": 1}}
    assert config_from_dict({"resources": gpu}).weight_sync_backend == "nccl"
    shared = {"rollout": {"gpus": 0.4}, "learner": {"gpus": 0.5}, "colocate": True}
    assert config_from_dict({"resources": shared}).weight_sync_backend == "ipc"


@pytest.mark.ray
def test_training_that_cannot_fit_fails_before_any_actor_starts(ray_session, tmp_path):
    import ray

    from rlray.launch.driver import resolve_paths, run_training

    cfg = config_from_dict({
        "run": {"output_dir": str(tmp_path)}, "tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/m.db"},
        "resources": {"rollout": {"num_workers": 8, "cpus": 1.0}},
        "data": {"prompt_column": "question"}, "reward": {"functions": [{"function": "gsm8k_correct"}]},
    })
    with pytest.raises(PlacementError, match=r"rollout wants 8 x {CPU: 1} = {CPU: 8}") as err:
        run_training(resolve_plan(resolve_paths(cfg)))  # a plan, taken as it is (a config is resolved the same way)
    cpus = ray.cluster_resources()["CPU"]
    assert f"together they want {{CPU: {8 + 0.25:g}}}, but the cluster has {{CPU: {cpus:g}, GPU: 0}}" in str(err.value)
    with pytest.raises(ValueError):
        ray.get_actor("rlray:rollout-0")
    assert not (tmp_path / "m.db").exists()  # no MLflow run was created either


def test_sync_runs_give_every_stage_all_cores():
    plan = plan_cores([0, 1], rollout_actors=1, learner_workers=1, rollout_on_gpu=False, learner_on_gpu=False,
                      overlap=False)
    assert (plan.rollout, plan.learner_threads, plan.learner_cores) == (["0-1"], 2, None)
    two = plan_cores(list(range(16)), rollout_actors=2, learner_workers=4, rollout_on_gpu=False, learner_on_gpu=False,
                     overlap=False)
    assert (two.rollout, two.learner_threads, two.learner_cores) == (["0-7", "8-15"], 4, None)


def test_async_on_cpu_splits_the_cores_between_the_stages_from_eight_cores():
    plan = plan_cores(list(range(16)), rollout_actors=1, learner_workers=1, rollout_on_gpu=False, learner_on_gpu=False,
                      overlap=True)
    assert (plan.rollout, plan.learner_threads, plan.learner_cores) == (["8-15"], 8, ["0-7"])
    odd = plan_cores(list(range(9)), rollout_actors=2, learner_workers=1, rollout_on_gpu=False, learner_on_gpu=False,
                     overlap=True)
    assert (odd.rollout, odd.learner_threads, odd.learner_cores) == (["5-6", "7-8"], 5, ["0-4"])
    for n in (1, 2, 7):  # too few cores: shared, as a synchronous run
        few = plan_cores(list(range(n)), rollout_actors=1, learner_workers=1, rollout_on_gpu=False,
                         learner_on_gpu=False, overlap=True)
        assert (few.learner_threads, few.learner_cores) == (n, None) and "async on" in few.why


@pytest.mark.parametrize(("cores", "rollout_gpu", "learner_gpu", "actors", "workers", "rollout", "threads"), [
    (96, True, True, 4, 4, ["0-23", "24-47", "48-71", "72-95"], 24),  # an 8-GPU node: 4 engines, 4 learner ranks
    (16, True, True, 1, 1, ["0-15"], 16),  # one GPU node, colocated
    (32, True, False, 2, 1, ["0-15", "16-31"], 32),  # rollout on GPU, a CPU learner: nothing to share
    (32, False, True, 1, 2, ["0-31"], 16),
])
def test_gpu_node_shapes_never_split_the_cores_between_stages(cores, rollout_gpu, learner_gpu, actors, workers,
                                                              rollout, threads):
    for overlap in (False, True):
        plan = plan_cores(list(range(cores)), rollout_actors=actors, learner_workers=workers,
                          rollout_on_gpu=rollout_gpu, learner_on_gpu=learner_gpu, overlap=overlap)
        assert (plan.rollout, plan.learner_threads, plan.learner_cores) == (rollout, threads, None)


def test_plan_cores_refuses_no_cores():
    with pytest.raises(ValueError, match="cores=\\[\\]"):
        plan_cores([], rollout_actors=1, learner_workers=1, rollout_on_gpu=False, learner_on_gpu=False, overlap=False)


def test_settings_given_by_hand_win_over_the_plan():
    sync = config_from_dict({})
    assert sync.learner.torch_threads is None
    plan = core_plan(sync, [0, 1])
    assert (plan.rollout, plan.learner_threads, plan.learner_cores) == (["0-1"], 2, None)
    asy = config_from_dict({"rollout": {"max_staleness": 1}})
    plan = core_plan(asy, list(range(8)))
    assert (plan.rollout, plan.learner_threads, plan.learner_cores) == (["4-7"], 4, ["0-3"])
    threads = config_from_dict({"rollout": {"max_staleness": 1}, "learner": {"torch_threads": 3}})
    assert core_plan(threads, list(range(8))).learner_threads == 3
    pinned = config_from_dict({"learner": {"cpu_affinity": "0"}, "resources": {"rollout": {"cpu_threads": "1"}}})
    plan = core_plan(pinned, [0, 1])
    assert (plan.rollout, plan.learner_threads, plan.learner_cores) == (["1"], 1, ["0"])
    rollout_only = config_from_dict({"rollout": {"max_staleness": 1}, "resources": {"rollout": {"cpu_threads": "1"}}})
    plan = core_plan(rollout_only, list(range(8)))  # the rollout's cores by hand: the learner is not pinned against them
    assert (plan.rollout, plan.learner_threads, plan.learner_cores) == (["1"], 8, None)
    assert rollout_cpu_threads(resolve_plan(asy)) == core_plan(asy).rollout


def _model_folder(tmp_path, **config):
    import json

    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_auto_kv_cache_holds_one_actors_share_of_a_step(tmp_path):
    from rlray.launch.actors import auto_kv_cache_gib, kv_bytes_per_token

    smollm2 = _model_folder(tmp_path, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    assert kv_bytes_per_token(smollm2, "float32") == 2 * 30 * 3 * 64 * 4 == 46080
    assert kv_bytes_per_token(smollm2, "bfloat16") == 23040
    cfg = config_from_dict({"model": {"dtype": "float32"}, "learner": {"prompts_per_step": 4, "sequences_per_minibatch": 16},
                            "rollout": {"samples_per_prompt": 4}, "eval": {"num_problems": 0}})
    # 16 sequences x 320 tokens x 46080 B x 1.25 = 0.2747 GiB -> 18/64 GiB
    assert auto_kv_cache_gib(resolve_plan(cfg), smollm2, 320) == 18 / 64
    two = cfg.model_copy(deep=True)
    two.resources.rollout.num_workers = 2  # half the sequences each: 0.1373 GiB -> 9/64
    assert auto_kv_cache_gib(resolve_plan(two), smollm2, 320) == 9 / 64
    one = config_from_dict({"model": {"dtype": "float32"}, "learner": {"prompts_per_step": 1, "sequences_per_minibatch": 2,
                                                                "sequences_per_microbatch": 2},
                            "rollout": {"samples_per_prompt": 2}, "eval": {"num_problems": 0}})
    # two sequences of 330 -> 336 tokens (whole blocks) x 1.25 = 0.036 GiB -> 3/64
    assert auto_kv_cache_gib(resolve_plan(one), smollm2, 330) == 3 / 64
    set_by_hand = config_from_dict({"rollout": {"kv_cache_gib": 0.5}})
    assert auto_kv_cache_gib(resolve_plan(set_by_hand), smollm2, 320) == 0.5


def test_auto_kv_cache_of_a_model_without_its_attention_shape_is_one_gib(tmp_path):
    from rlray.launch.actors import DEFAULT_KV_CACHE_GIB, auto_kv_cache_gib

    assert DEFAULT_KV_CACHE_GIB == 1.0
    assert auto_kv_cache_gib(resolve_plan(config_from_dict({})), _model_folder(tmp_path, hidden_size=8), 64) == 1.0
    assert auto_kv_cache_gib(resolve_plan(config_from_dict({})), str(tmp_path / "missing"), 64) == 1.0
    with pytest.raises(ConfigError, match="kv_cache_gib"):
        config_from_dict({"rollout": {"kv_cache_gib": 0}})


@pytest.mark.parametrize(("tree", "key"), [({"learner": {"torch_threads": 0}}, "learner.torch_threads"),
                                           ({"learner": {"torch_threads": "two"}}, "learner.torch_threads"),
                                           ({"rollout": {"kv_cache_gib": -1}}, "rollout.kv_cache_gib")])
def test_bad_thread_and_kv_cache_values_name_the_key(tree, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        config_from_dict(tree)


def test_rollout_nodes_name_a_node_per_actor_and_release_their_placement_group(ray_session):
    import ray
    from ray.util import placement_group_table

    from rlray.launch.placement import rollout_nodes

    cfg = config_from_dict({"resources": {"rollout": {"num_workers": 2}, "placement_timeout_s": 5}})
    before = {pg_id for pg_id, pg in placement_group_table().items() if pg["state"] != "REMOVED"}
    nodes = rollout_nodes(resolve_plan(cfg))
    assert nodes == [ray.get_runtime_context().get_node_id()] * 2  # the session's one node, for each actor
    mine = [pg for pg_id, pg in placement_group_table().items() if pg_id not in before and pg["name"].startswith("rlray:rollout:")]
    assert mine and all(pg["state"] == "REMOVED" for pg in mine)  # nothing stays reserved: a lost node is not rescheduled

    too_big = config_from_dict({"resources": {"rollout": {"num_workers": 1, "custom_resources": {"absent_node": 1}},
                                              "placement_timeout_s": 1}})
    with pytest.raises(PlacementError, match=r"rollout placement group \(1 x {CPU: 0.25, absent_node: 1}, PACK\) was not "
                                             r"ready within resources.placement_timeout_s=1 s"):
        rollout_nodes(resolve_plan(too_big))


@pytest.mark.parametrize(("tree", "shares_node", "overlap", "why"), [
    ({}, True, False, "synchronous"),
    ({"rollout": {"max_staleness": 1}}, True, False, "share this node's cores"),
    ({"rollout": {"max_staleness": 1}}, False, True, "other nodes"),
    ({"rollout": {"max_staleness": 1, "overlap": "on"}}, True, True, "rollout.overlap=on"),
    ({"rollout": {"max_staleness": 2, "overlap": "off"}}, False, False, "rollout.overlap=off"),
    ({"rollout": {"max_staleness": 1}, "resources": {"rollout": {"gpus": 1}}}, True, True, "a stage on GPU"),
    ({"rollout": {"max_staleness": 1}, "resources": {"learner": {"gpus": 1}}}, True, True, "a stage on GPU"),
])
def test_rollout_overlap_is_on_only_where_the_stages_have_their_own_hardware(tree, shares_node, overlap, why):
    from rlray.run.build import rollout_overlap

    cfg = config_from_dict(tree)
    got, reason = rollout_overlap(cfg, core_plan(cfg, cores=[0, 1]), shares_node=shares_node)
    assert got is overlap and why in reason


def test_rollout_overlap_follows_the_core_split_of_the_plan():
    from rlray.run.build import rollout_overlap

    cfg = config_from_dict({"rollout": {"max_staleness": 1}})
    assert rollout_overlap(cfg, core_plan(cfg, cores=list(range(16))), shares_node=True) == (
        True, "the stages have their own cores")  # 16 cores: the plan splits them 8 / 8
    assert rollout_overlap(cfg, core_plan(cfg, cores=list(range(4))), shares_node=True)[0] is False
    by_hand = config_from_dict({"rollout": {"max_staleness": 1}, "resources": {"rollout": {"cpu_threads": "1"}},
                                "learner": {"cpu_affinity": "0"}})
    assert rollout_overlap(by_hand, core_plan(by_hand, cores=[0, 1]), shares_node=True)[0] is True


def test_a_bad_rollout_overlap_names_the_key_and_the_choices():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"rollout": {"overlap": "maybe"}})
    assert "rollout.overlap" in str(err.value) and "'auto', 'on' or 'off'" in str(err.value)


def test_rollout_overlap_on_and_off_as_yaml_reads_them(tmp_path):
    from rlray.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  max_staleness: 1\n  overlap: on\n")  # YAML 1.1: an unquoted on is True
    assert load_config(path).rollout.overlap == "on"
    assert load_config(path, ["rollout.overlap=off"]).rollout.overlap == "off"
    assert load_config(path, ["rollout.overlap=auto"]).rollout.overlap == "auto"


def test_judges_ask_for_their_replicas_each():
    cfg = config_from_dict({"algo": {"kl_coef": 0.0}, "reward": {"judges": [{"path": "tiny-random"}, {"path": "x", "name": "g"}]},
                            "resources": {"judge": {"replicas": 2, "cpus": 0.5, "gpus": 0.5}}})
    assert [(r.role, r.count, r.per_worker) for r in role_requests(resolve_plan(cfg))][2:] == [("judge", 4, {"CPU": 0.5, "GPU": 0.5})]
