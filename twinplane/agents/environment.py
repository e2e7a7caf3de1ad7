"""Gym-style environments, driven through the same session endpoint as any agent.

`agent.entrypoint=FILE.py:Class` may name a class with

    reset(self, task: dict) -> str                              the first observation
    step(self, action: str) -> tuple[str, float, bool]          (observation, reward, done)

(plain methods run on a worker thread, `async` ones on the agents' loop). Each episode makes a fresh instance;
the policy's reply to each observation is the action. With a chat template the observations are user turns and the
replies assistant turns; without one (the demo's model) the text simply grows: observation, reply, next
observation... The episode's reward is the sum of the step rewards (each also in `agent/step_reward_mean`); it ends
when the environment says done or after `agent.max_turns` replies, and then the instance's `close()` runs if it has
one. An OpenEnv `Environment` class is played the same way through twinplane.agents.openenv_adapter.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import ssl

import httpx

from twinplane.agents.openenv_adapter import is_openenv, openenv_environment


def is_environment(obj) -> bool:
    return inspect.isclass(obj) and callable(getattr(obj, "reset", None)) and callable(getattr(obj, "step", None))


async def _call(fn, *args):
    """`fn(*args)`: a plain method on a worker thread (an environment that blocks must not stop the other
    episodes), an `async` one on the agents' loop."""
    out = await asyncio.to_thread(fn, *args) if not inspect.iscoroutinefunction(fn) else fn(*args)
    return await out if inspect.isawaitable(out) else out


def environment_agent(env_class, chat: bool, max_turns: int, max_tokens: int):
    """An agent (`run(base_url, task)`) that plays `env_class`'s episodes with the policy."""
    if is_openenv(env_class):
        env_class = openenv_environment(env_class)

    async def run(base_url: str, task: dict) -> dict:
        env = env_class()
        try:
            return await _play(env, base_url, task)
        finally:
            if callable(getattr(env, "close", None)):
                await _call(env.close)

    async def _play(env, base_url: str, task: dict) -> dict:
        observation = await _call(env.reset, task)
        messages, text, rewards = [{"role": "user", "content": observation}], observation, []
        # A client per episode (one pool of hundreds of connections is slow to search), all sharing one TLS
        # context (its creation, loading the CA store, would cost more than the episode's calls).
        async with httpx.AsyncClient(base_url=base_url, timeout=None, verify=_tls()) as http:
            for _ in range(max_turns):
                if chat:
                    body = {"model": "policy", "messages": messages, "max_tokens": max_tokens}
                    reply = (await _post(http, "/chat/completions", body))["choices"][0]["message"]["content"] or ""
                else:
                    body = {"model": "policy", "prompt": text, "max_tokens": max_tokens}
                    reply = (await _post(http, "/completions", body))["choices"][0]["text"]
                observation, reward, done = await _call(env.step, reply)
                rewards.append(float(reward))
                if done:
                    break
                messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": observation}]
                text += reply + observation
        return {"reward": sum(rewards), "metrics": {"step_reward_mean": sum(rewards) / max(len(rewards), 1),
                                                    "env_steps": float(len(rewards))}}

    run.__name__ = f"play_{env_class.__name__}"
    return run


@functools.cache
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()


async def _post(http: httpx.AsyncClient, route: str, body: dict) -> dict:
    r = await http.post(route, json=body)
    if r.status_code != 200:
        raise RuntimeError(f"{route}: {r.status_code} {r.text[:200]}")
    return r.json()
