"""The demo's task as a gym-style environment whose every step takes 50 ms, as a tool, a sandbox or a simulator
would: a wrong answer gets "==" and the question again, up to three tries; a right one scores 1.0 on the first try,
0.5 on the second, 0.25 on the third.

    twinplane train agent.entrypoint=examples/agents/addition_env.py:Addition
    twinplane train agent.entrypoint=examples/agents/addition_env.py:Addition cluster.max_staleness=2

While the environments wait, the engine has little to do; with `cluster.max_staleness=2` the trainer trains
meanwhile on episodes that ended earlier.
"""

import time


class Addition:
    step_seconds = 0.05
    tries = 3

    def reset(self, task: dict) -> str:
        self.prompt, self.answer, self.left = task["prompt"], task["answer"], self.tries
        return self.prompt

    def step(self, action: str) -> tuple[str, float, bool]:
        time.sleep(self.step_seconds)  # (a plain method: twinplane runs it on a worker thread)
        self.left -= 1
        if action.strip() == self.answer:
            return "", 0.5 ** (self.tries - 1 - self.left), True
        return "==" + self.prompt, 0.0, self.left == 0
