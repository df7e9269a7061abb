import math

import pytest
import torch

from pagedserve.layers import sampler as sampler_mod
from pagedserve.layers.logits_processors import apply_logit_bias, apply_penalties, apply_top_k_top_p_min_p, ban_tokens
from pagedserve.layers.sampler import Sampler, SamplingMetadata
from pagedserve.sampling_params import SamplingParams as SP

CPU = torch.device("cpu")


def build(params, prompts=None, outputs=None, generators=None, bans=None):
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        generators if generators is not None else [None] * n,
        bans if bans is not None else [set() for _ in range(n)],
        CPU,
    )


def sample(logits, params, **kw):
    return Sampler()(logits.clone(), build(params, **kw))


def gen(seed):
    return torch.Generator().manual_seed(seed)


def kept(logits, **kw):
    """Token ids that the reference cut keeps, per row."""
    rows = apply_top_k_top_p_min_p(logits, **{k: torch.tensor(v) for k, v in kw.items()})
    return [set(torch.nonzero(torch.isfinite(r)).flatten().tolist()) for r in rows]


# -- greedy ------------------------------------------------------------------------------------------------

def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(8, 100)
    out = sample(logits, [SP(temperature=0.0)] * 8)
    assert out.sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_takes_the_first_maximum_on_ties_in_the_model_dtype(dtype):
    logits = torch.zeros(3, 64, dtype=dtype)
    logits[0, [5, 9]] = 2.0
    logits[1, [63, 1]] = 1.0
    logits[2] = -1.0
    assert sample(logits, [SP(temperature=0.0)] * 3).sampled_token_ids.tolist() == [5, 1, 0]


def test_top_k_1_is_greedy():
    torch.manual_seed(1)
    logits = torch.randn(16, 300)
    params = [SP(temperature=1.3, top_k=1)] * 16
    assert all(p.greedy for p in params)
    assert sample(logits, params).sampled_token_ids.tolist() == logits.argmax(-1).tolist()
    # And the cut itself keeps only the argmax.
    assert kept(logits, top_k=[1] * 16) == [{i} for i in logits.argmax(-1).tolist()]


def test_mixed_greedy_and_random_rows():
    torch.manual_seed(2)
    logits = torch.randn(6, 50)
    logits[:, 7] += 100.0  # every row's random sample is (almost surely) 7 too
    logits[0, 3] += 200.0
    params = [SP(temperature=0.0), SP(), SP(top_p=0.9), SP(temperature=0.0), SP(top_k=3), SP(min_p=0.5)]
    out = sample(logits, params).sampled_token_ids.tolist()
    assert out == [3, 7, 7, 7, 7, 7]


# -- penalties, bias, min_tokens (exact numbers) --------------------------------------------------------

LOGITS = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
OUTPUT = [[0, 0, 1]]  # token 0 twice, token 1 once
PROMPT = [[2, 4]]


def penalised(params, logits=LOGITS, prompts=PROMPT, outputs=OUTPUT):
    meta = build(params, prompts=prompts, outputs=outputs)
    x = logits.clone()
    apply_penalties(x, meta.penalties)
    return x


def test_presence_penalty():
    x = penalised([SP(presence_penalty=0.5)])
    assert torch.allclose(x, torch.tensor([[1.5, -1.5, 0.5, 3.0, -2.0, 1.0]]))


def test_frequency_penalty():
    x = penalised([SP(frequency_penalty=0.5)])
    assert torch.allclose(x, torch.tensor([[1.0, -1.5, 0.5, 3.0, -2.0, 1.0]]))


def test_negative_presence_and_frequency_reward_repeats():
    x = penalised([SP(presence_penalty=-1.0, frequency_penalty=-0.25)])
    assert torch.allclose(x, torch.tensor([[3.5, 0.25, 0.5, 3.0, -2.0, 1.0]]))


def test_repetition_penalty_over_prompt_and_output():
    # Seen: 0, 1 (output), 2, 4 (prompt). Positive logits divided, negative multiplied.
    x = penalised([SP(repetition_penalty=2.0)])
    assert torch.allclose(x, torch.tensor([[1.0, -2.0, 0.25, 3.0, -4.0, 1.0]]))
    x = penalised([SP(repetition_penalty=0.5)])
    assert torch.allclose(x, torch.tensor([[4.0, -0.5, 1.0, 3.0, -1.0, 1.0]]))


