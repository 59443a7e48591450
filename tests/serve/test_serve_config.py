"""ServeConfig: validation, JSON round trip and the Ray Serve options it passes through (no Ray needed)."""

import pytest

from aitune.errors import ConfigError
from aitune.serve import ServeConfig

BASE = {"builder": "pkg.models:build", "checkpoint": "model.ait"}


def test_defaults_give_one_cpu_replica_and_batch_derived_ongoing_requests():
    options = ServeConfig(**BASE).ray_options(max_batch_rows=8)
    assert options == {"name": "aitune", "ray_actor_options": {"num_cpus": 1.0, "num_gpus": 0.0},
                       "max_ongoing_requests": 16, "num_replicas": 1}
    assert ServeConfig(**BASE).ray_options(max_batch_rows=1)["max_ongoing_requests"] == 8


def test_gpu_resources_autoscaling_and_health_pass_through():
    config = ServeConfig(**BASE, num_gpus=0.5, num_cpus=2, resources={"accelerator_type_h200": 0.5},
                         autoscaling={"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8},
                         max_ongoing_requests=32, health_check_period_s=2.0, health_check_timeout_s=5.0)
    options = config.ray_options(max_batch_rows=8, runtime_env={"working_dir": "/tmp/x"})
    assert options["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 0.5,
                                            "resources": {"accelerator_type_h200": 0.5},
                                            "runtime_env": {"working_dir": "/tmp/x"}}
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8}
    assert "num_replicas" not in options
    assert options["max_ongoing_requests"] == 32
    assert options["health_check_period_s"] == 2.0 and options["health_check_timeout_s"] == 5.0


def test_round_trip_through_json_data():
    config = ServeConfig(**BASE, pad_values={"input_ids": 0}, num_replicas=2, on_mismatch="eager")
    assert ServeConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("change, field", [
    ({"builder": "no_colon"}, "builder"),
    ({"device": "tpu"}, "device"),
    ({"on_mismatch": "maybe"}, "on_mismatch"),
    ({"out_of_range": "clip"}, "out_of_range"),
    ({"max_batch_size": 0}, "max_batch_size"),
    ({"num_gpus": -1}, "num_gpus"),
    ({"pad_values": {"input_ids": "zero"}}, "pad_values"),
    ({"route_prefix": "api"}, "route_prefix"),
    ({"num_replicas": 2, "autoscaling": {"max_replicas": 3}}, "num_replicas or autoscaling"),
    ({"health_min_calls": 0}, "health_min_calls"),
])
def test_invalid_fields_name_themselves(change, field):
    with pytest.raises(ConfigError, match=field):
        ServeConfig(**{**BASE, **change})


def test_unknown_field_is_named():
    with pytest.raises(ConfigError, match="replicas"):
        ServeConfig.from_dict({**BASE, "replicas": 2})
