"""The demo's task as a chat agent with a tool: the model may call `add(a, b)`, reads the result, and answers;
rewarded 1.0 when the last number of its final answer is the sum.

For a chat model folder (`model.path=...`) whose chat template has a tools section (Qwen2.5 / Qwen3 Instruct,
Llama 3.1, ...): the demo's own character model has no chat template, so this agent does not run on it.

    twinplane train model.path=/models/Qwen2.5-0.5B-Instruct agent.entrypoint=examples/agents/calculator_tools.py:run
"""

import re

from openai import AsyncOpenAI

from twinplane.agents.tools import Tools


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first addend
        b: the second addend
    """
    return a + b


TOOLS = Tools(add)
CLIENT = AsyncOpenAI(base_url="http://unused/v1", api_key="none")  # one connection pool for every episode
SYSTEM = "Work out the sum. You may call the add tool. End with the number alone."


async def run(base_url: str, task: dict) -> dict:
    client = CLIENT.with_options(base_url=base_url)  # (each episode talks to its own session)
    prompt = task["prompt"]
    messages = [{"role": "system", "content": SYSTEM},
                *(prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}])]
    calls = 0
    for _ in range(4):
        r = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS.schemas,
                                                 max_tokens=128)
        reply = r.choices[0].message  # sent back as returned (calls included): the session extends, no split
        messages.append(reply.model_dump(include={"role", "content", "tool_calls"}, exclude_none=True))
        if not reply.tool_calls:
            break
        messages += [await TOOLS.acall(call) for call in reply.tool_calls]  # bad calls answer "error: ..."
        calls += len(reply.tool_calls)
    numbers = re.findall(r"\d+", reply.content or "")
    right = bool(numbers) and int(numbers[-1]) == int(task["answer"])
    return {"reward": float(right), "metrics": {"tool_calls": calls}}
