"""The soak's mix: seeded, with every kind of request in about its share."""

from __future__ import annotations

from collections import Counter

from pagedserve.benchmarks.soak.mix import MixConfig, RequestMix


def draw(count=4000, **kwargs):
    mix = RequestMix(MixConfig(**kwargs), "m")
    return mix, [mix.next() for _ in range(count)]


def test_the_mix_is_seeded():
    _, a = draw(200)
    _, b = draw(200)
    assert [(r.endpoint, r.body, r.malformed, r.disconnect_after) for r in a] == \
        [(r.endpoint, r.body, r.malformed, r.disconnect_after) for r in b]


def test_every_kind_of_request_comes_in_about_its_share():
    _, requests = draw()
    tags = Counter(tag for r in requests for tag in r.tags)
    assert 0.03 < tags["malformed"] / len(requests) < 0.07
    assert 0.07 < tags["disconnect"] / len(requests) < 0.13
    valid = [r for r in requests if r.body is not None]
    assert 0.25 < sum(r.probe is not None for r in valid) / len(valid) < 0.35
    assert {r.endpoint for r in valid} == {"/v1/completions", "/v1/chat/completions"}
    assert {r.stream for r in valid} == {True, False} and {r.n for r in valid} == {1, 2, 3}
    assert any("stop" in r.body for r in valid) and any("logprobs" in r.body for r in valid)
    assert all(r.body["return_token_ids"] and 1 <= r.max_tokens <= 48 for r in valid)
    assert all(r.body["stream_options"]["include_usage"] for r in valid if r.stream)


def test_probes_are_greedy_and_repeat_their_prompt():
    mix, requests = draw()
    for r in requests:
        if r.probe is not None:
            alone = mix.probe_alone(r.probe)
            assert r.body["temperature"] == 0 and alone.body["n"] == 1 and not alone.stream
            same = lambda body: {k: v for k, v in body.items() if k not in ("n", "stream", "stream_options")}  # noqa
            assert same(r.body) == same(alone.body) and r.endpoint == alone.endpoint


def test_shared_prefixes_are_reused():
    mix, requests = draw(400)
    prompts = [r.body.get("prompt") or r.body["messages"][0]["content"] for r in requests if r.body is not None]
    assert all(any(p.startswith(prefix) for prefix in mix.prefixes) for p in prompts)


def test_without_faults_there_are_no_disconnects_or_malformed_bodies():
    mix = RequestMix(MixConfig(), "m")
    assert not any(mix.next(allow_faults=False).tags for _ in range(1000))
