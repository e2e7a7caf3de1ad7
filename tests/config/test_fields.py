"""The config's own rules: choices from `Literal` types, ranges and help from field metadata, rules per section."""

import dataclasses
import typing

import pytest

from twinplane.algos import KL_ESTIMATORS, PRESETS
from twinplane.config import Config, ConfigError, config_help, load_config
from twinplane.config.keys import _fields, choices, interval, opt, value_problem, within

SETTINGS = _fields(Config)


def test_every_key_has_help():
    missing = [key for key, _, _, meta in SETTINGS if not meta.get("help", "").strip()]
    assert not missing, f"keys without help text: {missing}"
    text = config_help()
    for key, _, _, meta in SETTINGS:
        assert f"  {key} = " in text and meta["help"] in text


@pytest.mark.parametrize(("bounds", "inside", "outside"), [
    (">= 0", [0, 5], [-1, -1e-9]),
    ("> 0", [1e-9, 3], [0, -1]),
    ("[0, 1)", [0, 0.999], [1, -0.1]),
    ("(0, 1]", [1, 0.5], [0, 1.01]),
    ("[0, 1]", [0, 1], [-0.01, 1.01]),
    ("[0, 2**32)", [0, 2**32 - 1], [2**32, -1]),
    ("1..6", [1, 6], [0, 7]),
    ("0..1024 (0 = max_num_seqs)", [0, 1024], [-1, 1025]),
])
def test_ranges(bounds, inside, outside):
    assert all(within(v, bounds) for v in inside)
    assert not any(within(v, bounds) for v in outside)


def test_malformed_range_fails_at_definition():
    with pytest.raises(ValueError, match="not a range"):
        opt(1, "help", bounds="between 0 and 1")
    assert interval(">= 1 (a note)") == (1.0, True, float("inf"), False)


def test_choices_come_from_the_types():
    types = {key: t for key, _, t, _ in SETTINGS}
    assert choices(types["algo.kl_estimator"]) == tuple(KL_ESTIMATORS)  # (a registry's names: `OneOf`)
    assert choices(types["algo.name"]) == tuple(PRESETS)
    assert choices(types["model.rollout_dtype"]) == ("float32", "bfloat16", "float16")  # (`X | None`)
    assert choices(types["rollout.tools"]) == ("calculator", "python")  # (`list[X]`)
    assert choices(types["train.steps"]) is None


@pytest.mark.parametrize(("key", "bad", "message"), [
    ("algo.kl_estimator", "k9", "algo.kl_estimator: must be one of k1, k2, k3, abs, got 'k9'"),
    ("train.schedule", "linear", "train.schedule: must be constant, cosine or wsd, got 'linear'"),
    ("data.template", "html", "data.template: must be auto, chat or plain, got 'html'"),
    ("model.rollout_dtype", "int8", "model.rollout_dtype: must be float32, bfloat16 or float16, got 'int8'"),
    ("log.wandb_mode", "off", "log.wandb_mode: must be offline, online or disabled, got 'off'"),  # (not YAML's false)
    ("rollout.tools", "[calculator,shell]",
     "rollout.tools: must name calculator or python, got ['calculator', 'shell']"),
    ("algo.name", "grpo2", f"algo.name: must be one of {', '.join(PRESETS)}, got 'grpo2' (did you mean grpo?)"),
])
def test_a_wrong_choice_names_the_key_the_value_and_the_choices(key, bad, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{key}={bad}"])
    assert str(e.value) == message


def test_every_choice_key_refuses_a_value_outside_its_literal():
    keys = [(key, t) for key, _, t, _ in SETTINGS if choices(t) and typing.get_origin(t) is not list]
    assert len(keys) >= 15
    for key, t in keys:
        with pytest.raises(ConfigError, match=f"^{key}: must be .*{choices(t)[-1]}, got 'nope'$"):
            load_config(None, [f"{key}=nope"])


def _outside(bounds: str, integer: bool):
    lo, lo_in, hi, hi_in = interval(bounds)
    step = 1 if integer else 0.5
    return lo - step if lo_in else lo


def test_every_range_refuses_a_value_below_it():
    ranged = [(key, t, meta["bounds"]) for key, _, t, meta in SETTINGS if meta.get("bounds")]
    assert len(ranged) >= 60
    for key, t, bounds in ranged:
        bad = _outside(bounds, t is int)
        value = [0.9, bad] if typing.get_origin(t) is list else (int(bad) if t is int else bad)
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"{key}={value}"])
        say = "each be" if isinstance(value, list) else "be"
        assert str(e.value).startswith(f"{key}: must {say}{'' if bounds[0] in '<>' else ' in'} {bounds}, got"), e.value


def test_value_problem_reads_the_metadata():
    meta = {"bounds": "[0, 1)", "help": "x"}
    assert value_problem(0.5, float, meta) is None
    assert value_problem(1.0, float, meta) == "must be in [0, 1)"
    assert value_problem(float("nan"), float, meta) == "must be a finite number"
    assert value_problem([0.1, 2.0], list[float], meta) == "must each be in [0, 1)"
    assert value_problem(None, typing.Literal["a", "b"] | None, {}) is None


def test_the_defaults_keep_every_rule_and_every_rule_names_a_key():
    cfg = Config()
    keys = {key for key, *_ in SETTINGS}
    sections = [cfg] + [getattr(cfg, f.name) for f in dataclasses.fields(cfg) if dataclasses.is_dataclass(
        getattr(cfg, f.name))] + [cfg.train.lora]
    rules = [rule for section in sections for rule in section.rules(cfg)]
    assert len(rules) >= 30
    for ok, key, msg, *other in rules:  # (a rule across two keys also names the other and its message)
        assert ok and key in keys and msg, (key, msg)
        assert all(k in keys and m for k, m in other), other


def test_a_rule_across_sections_names_its_key():
    with pytest.raises(ConfigError, match=r"^train\.mini_batches: must divide rollout\.prompts_per_step"):
        load_config(None, ["rollout.prompts_per_step=6", "train.mini_batches=4"])
    with pytest.raises(ConfigError, match=r"^threads: must be <= 4096, got 5000$"):
        load_config(None, ["threads=5000"])