def test_penalties_combined_in_vllm_order():
    # repetition, then frequency, then presence.
    x = penalised([SP(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)])
    expected = [2.0 / 2 - 0.5 * 2 - 0.25, -1.0 * 2 - 0.5 - 0.25, 0.5 / 2, 3.0, -2.0 * 2, 1.0]
    assert torch.allclose(x, torch.tensor([expected]))


def test_penalties_only_on_their_rows():
    logits = LOGITS.repeat(3, 1)
    params = [SP(), SP(frequency_penalty=1.0, repetition_penalty=2.0), SP()]
    meta = build(params, prompts=[[5], [2], [5]], outputs=[[3], [0], [3]])
    assert meta.penalties.output_rows.tolist() == [1] and meta.penalties.prompt_rows.tolist() == [1]
    x = logits.clone()
    apply_penalties(x, meta.penalties)
    assert torch.equal(x[0], LOGITS[0]) and torch.equal(x[2], LOGITS[0])
    assert torch.allclose(x[1], torch.tensor([2.0 / 2 - 1.0, -1.0, 0.25, 3.0, -2.0, 1.0]))


def test_no_penalty_work_when_unused():
    meta = build([SP(), SP(temperature=0.0)], prompts=[[1, 2]] * 2, outputs=[[1]] * 2)
    assert meta.penalties is None and meta.logit_bias is None and meta.banned is None


def test_penalties_change_greedy_choice_in_sampler():
    # Token 3 is the argmax until the frequency penalty for its 3 repeats pushes it below token 0.
    out = sample(LOGITS, [SP(temperature=0.0, frequency_penalty=0.5)], outputs=[[3, 3, 3]])
    assert out.sampled_token_ids.tolist() == [0]


def test_logit_bias_added():
    meta = build([SP(logit_bias={1: 5.0, 4: -0.5}), SP(), SP(logit_bias={0: 1.5})])
    x = LOGITS.repeat(3, 1)
    apply_logit_bias(x, *meta.logit_bias)
    assert torch.allclose(x[0], torch.tensor([2.0, 4.0, 0.5, 3.0, -2.5, 1.0]))
    assert torch.equal(x[1], LOGITS[0])
    assert torch.allclose(x[2], torch.tensor([3.5, -1.0, 0.5, 3.0, -2.0, 1.0]))
    out = sample(LOGITS.repeat(3, 1), [SP(temperature=0.0, logit_bias={1: 5.0}), SP(temperature=0.0),
                                      SP(temperature=0.0, logit_bias={0: 1.5})])
    assert out.sampled_token_ids.tolist() == [1, 3, 0]


def test_min_tokens_bans_stop_tokens():
    logits = LOGITS.repeat(2, 1)
    out = sample(logits, [SP(temperature=0.0), SP(temperature=0.0)], bans=[{3, 0}, set()])
    assert out.sampled_token_ids.tolist() == [5, 3]
    meta = build([SP(), SP()], bans=[{3, 0}, set()])
    x = logits.clone()
    ban_tokens(x, *meta.banned)
    assert x[0, 0] == -math.inf and x[0, 3] == -math.inf and torch.isfinite(x[0, [1, 2, 4, 5]]).all()
    assert torch.equal(x[1], LOGITS[0])
    # Random rows never sample a banned token.
    many = torch.tensor([[5.0, 5.0, 0.0]]).repeat(2000, 1)
    got = sample(many, [SP()] * 2000, bans=[{0}] * 2000).sampled_token_ids
    assert set(got.tolist()) <= {1, 2}


# -- temperature and the cut -----------------------------------------------------------------------------

def frequencies(logits_row, params, n=20000):
    out = sample(logits_row.repeat(n, 1), [params] * n).sampled_token_ids
    return torch.bincount(out, minlength=logits_row.numel()).float() / n


def test_temperature_scales_distribution():
    row = torch.tensor([1.0, 0.0, -1.0, 0.5])
    for temp in (1.0, 0.5, 2.0):
        torch.manual_seed(3)
        freq = frequencies(row, SP(temperature=temp))
        assert torch.allclose(freq, torch.softmax(row / temp, -1), atol=0.015), (temp, freq)


PROBS = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])
PLOGITS = PROBS.log()


