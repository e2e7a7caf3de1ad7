"""Loading a config: YAML (safe-loaded) and dotted overrides, coerced to each key's type, paths made absolute,
unknown keys answered with the key most likely meant; and `config_help`, what `twinplane train --help` lists."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from pathlib import Path
from typing import Literal

import yaml

from twinplane.config.keys import _all_keys, _fields, _settings, choices, help_text
from twinplane.config.sections import Config, ConfigError
from twinplane.errors import first_line


def _coerce(value, t, key: str):
    """Check/convert one value to the annotated type; YAML and CLI strings both arrive here."""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is Literal:  # the value's type here; whether it is one of the choices is `validate`'s to say
        return _coerce(value, type(args[0]), key)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key)
    if t is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if t is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if t is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if t is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if t is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {t}")


# What a bare name most likely means, and other RL trainers' names (TRL, verl) -> (twinplane's key, a note where
# the meaning differs).
_UPPER = "algo.clip_high bounds the ratio above 1"
ALIASES = {
    "steps": ("train.steps", ""), "lr": ("train.lr", ""), "temperature": ("rollout.temperature", ""),
    "n": ("rollout.n", ""), "learning_rate": ("train.lr", ""), "max_steps": ("train.steps", ""),
    "total_training_steps": ("train.steps", ""),
    "num_train_epochs": ("train.steps", "twinplane counts RL steps, not epochs"),
    "total_epochs": ("train.steps", "twinplane counts RL steps, not epochs"),
    "per_device_train_batch_size": ("train.micro_batch_size", ""),
    "ppo_micro_batch_size_per_gpu": ("train.micro_batch_size", ""),
    "gradient_accumulation_steps": ("train.micro_batch_size", "micro-batches of this size are accumulated into "
                                    "each optimizer step"),
    "ppo_mini_batch_size": ("train.mini_batches", "a number of mini-batches per rollout batch, not a size"),
    "ppo_max_token_len_per_gpu": ("train.max_tokens_per_micro_batch", ""),
    "train_batch_size": ("rollout.prompts_per_step", ""), "num_generations": ("rollout.n", ""),
    "max_completion_length": ("rollout.max_new_tokens", ""), "max_response_length": ("rollout.max_new_tokens", ""),
    "response_length": ("rollout.max_new_tokens", ""), "max_prompt_length": ("data.max_prompt_tokens", ""),
    "beta": ("algo.kl_coef", ""), "kl_loss_coef": ("algo.kl_coef", ""), "kl_loss_type": ("algo.kl_estimator", ""),
    "use_kl_in_reward": ("algo.kl_in_reward", ""), "epsilon": ("algo.clip_low", _UPPER),
    "epsilon_high": ("algo.clip_high", ""), "clip_ratio": ("algo.clip_low", _UPPER),
    "clip_ratio_low": ("algo.clip_low", ""), "clip_ratio_high": ("algo.clip_high", ""),
    "clip_ratio_c": ("algo.clip_c", ""), "cliprange": ("algo.clip_low", _UPPER),
    "cliprange_value": ("critic.value_clip", ""), "entropy_coeff": ("algo.entropy_coef", ""),
    "loss_agg_mode": ("algo.loss_agg", ""), "loss_type": ("algo.name", ""),
    "scale_rewards": ("algo.norm_adv_by_std", ""), "norm_adv_by_std_in_grpo": ("algo.norm_adv_by_std", ""),
    "mask_truncated_completions": ("algo.mask_truncated", ""), "importance_sampling_level": ("algo.policy_loss", ""),
    "max_grad_norm": ("train.grad_clip", ""), "lr_scheduler_type": ("train.schedule", ""),
    "gradient_checkpointing": ("train.activation_checkpointing", ""),
    "enable_gradient_checkpointing": ("train.activation_checkpointing", ""), "bf16": ("train.compute_dtype", ""),
    "model_name_or_path": ("model.path", ""), "train_files": ("data.train_file", ""),
    "val_files": ("data.val_file", ""), "prompt_key": ("data.prompt_field", ""), "reward_funcs": ("reward.name", ""),
    "output_dir": ("run_dir", ""), "save_steps": ("checkpoint.every", ""), "save_freq": ("checkpoint.every", ""),
    "save_total_limit": ("checkpoint.keep", ""), "logging_steps": ("log.every", ""), "eval_steps": ("eval.every", ""),
    "test_freq": ("eval.every", ""), "val_before_train": ("eval.before", ""), "report_to": ("log.backends", ""),
    "vllm_gpu_memory_utilization": ("rollout.gpu_memory_utilization", ""),
    "n_gpus_per_node": ("cluster.train_devices", ""),
    "lora_r": ("train.lora.rank", ""), "lora_rank": ("train.lora.rank", ""), "lora_alpha": ("train.lora.alpha", ""),
    "lora_dropout": ("train.lora.dropout", ""), "lora_target_modules": ("train.lora.targets", ""),
    "target_modules": ("train.lora.targets", ""),
    "loss_mode": ("algo.policy_loss", "verl's vanilla is ppo, geo_mean is gmpo"), "tau_pos": ("algo.sapo_tau_pos", ""),
    "tau_neg": ("algo.sapo_tau_neg", ""), "rollout_is": ("algo.is_weight", ""),
    "rollout_is_threshold": ("algo.tis_cap", ""),
    "rollout_rs": ("algo.is_mask", "verl's token_k1, seq_sum_k1, seq_mean_k1 are token, sequence, geometric"),
    "rollout_rs_threshold": ("algo.is_low", "verl's lo_hi bounds pi_rollout / pi_old: here algo.is_low = 1 / hi, "
                             "algo.is_high = 1 / lo"),
}


# Keys twinplane no longer has -> (the hint an unknown key gets: what to write instead, the value that changed
# nothing). A run's saved config.yaml lists every key it was run with: see `without_removed`.
REMOVED = {
    "cluster.async": ("did you mean cluster.max_staleness=1?", False),
    "rollout.tp": ("tensor-parallel engines are not in this version: each engine holds the whole model", 1),
}


def without_removed(saved: dict, where: str) -> dict:
    """A run's saved config (`where`: its file) without the keys twinplane has removed since, each where it holds
    the value that changed nothing; one that changed the run is the error an unknown key gets."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in saved.items()}
    for key, (hint, inert) in REMOVED.items():
        section, leaf = key.split(".")
        node = out.get(section)
        if isinstance(node, dict) and leaf in node:
            if node[leaf] != inert:
                raise ConfigError(f"{where}: unknown key {key} ({hint})")
            del node[leaf]
    return out


