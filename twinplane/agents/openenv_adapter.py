"""OpenEnv environments (`pip install 'twinplane[openenv]'`), played by the policy through the session endpoint.

`agent.entrypoint=MODULE:EnvClass` naming an OpenEnv `Environment` subclass runs it in this process, a fresh
instance per episode; `openenv_environment(EnvClass, ...)` in an agent file does the same with options, or
connects an `EnvClient` subclass to a running server (`base_url=`, one server session per episode). Either way
it becomes a gym-style class (twinplane.agents.environment):

- reset: `reset(seed=..., **task fields)`, each keyword passed only where `reset` takes it (as OpenEnv's server
  does). `seed` is the task's `seed` field, else a hash of the task: a prompt's episodes (its GRPO group) start
  from the same state, different prompts from different ones.
- the policy's reply becomes the Action: the Action type's only required string field holds the reply (an echo
  env's `message`, a coding env's `code`); an Action without exactly one such field is read from the reply as
  JSON (a dict action, a `GenericEnvClient`'s, too). A reply that makes no valid Action is not sent: the policy
  reads the error as the next observation, reward 0, and may try again (within `agent.max_turns`).
- an observation with a single field is that field's text; any other is its fields as JSON (`done`, `reward`
  and `metadata` left out, as OpenEnv's server leaves them out). `observation=` replaces this.
- each step's reward is the observation's (None counts 0), the episode ends when it is done.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import typing
import zlib
from collections.abc import Callable
from typing import Any

from twinplane.errors import InputError, first_line

HIDDEN = ("done", "reward", "metadata")  # what OpenEnv's server keeps out of an observation's fields
EXTRA = "pip install 'twinplane[openenv]'"


def is_openenv(cls) -> bool:
    """An OpenEnv Environment or EnvClient subclass (told without importing openenv)."""
    return inspect.isclass(cls) and any(b.__module__.startswith("openenv.") and b.__name__ in ("Environment",
                                                                                            "EnvClient")
                                        for b in cls.__mro__[1:])


def _openenv():
    try:
        from openenv.core.env_client import EnvClient
        from openenv.core.env_server.interfaces import Environment
    except ImportError as e:
        raise InputError(f"OpenEnv environments need openenv-core ({EXTRA}): {first_line(e)}") from None
    return Environment, EnvClient


def openenv_environment(env: type, *, base_url: str | None = None, action: Callable[[str], Any] | None = None,
                        observation: Callable[[Any], str] | None = None) -> type:
    """A gym-style class playing `env`: an OpenEnv `Environment` subclass (in this process, a fresh instance per
    episode, made with no arguments: wrap a constructor that needs some in a subclass) or an `EnvClient` subclass
    (a session per episode on the server at `base_url`). `action(reply) -> Action` and `observation(obs) -> str`
    replace the default mappings."""
    Environment, EnvClient = _openenv()
    if inspect.isclass(env) and issubclass(env, EnvClient):
        if base_url is None:
            raise InputError(f"agent.entrypoint: {env.__name__} is an OpenEnv client: give its server, "
                             f"openenv_environment({env.__name__}, base_url=...), in an agent file")
        session = _client_session(env, base_url)
    elif inspect.isclass(env) and issubclass(env, Environment):
        if base_url is not None:
            raise InputError(f"agent.entrypoint: {env.__name__} runs in this process; base_url is for an EnvClient")
        session = _local_session(env, Environment)
    else:
        raise InputError(f"agent.entrypoint: {env!r} is neither an OpenEnv Environment nor an EnvClient subclass")
    to_action = action or text_action(action_type(env, Environment, EnvClient))
    to_text = observation or observation_text

    class Played:
        async def reset(self, task: dict) -> str:
            self.env = await session()
            obs, _, _ = await self.env.reset(task)
            return to_text(obs)

        async def step(self, reply: str) -> tuple[str, float, bool]:
            try:
                act = to_action(reply)
            except ValueError as e:  # (pydantic's ValidationError and JSON's errors are ValueErrors)
                return f"invalid action: {describe(e)}", 0.0, False
            obs, reward, done = await self.env.step(act)
            return to_text(obs), float(reward or 0.0), bool(done)

        async def close(self) -> None:
            if hasattr(self, "env"):
                await self.env.close()

    Played.__name__ = Played.__qualname__ = f"OpenEnv_{env.__name__}"
    return Played


# --- the two kinds of OpenEnv environment, behind one async (reset, step, close) ---------------------------------

class _Local:
    """An Environment instance in this process. Plain methods run on a worker thread (the agents' event loop stays
    free), all on the loop's own thread for an environment that asks for a single thread."""

    def __init__(self, env, base: type, inline: bool):
        self.env, self.base, self.inline = env, base, inline

    def _method(self, name: str):
        """(the method, whether it is async): `name_async` where the class overrides it, as OpenEnv's server picks."""
        if getattr(type(self.env), f"{name}_async") is not getattr(self.base, f"{name}_async"):
            return getattr(self.env, f"{name}_async"), True
        return getattr(self.env, name), False

    async def _call(self, name: str, *args, **kwargs):
        fn, is_async = self._method(name)
        if is_async:
            return await fn(*args, **kwargs)
        return fn(*args, **kwargs) if self.inline else await asyncio.to_thread(fn, *args, **kwargs)

    async def reset(self, task: dict):
        obs = await self._call("reset", **accepted(self._method("reset")[0], reset_kwargs(task)))
        return obs, obs.reward, obs.done

    async def step(self, act):
        obs = await self._call("step", act)
        return obs, obs.reward, obs.done

    async def close(self) -> None:
        if self.inline:
            self.env.close()
        else:
            await asyncio.to_thread(self.env.close)