@pytest.mark.parametrize("kw,expected", [
    (dict(top_k=[2]), {0, 1}),
    (dict(top_k=[4]), {0, 1, 2, 3}),
    (dict(top_p=[0.3]), {0}),
    (dict(top_p=[0.65]), {0, 1}),
    (dict(top_p=[0.8]), {0, 1, 2}),
    (dict(top_p=[0.99]), {0, 1, 2, 3, 4}),
    (dict(min_p=[0.5]), {0}),          # keep p >= 0.25
    (dict(min_p=[0.25]), {0, 1, 2}),   # keep p >= 0.125
    (dict(min_p=[0.05]), {0, 1, 2, 3, 4}),
    # top_p over the top_k set renormalised: [.5,.2,.15]/.85 -> mass before token 1 is .588 >= .55
    (dict(top_k=[3], top_p=[0.55]), {0}),
    (dict(top_k=[3], top_p=[0.7]), {0, 1}),
    # top_p over the min_p survivors renormalised: [.5,.2]/.7 -> mass before token 1 is .714 >= .7
    (dict(min_p=[0.35], top_p=[0.7]), {0}),
    (dict(min_p=[0.35], top_p=[0.75]), {0, 1}),
    (dict(min_p=[0.25], top_k=[2]), {0, 1}),
])
def test_cut_keeps_exact_sets(kw, expected):
    assert kept(PLOGITS, **kw) == [expected]


def test_cut_row_disables():
    logits = PLOGITS.repeat(3, 1)
    got = kept(logits, top_k=[0, 2, 0], top_p=[1.0, 1.0, 0.3], min_p=[0.0, 0.0, 0.0])
    assert got == [{0, 1, 2, 3, 4}, {0, 1}, {0}]


def test_top_k_keeps_ties():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    assert kept(logits, top_k=[2]) == [{0, 2, 3}]


@pytest.mark.parametrize("params,expected", [
    (SP(top_k=2), {0, 1}),
    (SP(top_p=0.65), {0, 1}),
    (SP(min_p=0.25), {0, 1, 2}),
    (SP(top_k=3, top_p=0.7), {0, 1}),
    (SP(temperature=0.5, top_p=0.85), {0, 1}),  # probs^2 renormalised: .769, .123, .069, ...
    (SP(temperature=0.5, top_p=0.9), {0, 1, 2}),
    (SP(temperature=2.0, min_p=0.5), {0, 1, 2}),  # sqrt probs: keep >= .5*.707
])
def test_sampler_samples_exactly_the_kept_set(params, expected):
    torch.manual_seed(4)
    freq = frequencies(PLOGITS[0], params, n=6000)
    assert set(torch.nonzero(freq).flatten().tolist()) == expected
    # Within the set, frequencies follow the renormalised tempered probabilities.
    probs = torch.softmax(PLOGITS[0] / params.temperature, -1)
    mask = torch.zeros(5, dtype=torch.bool)
    mask[list(expected)] = True
    target = torch.where(mask, probs, 0.0)
    assert torch.allclose(freq, target / target.sum(), atol=0.03)


def random_rows(num, vocab, seed):
    g = gen(seed)
    logits = torch.randn(num, vocab, generator=g) * 2.0
    peaks = torch.randint(0, vocab, (num, 5), generator=g)
    logits.scatter_add_(1, peaks, torch.rand(num, 5, generator=g) * 12)  # peaked like an LLM's
    logits[-1] = torch.randn(vocab, generator=g) * 0.1  # one flat row: windows cannot decide it
    return logits


CUT_PARAMS = [SP(top_p=0.9), SP(top_k=20), SP(top_k=50, top_p=0.8), SP(top_p=0.95, min_p=0.01),
              SP(top_k=200), SP(top_p=0.5, temperature=0.7), SP(top_k=5000, top_p=0.9), SP(top_p=0.99)]


TOP_K_PARAMS = [SP(top_k=5), SP(top_k=30, temperature=0.5), SP(top_k=10, min_p=0.1), SP(top_k=100, top_p=0.9),
                SP(top_k=16, top_p=0.6), SP(top_k=100)]


@pytest.mark.parametrize("params", [CUT_PARAMS, TOP_K_PARAMS])
def test_window_path_matches_full_sort(monkeypatch, params):
    """The topk-window shortcut picks the same tokens as sorting whole rows."""
    vocab = 2000
    logits = random_rows(len(params), vocab, seed=5)
    logits[0, :40] = 9.0  # ties around the top_k=5 cut
    results = {}
    for windows in ((), (16, 128), (64,), (256,)):
        monkeypatch.setattr(sampler_mod, "WINDOWS", windows)
        steps = []
        gens = [gen(100 + i) for i in range(len(params))]
        for _ in range(12):
            steps.append(sample(logits, params, generators=gens).sampled_token_ids.tolist())
        results[windows] = steps
    assert results[()] == results[(16, 128)] == results[(64,)] == results[(256,)]


