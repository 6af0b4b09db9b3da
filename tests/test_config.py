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


def test_range_check_names_key_value_and_range():
    from megarl.utils.dataclass_config import check_number

    check_number("a", 0.5, gt=0, le=1)
    check_number("a", 3, ge=1, integer=True)
    for value, needle in [(1.5, r"a=1.5 is invalid; valid range: \(0, 1\]"), (0, r"a=0 is invalid"),
                          (float("nan"), r"a=nan .*a finite number"), (float("-inf"), r"a=-inf .*a finite number"),
                          (True, r"a=True .*a finite number"), ("x", r"a='x'")]:
        with pytest.raises(ValueError, match=needle):
            check_number("a", value, gt=0, le=1)
    with pytest.raises(ValueError, match=r"a=2.5 is invalid; valid range: >= 1 \(an integer\)"):
        check_number("a", 2.5, ge=1, integer=True)


@pytest.mark.parametrize("override,match", [
    ("rollout.top_p=0", r"rollout.top_p=0.0 is invalid; valid range: \(0, 1\]"),
    ("rollout.temperature=.nan", r"rollout.temperature=nan is invalid; valid range: >= 0 \(a finite number"),
    ("trainer.lr=-1e-5", r"trainer.lr=-1e-05 is invalid; valid range: >= 0"),
    ("trainer.adam_beta2=1", r"trainer.adam_beta2=1.0 is invalid; valid range: \[0, 1\)"),
    ("grpo.clip_eps_high=-0.1", r"grpo.clip_eps_high=-0.1 is invalid; valid range: >= 0"),
    ("sft.batch_size=0", r"sft.batch_size=0 is invalid; valid range: >= 1"),
    ("seed=-1", r"seed=-1 is invalid; valid range: \[0, "),
    ("model.hidden_size=0", r"model.hidden_size=0 is invalid; valid range: >= 1"),
    ("model.rope_theta=.inf", r"model.rope_theta=inf is invalid"),
    ("watchdog.timeout_s=.nan", r"watchdog.timeout_s=nan is invalid"),
    ("task.tail_alpha=0", r"task.tail_alpha=0.0 is invalid; valid range: > 0"),
    ("parallel.weight_sync_bucket_mb=.inf", r"parallel.weight_sync_bucket_mb=inf is invalid"),
])
def test_section_ranges(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_sft_lr_may_be_zero_only_without_sft():
    assert load_config(None, ["sft.steps=0", "sft.lr=0"]).sft.lr == 0
    with pytest.raises(ConfigError, match=r"sft.lr=0.0 is invalid; valid range: > 0"):
        load_config(None, ["sft.steps=5", "sft.lr=0"])


@pytest.mark.parametrize("content,match", [
    (b"", r"c.yaml is empty; give it at least one key"),
    (b"# only a comment\n", r"c.yaml is empty"),
    (b"rollout:\n  top_k: [1\n", r"c.yaml:3:1: not valid YAML"),
    (b"\x00\x01binary", r"c.yaml: not valid YAML \(character '\\x00' at offset 0: not a text file\)"),
    (b"\xff\xfe\x00", r"c.yaml is not a text file \(not UTF-8: byte 0xff at offset 0\)"),
    (b"just a string\n", r"c.yaml must hold a mapping of config keys at top level, got a str"),
])
def test_unreadable_config_file_is_named(tmp_path, content, match):
    p = tmp_path / "c.yaml"
    p.write_bytes(content)
    with pytest.raises(ConfigError, match=match):
        load_config(p)


def test_config_path_that_is_a_directory(tmp_path):
    with pytest.raises(ConfigError, match=r"does not exist \(it is a directory\)"):
        load_config(tmp_path)


def test_override_value_that_is_not_yaml():
    with pytest.raises(ConfigError, match=r"rollout is a section: set its keys one by one"):
        load_config(None, ["rollout=[1"])
    with pytest.raises(ConfigError, match=r"""quote it for a string, e.g. --set 'data.system_prompt="\[a"'"""):
        load_config(None, ["data.system_prompt=[a"])
    assert load_config(None, ['data.system_prompt="[a"']).data.system_prompt == "[a"
