"""The warm start's schedule and its progress check: the decay waits for the check, up to the step cap; the check
is greedy decoding's exact-match rate, compared here with token-by-token greedy decoding."""

import math

import torch
from conftest import tiny_model

from twinplane.data.tasks.arithmetic import ArithmeticTask
from twinplane.train.sft import Schedule, greedy_match, warm_start


def test_schedule_by_hand():
    s = Schedule(warmup=2, decay_from=6, decay_steps=4)
    assert [s(0), s(1), s(2), s(5), s(6)] == [0.5, 1.0, 1.0, 1.0, 1.0]
    assert math.isclose(s(8), 0.1 + 0.9 * 0.5) and math.isclose(s(10), 0.1) and s.total == 10
    s.decay_from = 9  # held: still at the peak where it would have decayed
    assert s(8) == 1.0 and math.isclose(s(11), 0.1 + 0.9 * 0.5) and s.total == 13


def test_greedy_match_equals_step_by_step_greedy_decoding():
    model = tiny_model(3)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 50, (n,), generator=g).tolist() for n in (3, 5, 5, 4, 2, 6)]
    greedy = []
    for p in prompts:  # brute force: one token at a time from the full sequence
        ids = list(p)
        for _ in range(3):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        greedy.append(ids[len(p):])
    wrong_last = [r[:2] + [(r[2] + 1) % 50] for r in greedy]
    # rows 0-2 right, 3-5 wrong in their last token; shorter right answers (a prefix) count too
    responses = greedy[:3] + wrong_last[3:]
    assert greedy_match(model, prompts, responses, pad_id=0) == 0.5
    assert greedy_match(model, prompts, [r[:1] for r in greedy], pad_id=0) == 1.0
    assert not model.training


def pairs(n: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 50, (4,), generator=g).tolist() for _ in range(n)], \
        [torch.randint(3, 50, (3,), generator=g).tolist() for _ in range(n)]


def test_decay_waits_for_the_check_up_to_the_cap():
    prompts, responses = pairs(32)
    answers = iter([0.1, 0.2, 0.95, 0.97])  # the last: the end-of-run report

    def run(check, target, max_steps):
        model = tiny_model(0)
        seen = []
        out = warm_start(model, prompts, responses, 20, 8, 1e-3, 0, seed=0, warmup_steps=2, check=check,
                         target=target, max_steps=max_steps, check_every=5,
                         on_step=lambda i, loss: seen.append(i) and False)
        return out, seen, model

    fixed, _, m0 = run(None, 0.0, None)
    assert fixed.steps == 20 and fixed.held == 0 and fixed.learned and fixed.progress is None
    passes, _, m1 = run(lambda: 1.0, 0.9, 100)  # passes when the decay is due: the same run as without a check
    assert passes.losses == fixed.losses and passes.held == 0 and passes.progress == 1.0
    assert all(torch.equal(a, b) for a, b in zip(m0.parameters(), m1.parameters(), strict=True))
    held, seen, _ = run(lambda: next(answers), 0.9, 100)  # fails at steps 14 and 19, passes at 24
    assert held.held == 10 and held.steps == 30 and held.learned and held.progress == 0.97
    assert seen == list(range(1, 31))
    assert held.losses[:14] == fixed.losses[:14]
    capped, _, _ = run(lambda: 0.0, 0.9, 27)  # never passes: the decay starts so that the run ends at the cap
    assert capped.steps == 27 and capped.held == 7 and not capped.learned and capped.progress == 0.0


def test_carry_free_problems_have_no_carry():
    task = ArithmeticTask(2, 100, seed=0)
    probe = task.carry_free(256, seed=1)
    assert len(probe) == 256 and len({p.prompt for p in probe}) == 256
    held = {p.prompt for p in task.heldout()}
    for p in probe:
        a, b = int(p.prompt[:2]), int(p.prompt[3:5])
        assert a % 10 + b % 10 < 10 and a // 10 + b // 10 < 10 and int(p.answer) == a + b
        assert p.prompt not in held
