"""Bad input fails at once with a message that names the problem and what would work."""
import subprocess
import sys
import time

import pytest

from raypar.config import ConfigError, load_config
from raypar.data import DataError
from raypar.resources import ResourceError, plan_resources
from raypar.topology import Grid
from raypar.driver.trainer import Trainer

from helpers import tiny_config


def test_more_stages_than_layers():
    with pytest.raises(ConfigError, match=r"parallel.pp=5 stages but the model has only model.n_layers=4.*pp <= 4"):
        load_config(None, ["model.n_layers=4", "parallel.pp=5"])


def test_microbatches_must_divide_the_batch():
    with pytest.raises(ConfigError, match=r"global_batch_size=10 is not divisible.*microbatches could be one of \[1, 2, 5, 10\]"):
        load_config(None, ["train.global_batch_size=10", "parallel.microbatches=4"])


@pytest.mark.parametrize("override, message", [
    ("parallel.ppp=2", r"unknown config key 'parallel.ppp'; valid keys at parallel: "),
    ("parallel.schedule=zb", r"parallel.schedule='zb' is not allowed; choose one of fthenb, 1f1b"),
    ("train.steps=many", r"train.steps must be an integer"),
    ("parallel.layers_per_stage=[3,2]", r"parallel.layers_per_stage has 2 entries but parallel.pp=1"),
    ("model.n_heads=3", r"model.dim=64 is not divisible by model.n_heads=3"),
    ("nosuch.key=1", r"unknown config key 'nosuch'"),
])
def test_config_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_yaml_words_on_off_yes_no_are_strings_for_choices_and_booleans_for_flags(tmp_path):
    """YAML 1.1 reads off / on / yes / no as booleans; a choice such as runtime.metrics=off
    must still mean the choice, in a file and in an override, and a flag still takes them."""
    path = tmp_path / "c.yaml"
    path.write_text("runtime:\n  metrics: off\n  kernels: no\ncheckpoint:\n  every: 2\n")
    cfg = load_config(path)
    assert cfg.runtime.metrics == "off" and cfg.runtime.kernels is False
    cfg = load_config(None, ["runtime.metrics=off", "runtime.kernels=on", "runtime.recompute=none"])
    assert cfg.runtime.metrics == "off" and cfg.runtime.kernels is True and cfg.runtime.recompute == "none"
    assert load_config(None, ["runtime.kernels=yes"]).runtime.kernels is True
    assert load_config(None, ["runtime.kernels=False"]).runtime.kernels is False
    with pytest.raises(ConfigError, match=r"runtime.metrics='yes' is not allowed; choose one of ray, standalone, off"):
        load_config(None, ["runtime.metrics=yes"])
    with pytest.raises(ConfigError, match=r"runtime.kernels must be true or false, got 'maybe'"):
        load_config(None, ["runtime.kernels=maybe"])


def test_explicit_split_must_cover_the_layers():
    with pytest.raises(ConfigError, match=r"layers_per_stage=\[3, 2\] sums to 5 but model.n_layers=4"):
        load_config(None, ["parallel.pp=2", "parallel.layers_per_stage=[3,2]"])
    with pytest.raises(ConfigError, match=r"layers_per_stage=\[1.5, 3\] sums to 4.5 but model.n_layers=4"):
        load_config(None, ["parallel.pp=2", "parallel.layers_per_stage=[1.5,3]"])


def test_an_explicit_split_counts_whole_and_half_layers():
    """[1.5, 2.5]: the cut between layer 1's attention and its MLP; whole counts stay integers."""
    assert load_config(None, ["parallel.pp=2", "parallel.layers_per_stage=[1.5,2.5]"]).parallel.layers_per_stage \
        == [1.5, 2.5]
    listed = load_config(None, ["parallel.pp=2", "parallel.layers_per_stage=[3,1]"]).parallel.layers_per_stage
    assert listed == [3, 1] and all(type(n) is int for n in listed)
    with pytest.raises(ConfigError, match=r"each count is whole or ends in .5 \(the cut between a layer's attention "
                                          r"and its MLP\), e.g. \[7.5, 6.5\]"):
        load_config(None, ["parallel.pp=2", "parallel.layers_per_stage=[1.25,2.75]"])
    with pytest.raises(ConfigError, match=r"every stage needs at least half a layer"):
        load_config(None, ["parallel.pp=2", "parallel.layers_per_stage=[0,4]"])


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_cluster_without_the_gpus_or_cpus_the_grid_needs(tmp_path):
    cfg = tiny_config(tmp_path, parallel={"pp": 4}, runtime={"device": "cuda", "cpus_per_worker": 1.0})
    with pytest.raises(ResourceError, match=r"needs 4 GPUs .* cluster has 0"):
        plan_resources(cfg, Grid(1, 4, 1), {"CPU": 8.0})
    cfg = tiny_config(tmp_path, parallel={"pp": 4}, runtime={"device": "auto", "cpus_per_worker": 1.0})
    with pytest.raises(ResourceError, match=r"needs 4 workers x runtime.cpus_per_worker=1.0 = 4 CPUs but the cluster has 2; set runtime.cpus_per_worker<=0.5"):
        plan_resources(cfg, Grid(1, 4, 1), {"CPU": 2.0})
    assert plan_resources(cfg, Grid(1, 4, 1), {"CPU": 4.0, "GPU": 4.0}).device == "cuda"


@pytest.mark.timeout(60)
def test_trainer_fails_fast_on_a_cluster_too_small(ray_session, tmp_path):
    cfg = tiny_config(tmp_path, parallel={"pp": 4}, runtime={"cpus_per_worker": 4.0})
    start = time.monotonic()
    with pytest.raises(ResourceError, match="CPUs but the cluster has 8"):
        Trainer(cfg).fit()
    assert time.monotonic() - start < 30


@pytest.mark.timeout(60)
def test_missing_data_file(tmp_path):
    cfg = tiny_config(tmp_path, data={"path": str(tmp_path / "missing.parquet")})
    with pytest.raises(DataError, match=r"data file not found: .*missing.parquet"):
        Trainer(cfg).fit()


@pytest.mark.timeout(60)
def test_cli_reports_errors_without_a_traceback(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "raypar.train", "model.n_layers=2", "parallel.pp=3",
         f"runtime.run_dir={tmp_path}"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2
    assert "raypar: error: parallel.pp=3 stages but the model has only model.n_layers=2" in out.stderr
    assert "Traceback" not in out.stderr
