"""The demo's task in two turns: when the first answer is wrong the agent says so ("==") and asks again, in the same
session, so the episode is one sample (the model's two answers trained, the feedback masked). Reward: 1.0 for a
right first answer, 0.5 for a right second one.

    twinplane train agent.entrypoint=examples/agents/addition_two_turns.py:run
"""

from openai import AsyncOpenAI

CLIENT = AsyncOpenAI(base_url="http://unused/v1", api_key="none")


async def run(base_url: str, task: dict) -> dict:
    client = CLIENT.with_options(base_url=base_url)
    first = (await client.completions.create(model="policy", prompt=task["prompt"], max_tokens=8)).choices[0].text
    if first.strip() == task["answer"]:
        return {"reward": 1.0, "metrics": {"first_right": 1.0}}
    again = task["prompt"] + first + "==" + task["prompt"]  # (the demo's alphabet is digits, + and =)
    second = (await client.completions.create(model="policy", prompt=again, max_tokens=8)).choices[0].text
    return {"reward": 0.5 * (second.strip() == task["answer"]), "metrics": {"first_right": 0.0}}
