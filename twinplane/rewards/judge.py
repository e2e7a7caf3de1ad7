"""LLM judges: a reward function that takes a `judge` argument gets a client of an OpenAI-compatible model.

    def reward(completion: str, answer: str, prompt: str, judge) -> float:
        verdict = judge.ask(f"Question: {prompt}\\nAnswer: {completion}\\nReference: {answer}\\nCorrect? yes/no")
        return float(verdict.strip().lower().startswith("yes"))

`reward.judge` is the judge's base URL (`http://host:port/v1`, any OpenAI-compatible server), or a model folder
that the run serves itself, frozen, with the rollout engine's code (`twinplane serve`'s server, on 127.0.0.1).
The function runs in the reward worker process like every user reward; the judge client lives there too.

Limits: at most `reward.judge_concurrency` requests at once (`ask_many` runs a batch of questions on that many
threads; a per-sample function asks one at a time), each within `reward.judge_timeout_s`, retried
`reward.judge_retries` times on a connection error, a timeout or a 5xx answer. A judgement that still fails (or
gets another error answer) raises `JudgeError`. Its sample fails like any failing reward (0, counted in
`reward/errors`), or, with `reward.judge_failure_score` set, scores that instead; either way it counts in
`reward/judge_failures`. Answers are cached within a step (the same question is asked once per step; greedy by
default, so the cache changes nothing).
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import httpx


class JudgeError(RuntimeError):
    """A judgement that failed after its retries."""


FAILED = "judgement failed: "  # (the start of the error of a sample whose reward raised a JudgeError)


def failed_judgement(e: BaseException | None) -> bool:
    """Whether `e` is a JudgeError or was raised from one, or while handling one (a function that wraps it)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, JudgeError):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


@dataclass(frozen=True)
class JudgeSettings:
    url: str  # base URL of an OpenAI-compatible API (…/v1)
    model: str | None = None  # None: the first model the server lists
    api_key: str | None = None
    concurrency: int = 8
    timeout_s: float = 60.0
    retries: int = 2
    failure_score: float | None = None  # what a sample scores when its judgement fails; None: the sample fails

    def to_dict(self) -> dict:  # (sent to the reward worker)
        return asdict(self)


class Judge:
    def __init__(self, settings: JudgeSettings):
        self.s = settings
        headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
        self.http = httpx.Client(base_url=settings.url.rstrip("/"), timeout=settings.timeout_s, headers=headers,
                                 limits=httpx.Limits(max_connections=settings.concurrency))
        self.gate = threading.Semaphore(settings.concurrency)
        self.cache: dict[str, str] = {}
        self.lock = threading.Lock()
        self.model = settings.model
        self.calls = 0  # requests actually sent (cache misses), for metrics and tests

    def new_step(self) -> None:
        with self.lock:
            self.cache.clear()

    def ask(self, question: str | list[dict], max_tokens: int = 256, temperature: float = 0.0) -> str:
        """The judge's reply to `question` (a user message, or a whole chat as OpenAI messages)."""
        messages = [{"role": "user", "content": question}] if isinstance(question, str) else list(question)
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": temperature}
        key = json.dumps(body, sort_keys=True)
        with self.lock:
            if key in self.cache:
                return self.cache[key]
        with self.gate:
            reply = self._post("/chat/completions", body | {"model": self._model()})["choices"][0]["message"]
        text = reply.get("content") or ""
        with self.lock:
            self.cache[key] = text
        return text

    def ask_many(self, questions: list, **kw) -> list[str]:
        """`ask` for each question, `concurrency` at a time."""
        with ThreadPoolExecutor(self.s.concurrency) as pool:
            return list(pool.map(lambda q: self.ask(q, **kw), questions))

    def _model(self) -> str:
        if self.model is None:
            listed = self._post("/models", None)["data"]
            if not listed:
                raise JudgeError(f"judge {self.s.url}: /models lists no model")
            self.model = listed[0]["id"]
        return self.model

    def _post(self, route: str, body: dict | None) -> dict:
        last = "no attempt"
        for attempt in range(self.s.retries + 1):
            if attempt:
                time.sleep(min(0.5 * 2 ** (attempt - 1), 5.0))
            try:
                r = self.http.post(route, json=body) if body is not None else self.http.get(route)
                with self.lock:
                    self.calls += 1
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
                continue
            if r.status_code < 500:
                if r.status_code != 200:
                    raise JudgeError(f"judge {self.s.url}{route}: {r.status_code} {r.text[:200]}")
                return r.json()
            last = f"{r.status_code} {r.text[:200]}"
        raise JudgeError(f"judge {self.s.url}{route}: failed after {self.s.retries + 1} attempts ({last})")

    def close(self) -> None:
        self.http.close()
