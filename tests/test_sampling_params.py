import math

import pytest

from pagedserve.sampling_params import SamplingParams as SP

NAN, INF = math.nan, math.inf

BAD = [
    ("n", 0), ("n", 1.0), ("n", True),
    ("temperature", -0.1), ("temperature", NAN), ("temperature", INF), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", NAN),
    ("top_k", -2), ("top_k", 2.5), ("top_k", True),
    ("min_p", -0.1), ("min_p", 1.1), ("min_p", NAN),
    ("seed", 1.5), ("seed", "7"), ("seed", 1 << 64), ("seed", -(1 << 63) - 1),
    ("presence_penalty", 2.5), ("presence_penalty", -2.5), ("presence_penalty", NAN),
    ("frequency_penalty", 2.5), ("frequency_penalty", -3), ("frequency_penalty", None),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", INF),
    ("stop", [""]), ("stop", ["ok", 3]), ("stop", 5),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]), ("stop_token_ids", 5),
    ("max_tokens", 0), ("max_tokens", 2.0),
    ("min_tokens", -1), ("min_tokens", 1.5),
    ("logprobs", -1), ("logprobs", 1.5),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {"a": 1.0}), ("logit_bias", {1: "x"}), ("logit_bias", {1: NAN}),
    ("logit_bias", [1, 2]), ("logit_bias", {1.5: 1.0}),
    ("ignore_eos", 1), ("skip_special_tokens", None), ("include_stop_str_in_output", "yes"),
]


@pytest.mark.parametrize("name,value", BAD)
def test_bad_values_rejected_naming_the_parameter(name, value):
    with pytest.raises(ValueError) as err:
        SP(**{name: value})
    assert str(err.value).startswith(name), str(err.value)


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="^min_tokens"):
        SP(min_tokens=10, max_tokens=5)
    assert SP(min_tokens=10, max_tokens=None).min_tokens == 10


def test_defaults_and_normalisation():
    p = SP()
    assert p.stop == [] and p.stop_token_ids == [] and p.logit_bias is None and not p.greedy
    assert SP(stop="x").stop == ["x"]
    assert SP(stop=("a", "b")).stop == ["a", "b"]
    assert SP(top_k=-1).top_k == 0
    assert SP(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_logit_bias_keys_from_json_and_clamped():
    p = SP(logit_bias={"5": 300, 7: -250.0, 9: 1})
    assert p.logit_bias == {5: 100.0, 7: -100.0, 9: 1.0}


def test_greedy():
    assert SP(temperature=0.0).greedy
    assert SP(temperature=1e-6).greedy
    assert SP(temperature=0.7, top_k=1).greedy
    assert not SP(temperature=0.7, top_k=2).greedy


def test_edges_accepted():
    SP(temperature=0, top_p=1.0, min_p=1.0, presence_penalty=-2, frequency_penalty=2, seed=-(1 << 63),
       max_tokens=None, logprobs=0, logit_bias={0: -100})
    SP(seed=(1 << 64) - 1, repetition_penalty=1e-3, stop_token_ids=[0])


def test_child_offsets_seed():
    p = SP(n=3, seed=10, stop="x")
    kids = [p.child(i) for i in range(3)]
    assert [k.seed for k in kids] == [10, 11, 12] and all(k.n == 1 and k.stop == ["x"] for k in kids)
    assert SP(n=2).child(1).seed is None
