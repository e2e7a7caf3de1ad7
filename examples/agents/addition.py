"""The demo's task through an agent written against the official `openai` client: one completion per episode,
rewarded 1.0 when the answer is exactly the sum.

    twinplane train agent.entrypoint=examples/agents/addition.py:run
"""

from openai import OpenAI

CLIENT = OpenAI(base_url="http://unused/v1", api_key="none")  # one connection pool for every episode


def run(base_url: str, task: dict) -> float:
    client = CLIENT.with_options(base_url=base_url)  # (each episode talks to its own session)
    out = client.completions.create(model="policy", prompt=task["prompt"], max_tokens=8)
    return float(out.choices[0].text.strip() == task["answer"])