def _local_session(cls: type, base: type):
    inline = bool(getattr(cls, "REQUIRES_SINGLE_THREAD_EXECUTOR", False))

    async def open_() -> _Local:
        return _Local(cls() if inline else await asyncio.to_thread(cls), base, inline)
    return open_


class _Remote:
    """A client's session on an OpenEnv server (its WebSocket; the server filters reset's keywords itself)."""

    def __init__(self, client):
        self.client = client

    async def reset(self, task: dict):
        r = await self.client.reset(**reset_kwargs(task))
        return r.observation, r.reward, r.done

    async def step(self, act):
        r = await self.client.step(act)
        return r.observation, r.reward, r.done

    async def close(self) -> None:
        await self.client.close()


def _client_session(cls: type, base_url: str):
    async def open_() -> _Remote:
        client = cls(base_url=base_url)
        await client.connect()
        return _Remote(client)
    return open_


# --- text <-> OpenEnv types --------------------------------------------------------------------------------------

def reset_kwargs(task: dict) -> dict:
    """The task's fields and a seed shared by every episode of the task."""
    seed = task.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool):
        seed = zlib.crc32(json.dumps(task, sort_keys=True, default=str).encode()) & 0x7FFFFFFF
    return {**task, "seed": seed}


def accepted(fn, kwargs: dict) -> dict:
    """The keywords `fn` takes (all of them when it has **kwargs)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def action_type(cls: type, *bases: type):
    """The Action type `cls` steps with: its `step`'s annotation (`def step(self, action: EchoAction)`), else the
    type argument of its generic base (`Environment[EchoAction, ...]`, `EnvClient[EchoAction, ...]`)."""
    try:
        hint = typing.get_type_hints(cls.step).get("action")
    except Exception:  # (annotations that do not resolve: fall back to the generic base)
        hint = None
    if hint is not None and not isinstance(hint, typing.TypeVar):
        return hint
    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            origin = typing.get_origin(base)
            if inspect.isclass(origin) and issubclass(origin, bases) and typing.get_args(base):
                arg = typing.get_args(base)[0]
                if not isinstance(arg, typing.TypeVar):
                    return arg
    raise InputError(f"agent.entrypoint: cannot tell {cls.__name__}'s Action type: annotate its step's action "
                     "parameter, or pass action= to openenv_environment")


def text_action(kind) -> Callable[[str], Any]:
    """reply -> Action: the Action's only required string field, else the reply read as the Action's JSON."""
    if kind is dict or typing.get_origin(kind) is dict or (inspect.isclass(kind) and issubclass(kind, dict)):
        return _json_object
    fields = getattr(kind, "model_fields", None)
    if fields is None:
        raise InputError(f"agent.entrypoint: the Action type {kind!r} is neither a pydantic model nor a dict: "
                         "pass action= to openenv_environment")
    required = [name for name, f in fields.items() if f.is_required()]
    if len(required) == 1 and fields[required[0]].annotation is str:
        name = required[0]
        return lambda reply: kind(**{name: reply})
    return kind.model_validate_json


def _json_object(reply: str) -> dict:
    value = json.loads(reply)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {type(value).__name__}")
    return value


def observation_text(obs) -> str:
    """A single field's text, else the fields as JSON."""
    data = obs.model_dump(exclude=set(HIDDEN)) if hasattr(obs, "model_dump") else \
        {k: v for k, v in dict(obs).items() if k not in HIDDEN}
    if len(data) == 1:
        (value,) = data.values()
        return value if isinstance(value, str) else json.dumps(value, default=str)
    return json.dumps(data, default=str)


def describe(e: ValueError) -> str:
    """A bad action's error on one line: pydantic's first error with its field, else the message."""
    errors = getattr(e, "errors", None)
    if callable(errors):
        first = errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        return f"{where}: {first.get('msg', '')}" if where else str(first.get("msg", ""))
    return first_line(e)
