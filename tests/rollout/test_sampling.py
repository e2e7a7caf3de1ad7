"""The engine's inverse-CDF sampler (`twinplane.rollout.sampling.inverse_cdf`) against a brute-force reference."""

import torch

from twinplane.rollout.sampling import CDF_CHUNK, SamplingParams, inverse_cdf, sample


def brute_force(weights: list[int], k: int) -> int:
    """The first token whose cumulative weight exceeds k/256 of the total (integers: no rounding anywhere)."""
    total, cum = sum(weights), 0
    for i, w in enumerate(weights):
        cum += w
        if 256 * cum > k * total:
            return i
    raise AssertionError("unreachable for k < 256")


def test_one_and_two_levels_equal_brute_force_where_sums_are_exact():
    """Integer weights and uniforms k/256 (sums and targets below 2^24 / 256: exact in fp32): every token must equal the
    brute-force one, in one chunk (V <= CDF_CHUNK) and over several, with zero runs, a whole chunk of zeros and a
    ragged last chunk."""
    g = torch.Generator().manual_seed(0)
    for V in (50, CDF_CHUNK, 3 * CDF_CHUNK + 17):
        w = torch.randint(0, 4, (64, V), generator=g)
        w[:, 5:40] = 0
        if V > CDF_CHUNK:
            w[:8, CDF_CHUNK:2 * CDF_CHUNK] = 0  # a chunk without mass
            w[8:16, :2 * CDF_CHUNK] = 0  # all mass in the last, ragged chunk
        k = torch.randint(0, 256, (64,), generator=g)
        k[:4] = torch.tensor([0, 255, 128, 1])
        got = inverse_cdf(w.float(), k.double() / 256).tolist()
        assert got == [brute_force(row, int(j)) for row, j in zip(w.tolist(), k, strict=True)], V


def test_zero_probability_tokens_are_never_chosen_even_at_u_near_one():
    """A uniform just below 1 rounds to 1.0 in fp32, so u * total can equal the total; the token must still be the
    last one with mass, never a zero-probability one after it (banned stop tokens sit at the vocabulary's end)."""
    u = torch.full((4,), 1 - 2.0**-40, dtype=torch.float64)
    for V in (50, 2 * CDF_CHUNK + 3):
        probs = torch.rand(4, V, generator=torch.Generator().manual_seed(V))
        last = torch.tensor([V - 10, V - 1, 3, CDF_CHUNK + 2 if V > CDF_CHUNK else 7])
        probs[torch.arange(V) > last[:, None]] = 0
        assert inverse_cdf(probs, u).tolist() == last.tolist()
        assert inverse_cdf(probs, torch.zeros(4, dtype=torch.float64)).tolist() == \
            (probs > 0).float().argmax(-1).tolist()  # u = 0: the first token with mass


def test_sampling_over_a_large_vocabulary_follows_the_distribution():
    """Over a vocabulary of several chunks, each token's frequency over a fine grid of uniforms equals its
    probability to within the grid's resolution (the inverse CDF's defining property); `sample` goes through it."""
    V, n = 3 * CDF_CHUNK + 5, 8192
    lp = torch.log_softmax(torch.randn(V, generator=torch.Generator().manual_seed(1)) * 3, -1)
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    tok = inverse_cdf(lp.exp().expand(n, V), u)
    freq = torch.bincount(tok, minlength=V).double() / n
    assert (freq - lp.exp().double()).abs().max() < 2.0 / n
    assert sample(lp.expand(64, V), SamplingParams(temperature=1.0), u[::128]).tolist() == tok[::128].tolist()


def test_banned_tokens_only_in_the_banned_rows():
    """Token ids `banned` are never chosen in the rows `banned_rows` marks (all rows when None), while the other
    rows sample exactly as without a ban; greedy rows likewise."""
    V, n = 12, 256
    lp = torch.log_softmax(torch.randn(V, generator=torch.Generator().manual_seed(2)), -1)
    lp[3] = lp[7] = 2.0  # (not normalised: the banned ids would take nearly all mass)
    logprobs, u = lp.expand(n, V), (torch.arange(n, dtype=torch.float64) + 0.5) / n
    banned, rows = torch.tensor([3, 7]), torch.arange(n) % 2 == 0
    for temperature in (1.0, 0.0):
        sp = SamplingParams(temperature=temperature)
        free = sample(logprobs, sp, u)
        ref = sample(logprobs.masked_fill(torch.isin(torch.arange(V), banned), float("-inf")), sp, u)
        assert torch.isin(free, banned).any() and not torch.isin(ref, banned).any()
        assert sample(logprobs, sp, u, banned).tolist() == ref.tolist()
        assert sample(logprobs, sp, u, banned, rows).tolist() == torch.where(rows, ref, free).tolist()


def test_a_nan_distribution_is_refused_in_one_line_not_indexed_past_the_vocabulary():
    """Logits that overflowed (a diverged run, float16) make a NaN row: the sampler stays within the vocabulary,
    and the NaN log-prob stops the engine with one line (exit 2) instead of an index error or NaN samples."""
    import pytest
    from conftest import PROMPTS, tiny_model

    from twinplane.errors import InputError
    from twinplane.rollout import RolloutEngine
    from twinplane.rollout.sampling import NonFiniteLogits

    for V in (50, 2 * CDF_CHUNK + 7):
        probs = torch.rand(3, V)
        probs[1] = float("nan")
        tok = inverse_cdf(probs, torch.tensor([0.2, 0.5, 0.9]))
        assert int(tok.max()) < V and tok[0] == inverse_cdf(probs[:1], torch.tensor([0.2]))[0]
    model = tiny_model()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = float("inf")
    engine = RolloutEngine(model, eos_token_id=None)
    assert issubclass(NonFiniteLogits, InputError)
    for temperature in (1.0, 0.0):
        with pytest.raises(NonFiniteLogits, match="^rollout: the model's next-token log-probs are NaN"):
            engine.generate(PROMPTS, SamplingParams(temperature=temperature, max_new_tokens=4))
