"""Reward names -> functions: the built-in verifiers, and user functions named `module:function` or
`path/to/file.py:function`. Also the one check of what a reward function returned."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from twinplane.rewards.code import unit_tests_pass
from twinplane.rewards.verifiers import VERIFIERS, format_ok

RewardFn = Callable[[Sequence[str], Sequence[str]], list[float]]  # batched: (completions, answers) -> rewards
# Options the framework reads itself; every other option is passed to the reward function as a keyword.
RESERVED = ("batched", "format_weight", "judge")  # options for the runner, not the function
# Built-ins that score a whole batch at once: `code` runs its programs concurrently in the sandbox.
BATCHED = {"code": unit_tests_pass}


def builtin_rewards() -> tuple[str, ...]:
    """The built-in rewards' names (`reward.name`'s choices besides a user function)."""
    return (*VERIFIERS, *BATCHED)


def to_reward(value: object) -> float:
    """A reward function's return value as a finite float. None, NaN, inf and non-numbers raise ValueError:
    they mean the function failed, and the caller scores the sample 0 rather than train on garbage."""
    if value is None:
        raise ValueError("reward function returned None")
    try:
        r = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"reward function returned {type(value).__name__}, not a number") from None
    if not math.isfinite(r):
        raise ValueError(f"reward function returned {r}")
    return r


def is_user_spec(name: str) -> bool:
    return ":" in name


def _is_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


def _import_file(path: Path):
    """Import a .py file under a private module name derived from its absolute path, so two files with the
    same stem never collide and re-loading the same file reuses the module."""
    path = path.resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no such file {str(path)!r}")
    name = f"_twinplane_reward_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {str(path)!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_user_fn(spec: str, what: str = "reward") -> Callable:
    """`module:function` (module importable from sys.path) or `path/to/file.py:function` -> the function.
    Any failure is a config error: a one-line ValueError naming the spec (as `what`'s: a reward, an agent)."""
    precheck_user_spec(spec, what)
    target, _, attr = spec.rpartition(":")
    try:
        obj = _import_file(Path(target)) if _is_file(target) else importlib.import_module(target)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except BaseException as e:  # SystemExit from a module that exits on import is a config error too
        if isinstance(e, KeyboardInterrupt):
            raise
        raise ValueError(f"{what} {spec!r}: cannot load ({_one_line(e)})") from None
    if not callable(obj):
        raise ValueError(f"{what} {spec!r}: {type(obj).__name__} is not callable")
    return obj


def precheck_user_spec(spec: str, what: str = "reward") -> None:
    """The checks that need no user code run: the file exists, the top-level module can be found. The runner
    does these in the trainer's process to fail in milliseconds; the full load happens in its worker."""
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ValueError(f"{what} {spec!r}: expected module:function or path/to/file.py:function")
    if _is_file(target):
        if not Path(target).is_file():
            raise ValueError(f"{what} {spec!r}: cannot load (no such file {target!r})")
    elif importlib.util.find_spec(target.split(".")[0]) is None:
        raise ValueError(f"{what} {spec!r}: cannot load (no module named {target.split('.')[0]!r})")


def absolute_spec(name: str) -> str:
    """Resolve a file spec's path against the current directory, so a worker started elsewhere finds it."""
    if not is_user_spec(name):
        return name
    target, _, attr = name.rpartition(":")
    if _is_file(target):
        return f"{Path(target).resolve()}:{attr}"
    return name


def resolve(name: str, options: dict | None = None) -> tuple[Callable, bool, dict]:
    """-> (function, batched, keyword options). Built-ins are per-sample; a user function is batched when
    options say `batched=True` or the function has `batched = True`. Unknown names and options the function
    does not accept raise ValueError here, before any sample is scored."""
    kwargs = {k: v for k, v in (options or {}).items() if k not in RESERVED}
    if is_user_spec(name):
        fn = load_user_fn(name)
        flag = (options or {}).get("batched")
        batched = bool(getattr(fn, "batched", False) if flag is None else flag)
    elif name in VERIFIERS or name in BATCHED:
        fn, batched = (VERIFIERS[name], False) if name in VERIFIERS else (BATCHED[name], True)
        if (options or {}).get("batched"):
            raise ValueError(f"reward {name!r}: 'batched' applies to user functions only")
    else:
        raise ValueError(f"unknown reward {name!r} (available: {', '.join(builtin_rewards())}, "
                         "module:function, path/to/file.py:function)")
    try:
        probe = ([""], [""]) if batched else ("", "")
        inspect.signature(fn).bind(*probe, **kwargs, **dict.fromkeys(extra_arguments(fn, batched)))
    except TypeError as e:
        raise ValueError(f"reward {name!r}: options {sorted(kwargs)} do not fit its signature ({e})") from None
    except ValueError:
        pass  # builtins without an introspectable signature: trust the options
    if name == "gsm8k" and kwargs.get("mode", "flexible") not in ("flexible", "strict"):
        raise ValueError(f"reward 'gsm8k': mode must be flexible or strict, got {kwargs['mode']!r}")
    return fn, batched, kwargs


def extra_arguments(fn: Callable, batched: bool) -> list[str]:
    """What a reward function takes besides completion and answer: `prompt` (`prompts`, batched) and `judge`
    (twinplane.rewards.judge), by name."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return []
    return [k for k in ("prompts" if batched else "prompt", "judge") if k in params]


def score(name: str, completions: Sequence[str], answers: Sequence[str], **options) -> list[float]:
    """Score completions against reference answers in this process, with no sandbox: exceptions propagate and
    a None/NaN reward raises ValueError (use `RewardRunner` for a training run, where they score 0).

    options: passed to the reward function as keywords (e.g. `mode="strict"` for gsm8k), except
    `format_weight` (adds w * format_ok for gsm8k/math) and `batched` (call a user function on the lists)."""
    if len(completions) != len(answers):
        raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
    fn, batched, kwargs = resolve(name, options)
    if batched:
        out = list(fn(list(completions), list(answers), **kwargs))
        if len(out) != len(completions):
            raise ValueError(f"reward {name!r} returned {len(out)} values for {len(completions)} samples")
        rewards = [to_reward(v) for v in out]
    else:
        rewards = [to_reward(fn(c, a, **kwargs)) for c, a in zip(completions, answers, strict=True)]
    w = float(options.get("format_weight", 0.0))
    if w:
        rewards = [r + w * (format_ok(name, c) or 0.0) for r, c in zip(rewards, completions, strict=True)]
    return rewards


def get_reward(name: str, **options) -> RewardFn:
    """A batched `(completions, answers) -> rewards` function for `name` (checked now, not at first call)."""
    resolve(name, options)

    def reward_fn(completions: Sequence[str], answers: Sequence[str]) -> list[float]:
        return score(name, completions, answers, **options)

    reward_fn.__name__ = f"reward_{name}"
    return reward_fn