def _did_you_mean(full: str) -> str:
    """The hint for an unknown key, first found of: what replaced a removed key; twinplane's key with the same last
    part in a similar section; a near-typo in the same section; what a bare or another trainer's name means here; a
    close key anywhere."""
    if full in REMOVED:
        return f" ({REMOVED[full][0]})"
    keys = _all_keys(Config)
    section, _, leaf = full.rpartition(".")

    def near(key: str) -> float:  # how close a key's section is to the one written
        return difflib.SequenceMatcher(None, section, key.rpartition(".")[0]).ratio()

    same = sorted((k for k in keys if k.rpartition(".")[2] == leaf), key=near, reverse=True)
    alias, note = ALIASES.get(leaf, (None, ""))
    typo = difflib.get_close_matches(leaf, [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == section],
                                     n=1, cutoff=0.8)
    if same and (near(same[0]) >= 0.6 or alias is None):
        hint = same[0]
    elif typo:
        hint = f"{section}.{typo[0]}" if section else typo[0]
    elif alias is not None:
        return f" (did you mean {alias}?{' ' + note if note else ''})"
    else:
        close = difflib.get_close_matches(full, keys, n=1, cutoff=0.6)
        hint = close[0] if close else ""
    return f" (did you mean {hint}?)" if hint else ""


def _build(cls, data: dict, prefix: str = ""):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        full, key = prefix + str(key), str(key)
        if key not in hints:
            while isinstance(value, dict) and value:  # an unknown section: name the key as written (trian.steps)
                sub, value = next(iter(value.items()))
                full += f".{sub}"
            raise ConfigError(f"unknown key {full}{_did_you_mean(full)}")
        t = hints[key]
        kwargs[key] = _build(t, value, full + ".") if dataclasses.is_dataclass(t) else _coerce(value, t, full)
    return cls(**kwargs)


