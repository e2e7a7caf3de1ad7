"""The demo's task as a gym-style environment whose step takes 50 ms, as a tool, a sandbox or a simulator would:
one reply per episode, rewarded 1.0 when it is exactly the sum.

    twinplane train agent.entrypoint=examples/agents/addition_env.py:Addition
    twinplane train agent.entrypoint=examples/agents/addition_env.py:Addition cluster.max_staleness=2

While the environments wait, the engine has little to do; with `cluster.max_staleness=2` the trainer trains
meanwhile on episodes that ended earlier.
"""

import time


class Addition:
    step_seconds = 0.05

    def reset(self, task: dict) -> str:
        self.answer = task["answer"]
        return task["prompt"]

    def step(self, action: str) -> tuple[str, float, bool]:
        time.sleep(self.step_seconds)  # (a plain method: twinplane runs it on a worker thread)
        return "", float(action.strip() == self.answer), True
