"""Config loading: unknown or ill-typed keys fail before any work, naming the key and the choices."""
from pathlib import Path

import pytest

from megarl.config import RunConfig, dump_config, load_config
from megarl.utils.dataclass_config import ConfigError


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_defaults_and_overrides(tmp_path):
    cfg = load_config(write(tmp_path, "rollout:\n  temperature: 0.7\n"),
                      ["rollout.top_k=5", "seed=7", "model.init_from_hf=null", "rollout.dtype=float64"])
    assert isinstance(cfg, RunConfig)
    assert cfg.rollout.temperature == 0.7 and cfg.rollout.top_k == 5 and cfg.seed == 7
    assert cfg.rollout.dtype == "float64" and cfg.model.init_from_hf is None
    # the dump reloads to the same config
    assert load_config(write(tmp_path, dump_config(cfg))) == cfg


def test_misspelt_key_names_key_and_choices(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, "rollout:\n  temperture: 0.7\n"))
    msg = str(e.value)
    assert "rollout.'temperture'" in msg and "did you mean 'temperature'" in msg and "top_p" in msg


def test_misspelt_override(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'rollout'"):
        load_config(None, ["rolout.temperature=0.5"])
    with pytest.raises(ConfigError, match="rollout.temperature is not a section"):
        load_config(None, ["rollout.temperature.x=0.5"])
    with pytest.raises(ConfigError, match="key.path=value"):
        load_config(None, ["rollout.temperature"])


def test_ill_typed_values(tmp_path):
    with pytest.raises(ConfigError, match="rollout.group_size: expected an integer, got 'eight'"):
        load_config(None, ["rollout.group_size=eight"])
    with pytest.raises(ConfigError, match=r"rollout.dtype: 'fp16' is not a valid choice; valid choices: \['float32'"):
        load_config(None, ["rollout.dtype=fp16"])
    with pytest.raises(ConfigError, match="progress: expected true/false"):
        load_config(None, ["progress=3"])
    with pytest.raises(ConfigError, match=r"rollout.group_size=0 is invalid; valid range: >= 2"):
        load_config(None, ["rollout.group_size=0"])
    with pytest.raises(ConfigError, match="trainer.lr: expected a number, got 'fast'"):
        load_config(None, ["trainer.lr=fast"])


def test_exponent_floats_without_a_dot():
    # YAML 1.1 (PyYAML) reads 1e-5 as a string; a float field must still take it.
    assert load_config(None, ["trainer.lr=1e-5"]).trainer.lr == 1e-5


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_shipped_configs_load():
    paths = sorted(Path("configs").glob("*.yaml"))
    assert {"tiny", "smoke", "tp2", "pp2", "dp2", "moe_ep2", "pp2vpp2", "disagg"} <= {p.stem for p in paths}
    for path in paths:
        load_config(path)