# Keys naming files or folders to read. Relative paths in a config file are taken from the file's folder (so an
# example runs from any directory), on the command line from the current one; ${VAR} is read from the environment.
# They are kept absolute: errors, the run's config.yaml and a resume from elsewhere all name the same file.
PATH_KEYS = ("model.path", "data.train_file", "data.val_file", "reward.model", "critic.model_path")
URL_OR_PATH_KEYS = ("reward.judge",)  # a path made absolute, a URL left as it is
SPEC_KEYS = ("reward.name", "agent.entrypoint")  # module:function or path/file.py:function
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _absolute(value, key: str, base: Path):
    """An input path made absolute against `base`, after ${VAR} (a relative value of the variable counts from the
    current directory) and ~; a file spec (path/file.py:function: reward.name, agent.entrypoint) has its path part
    made absolute."""
    if not isinstance(value, str) or not value.strip():
        return value  # a wrong type or an empty path is `_coerce`'s and `validate`'s to report

    def env(m: re.Match) -> str:
        if m[1] not in os.environ:
            raise ConfigError(f"{key}: {value} uses ${{{m[1]}}}, which is not set in the environment")
        return os.path.abspath(os.path.expanduser(os.environ[m[1]]))

    text = _VAR.sub(env, value)
    if key in URL_OR_PATH_KEYS and text.startswith(("http://", "https://")):
        return text
    spec = key in SPEC_KEYS
    target, sep, function = text.rpartition(":") if spec else (text, "", "")
    if spec and not (target.endswith(".py") or "/" in target):  # a built-in or module:function
        return text
    return os.path.normpath(base / os.path.expanduser(target)) + sep + function


def _absolute_paths(data: dict, base: Path, skip: set[str]) -> None:
    """`_absolute` on the input paths of a config file's sections but `skip`, in place."""
    for key in (*PATH_KEYS, *SPEC_KEYS, *URL_OR_PATH_KEYS):
        section, leaf = key.split(".")
        if key not in skip and isinstance(data.get(section), dict) and leaf in data[section]:
            data[section][leaf] = _absolute(data[section][leaf], key, base)


def _merge(base: dict, dotted: str, value) -> None:
    parts = dotted.split(".")
    node = base
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {p} is not a section")
    node[parts[-1]] = value


def _is_text(key: str) -> bool:
    """Whether a key holds a string, an optional string or a choice of strings."""
    t = next((t for k, _, t, _ in _fields(Config) if k == key), None)
    if t is None or typing.get_origin(t) is list:
        return False
    union = typing.get_origin(t) in (typing.Union, types.UnionType)
    optional_str = union and set(typing.get_args(t)) == {str, type(None)}
    return t is str or optional_str or isinstance((choices(t) or [None])[0], str)


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = (), *, saved: bool = False) -> Config:
    """`saved`: `path` is a run's own config.yaml (`without_removed`)."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} " + ("is a folder" if path.is_dir() else "not found"))
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML ({first_line(e)})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of sections at the top level")
        if saved:
            data = without_removed(data, str(path))
    overridden = set()
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not key=value")
        if _is_text(key.strip()):  # `data.system_prompt=Answer: briefly` stays a string (YAML would see a mapping)
            value = None if raw in ("null", "~") else raw
        else:
            try:
                value = yaml.safe_load(raw) if raw else ""
            except yaml.YAMLError:
                value = raw
        if key.strip() in (*PATH_KEYS, *SPEC_KEYS, *URL_OR_PATH_KEYS):
            value = _absolute(value, key.strip(), Path.cwd())
            overridden.add(key.strip())
        _merge(data, key.strip(), value)
    if path is not None:  # the file's own paths (an overridden one may name an unset variable: it is not used)
        _absolute_paths(data, path.parent.absolute(), skip=overridden)
    cfg = _build(Config, data)
    cfg.validate(given={f"{s}.{k}" for s, v in data.items() if isinstance(v, dict) for k in v} | set(data))
    return cfg


def config_help() -> str:
    """Every key with its default and help text."""
    defaults = Config()
    return "\n".join(f"  {key} = {value!r}" + (f"  # {help_text(t, meta)}" if meta.get("help") else "")
                     for key, value, t, meta in _settings(defaults))
