"""verifiers environments (prime-intellect's `verifiers`, `pip install 'twinplane[verifiers]'`), trained through the
session endpoint: verifiers runs each episode with its own harness, whose model calls it relays to the episode's
session, then scores the trace with the task's rewards.

    # an agent file, e.g. reverse_text_agent.py (`agent.entrypoint=reverse_text_agent.py:run`)
    from twinplane.agents.verifiers_adapter import verifiers_agent

    run = verifiers_agent("reverse-text", env={"agent": {"harness": {"id": "null"}}})

- `taskset` is the taskset's id as verifiers names it (`vf-eval <id>`): an installed package exporting its
  `Taskset`. `env` is verifiers' env config as a dict, what `--env.*` sets (`{"agent": {"harness": {"id":
  "null"}}}` is `--env.agent.harness.id null`); the harness is the taskset's default unless it says otherwise
  (the taskset's own, else verifiers' `bash`). Every role's runtime defaults to `subprocess` (this machine)
  where verifiers' default is a remote sandbox.
- Each episode's task is the data row: its fields fill the task's data (`prompt`, `system` as `system_prompt`, and
  any field the task's data declares, e.g. `answer`); `data.train_file` holds the rows.
- The reward is the episode's traces' reward (the weighted sum of the task's `@vf.reward`s); each reward's score
  and each `@vf.metric` is a metric (`agent/<name>`). An episode verifiers reports as failed (its harness or
  a model call failed) raises with verifiers' error, so it counts in `agent/errors` and trains nothing.
- verifiers' harnesses speak the chat API: the run needs a chat model (`model.path` with a chat template). Its
  chat programs run through `uv`, as verifiers runs them (the first episode prepares the program's
  environment, from the package index, once).
"""

from __future__ import annotations

import copy
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from twinplane.errors import InputError, first_line

EXTRA = "pip install 'twinplane[verifiers]'"
MODEL = "policy"  # the model name the harness sends; the session serves any
KEY_VAR = "TWINPLANE_VERIFIERS_API_KEY"  # unset: the session needs no key, and no Prime key is read or sent


def _verifiers():
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise InputError(f"verifiers environments need the verifiers package ({EXTRA}): {first_line(e)}") from None
    return vf


def verifiers_agent(taskset: str, env: Mapping[str, Any] | None = None) -> Callable[[str, dict], Awaitable[dict]]:
    """An agent (`run(base_url, task)`) whose episodes are episodes of verifiers' env for `taskset`, configured
    by `env` (verifiers' env config, as `--env.*` sets it)."""
    vf = _verifiers()
    config = env_config(vf, taskset, env or {})
    try:
        base = vf.load_environment(config)
    except Exception as e:  # (verifiers' own errors: a taskset that is not installed, a bad harness id)
        raise InputError(f"verifiers environment {taskset!r}: {first_line(e, typed=True)}") from None

    async def run(base_url: str, task: dict) -> dict:
        episode_env = copy.copy(base)  # serving() keeps its servers on the env: one copy per episode
        client = vf.EvalClientConfig(base_url=base_url, api_key_var=KEY_VAR)
        async with episode_env.serving():
            episode = await episode_env.run_episode(make_task(base, task), vf.ModelContext(model=MODEL, client=client))
        return episode_result(episode)

    run.__name__ = f"verifiers_{taskset}"
    return run


def env_config(vf, taskset: str, overrides: Mapping[str, Any]):
    """verifiers' env config for `taskset` with `overrides`, each role running in a subprocess unless they say."""
    if not isinstance(taskset, str) or not taskset:
        raise InputError(f"verifiers_agent: the taskset must be its id (a non-empty string), got {taskset!r}")
    data = merged({"taskset": {"id": taskset}}, dict(overrides))
    try:
        roles = vf.resolve_env_config(copy.deepcopy(data))
        local = {name: {"runtime": {"type": "subprocess"}} for name, value in roles if isinstance(value,
                                                                                                  vf.AgentConfig)}
        return vf.resolve_env_config(merged(local, data))
    except Exception as e:  # (pydantic's validation errors, verifiers' loaders' errors)
        raise InputError(f"verifiers environment {taskset!r}: {first_line(e, typed=True)}") from None


def merged(base: dict, over: Mapping) -> dict:
    """`over` laid over `base`, nested dicts merged key by key."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), dict) \
            else value
    return out


def make_task(env, row: dict):
    """The data row as the taskset's task: the fields its data declares, `system` as `system_prompt`, and the
    taskset's configured system prompt over both (as iterating the taskset applies it)."""
    task_cls = type(env.taskset).task_type()
    data_cls = task_cls.data_type()
    fields = {k: v for k, v in row.items() if k in data_cls.model_fields}
    if row.get("system") and "system_prompt" in data_cls.model_fields:
        fields.setdefault("system_prompt", row["system"])
    if env.taskset.system_prompt is not None:
        fields["system_prompt"] = env.taskset.system_prompt
    return task_cls(data_cls.model_validate(fields), env.taskset.config.task)


def episode_result(episode) -> dict:
    """A finished episode -> `{"reward", "metrics"}`; a failed one raises verifiers' error."""
    if not episode.ok:
        errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
        why = f"{errors[-1].type}: {errors[-1].message}" if errors else "no trace completed"
        raise RuntimeError(f"verifiers episode failed: {first_line(ValueError(why))}")
    metrics: dict[str, float] = {}
    for trace in episode.traces:
        metrics |= {k: float(r.score) for k, r in trace.rewards.items() if r is not None}
        metrics |= {k: float(v) for k, v in trace.metrics.items() if v is not None}
    return {"reward": float(sum(t.reward for t in episode.traces)), "metrics": metrics}
