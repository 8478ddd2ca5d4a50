"""cluster.yaml passes the Ray cluster launcher's own schema and starts what raypar needs."""
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_cluster_yaml_validates_against_ray_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    # What `ray up` does before launching: fill defaults, then check against Ray's schema.
    validate_config(prepare_config(config))
    setup = " ".join(config["setup_commands"])
    assert "raypar" in setup and "[gpu]" in setup
    gpu = config["available_node_types"]["gpu_8x"]
    assert gpu["min_workers"] <= gpu["max_workers"] <= config["max_workers"]
    starts = " ".join(config["head_start_ray_commands"] + config["worker_start_ray_commands"])
    assert "--metrics-export-port" in starts