def test_sampled_tokens_stay_in_reference_set(monkeypatch):
    monkeypatch.setattr(sampler_mod, "WINDOWS", (16, 128))
    vocab = 2000
    logits = random_rows(len(CUT_PARAMS), vocab, seed=6)
    ref = [kept(logits[i:i + 1] / p.temperature, top_k=[p.top_k], top_p=[p.top_p], min_p=[p.min_p])[0]
           for i, p in enumerate(CUT_PARAMS)]
    n = 400
    out = sample(logits.repeat(n, 1), CUT_PARAMS * n).sampled_token_ids.view(n, -1)
    for i in range(len(CUT_PARAMS)):
        assert set(out[:, i].tolist()) <= ref[i], CUT_PARAMS[i]


# -- seeds ------------------------------------------------------------------------------------------------

def run_steps(logit_steps, params, gens, row):
    return [sample(x, params, generators=gens).sampled_token_ids[row].item() for x in logit_steps]


@pytest.mark.parametrize("target", [SP(temperature=0.8, top_p=0.9, seed=42), SP(seed=42),
                                    SP(top_k=40, min_p=0.02, seed=42)])
def test_seeded_row_independent_of_batch(target):
    vocab = 3000
    steps = [random_rows(5, vocab, seed=10 + t) for t in range(6)]
    alone = run_steps([x[2:3] for x in steps], [target], [gen(42)], 0)
    others = [SP(seed=7), SP(), SP(temperature=0.0), SP(top_k=3)]
    batch = others[:2] + [target] + others[2:]
    gens = [gen(7), None, gen(42), None, None]
    torch.manual_seed(123)
    mixed = run_steps(steps, batch, gens, 2)
    torch.manual_seed(999)
    moved = run_steps([x[[2, 0, 1, 3, 4]] for x in steps], [target, *others], [gen(42), gen(7), None, None, None], 0)
    assert alone == mixed == moved


def test_different_seeds_differ():
    logits = torch.zeros(1, 1000)
    a = run_steps([logits] * 20, [SP(seed=1)], [gen(1)], 0)
    b = run_steps([logits] * 20, [SP(seed=2)], [gen(2)], 0)
    assert a != b
    assert run_steps([logits] * 20, [SP(seed=1)], [gen(1)], 0) == a


# -- logprobs ---------------------------------------------------------------------------------------------

def test_logprobs_are_raw_and_sampled_first():
    torch.manual_seed(8)
    logits = torch.randn(4, 64)
    params = [SP(logprobs=3, temperature=0.7, presence_penalty=1.0), SP(), SP(logprobs=0, temperature=0.0),
              SP(logprobs=1, top_k=5, logit_bias={5: 3.0})]
    out = sample(logits, params, outputs=[[1, 2], [], [], []])
    lp = out.logprobs
    raw = torch.log_softmax(logits, -1)
    sampled = out.sampled_token_ids
    asked = [0, 2, 3]
    assert lp.token_ids.shape == (4, 4) and lp.logprobs.shape == (4, 4)
    assert torch.equal(lp.token_ids[:, 0], sampled)
    assert torch.allclose(lp.logprobs[asked, 0], raw.gather(1, sampled[:, None]).squeeze(1)[asked])
    top = raw.topk(3, -1)
    assert torch.equal(lp.token_ids[asked, 1:], top.indices[asked])
    assert torch.allclose(lp.logprobs[asked, 1:], top.values[asked])
    order = raw.argsort(-1, descending=True)
    expected_ranks = [(order[i] == sampled[i]).nonzero().item() + 1 for i in asked]
    assert lp.ranks[asked].tolist() == expected_ranks
    assert lp.ranks[2].item() == 1  # greedy row, no bias: the most likely token
    assert lp.ranks[1].item() == 0 and torch.isnan(lp.logprobs[1]).all()  # row 1 asked for none


def test_logprobs_all_rows():
    torch.manual_seed(9)
    logits = torch.randn(3, 40)
    out = sample(logits, [SP(logprobs=2), SP(logprobs=2, temperature=0.0), SP(logprobs=1)])
    raw = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs.logprobs[:, 0], raw.gather(1, out.sampled_token_ids[:, None]).squeeze(1))
    assert torch.equal(out.logprobs.token_ids[:, 1:], raw.topk(2, -1).indices)
    ranks = (raw >= raw.gather(1, out.sampled_token_ids[:, None])).sum(-1)
    assert torch.equal(out.logprobs.ranks, ranks)


def test_logprobs_zero_gives_only_sampled_column():
    out = sample(torch.randn(2, 10), [SP(logprobs=0), SP()])
    assert out.logprobs.token_ids.shape == (2, 1)
