"""A session's bookkeeping without a server: extension, splits, the budget's cut, the routing record's length."""

import torch

from twinplane.rollout.sequence import Sample
from twinplane.serving.sessions import Session
from twinplane.tokenizer import build_char_tokenizer

TOK = build_char_tokenizer("0123456789+=ab")


def sample(prompt, out, layers=2):
    n = len(prompt) + len(out)
    routing = torch.arange(n * layers, dtype=torch.int16).view(n, layers, 1)
    routing[-1] = -1  # (the last sampled token never ran)
    return Sample(0, prompt, out, [-0.5] * len(out), "stop", 3, routing=routing)


def test_extension_split_budget_cut_and_routing():
    s = Session("s", TOK, budget=10)
    ids, left = s.prompt(text="1+1=")
    assert ids == TOK.encode("1+1=") and left == 10
    s.record(sample(ids, TOK.encode("2") + [TOK.eos_token_id]), "2<eos>", "<eos>")
    ids, left = s.prompt(text="1+1=2ab")  # the client never saw <eos>: it stays, "ab" is appended
    assert ids == TOK.encode("1+1=2") + [TOK.eos_token_id] + TOK.encode("ab") and left == 6
    s.record(sample(ids, TOK.encode("33")), "33")
    ids, left = s.prompt(text="1+1=2ab33aaaaaa")  # 6 more tokens: the budget ends after 4 of them
    t = s.current
    assert left == 0 and t.spent and t.finish_reason == "length" and len(t.token_ids) == 10
    assert t.loss_mask == [1, 1, 0, 0, 1, 1, 0, 0, 0, 0] and t.logprobs[2:4] == [0.0, 0.0]
    s.record(Sample(0, ids, [], [], "length", 3), "")  # the spent call generated nothing
    out = s.samples(7)[0]
    assert out.request_index == 7 and out.num_turns == 3 and out.finish_reason == "length"
    assert out.routing.shape[0] == len(out.prompt_ids) + len(out.token_ids)
    assert (out.routing[-4:] == -1).all() and (out.routing[:-5] >= 0).all()
    assert s.prompt(text="something else")[1] == 0 and s.splits == 0  # spent: no new sample either
    fresh = Session("f", TOK)
    fresh.prompt(text="1+1=")
    fresh.record(sample(TOK.encode("1+1="), TOK.encode("2")), "2")
    fresh.prompt(text="2+2=")  # does not extend: a new sample
    assert fresh.splits == 1 and len(fresh.trajectories) == 2 and len(fresh.samples(0)) == 1
