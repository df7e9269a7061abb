"""The server through the official openai client: completions and chat, streaming and not, n, stop, logprobs,
seeds, usage; 32 concurrent streams equal the offline LLM's greedy text; the small routes."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from live_server import MODEL_NAME, client, server  # noqa: F401 - fixtures
from pagedserve import LLM, SamplingParams

PROMPTS = ["The quick brown fox", "Paged attention stores the KV", "Hello, world.", "Continuous batching",
           "12345", "Bonjour le monde", "emoji", "The lazy dog", "Ünïcödé text", "Hello again",
           "blocks", "the batch at every step"]


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 22, max_model_len=256)


def greedy(offline, prompt, max_tokens=8, **kw):
    [out] = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, **kw), use_tqdm=False)
    return out


def test_completion_matches_offline_and_reports_usage(client, offline):
    want = greedy(offline, "The quick brown fox", ignore_eos=True)
    r = client.completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == MODEL_NAME and r.id.startswith("cmpl-")
    [choice] = r.choices
    assert choice.text == want.outputs[0].text and choice.finish_reason == "length" and choice.index == 0
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_model_may_be_omitted_or_any_served_name(server):
    for body in ({}, {"model": "other-name"}):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **body})
        assert r.status_code == 200
        assert r.json()["model"] == body.get("model", MODEL_NAME)


def test_prompt_forms_lists_and_token_ids(client, offline):
    ids = offline.get_tokenizer().encode("Hello, world.")
    r = client.completions.create(model=MODEL_NAME, prompt=["Hello, world.", "emoji"], max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    r_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4, temperature=0)
    assert r_ids.choices[0].text == r.choices[0].text
    r_lists = client.completions.create(model=MODEL_NAME, prompt=[ids, ids[:2]], max_tokens=4, temperature=0)
    assert r_lists.choices[0].text == r.choices[0].text and len(r_lists.choices) == 2
    assert r.usage.completion_tokens == 8


def test_streamed_completion_equals_non_streamed(client):
    kw = dict(model=MODEL_NAME, prompt="Paged attention stores the KV", max_tokens=10, temperature=0)
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    *content, usage = chunks
    assert "".join(c.choices[0].text for c in content) == whole.text
    assert [c.choices[0].finish_reason for c in content][-1] == whole.finish_reason
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert usage.choices == [] and usage.usage.completion_tokens == 10
    assert all(c.usage is None for c in content)


def test_echo_prepends_the_prompt(client):
    kw = dict(model=MODEL_NAME, prompt="Hello again", max_tokens=4, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    assert client.completions.create(echo=True, **kw).choices[0].text == "Hello again" + plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(echo=True, stream=True, **kw))
    assert streamed == "Hello again" + plain


def test_n_and_seed_reproducibility(client):
    kw = dict(model=MODEL_NAME, prompt="Hello", max_tokens=8, temperature=1.0, seed=1234, n=2,
              extra_body={"ignore_eos": True})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text  # seed + i per sample
    assert a.usage.completion_tokens == 16
    streamed = {0: "", 1: ""}
    finishes = {0: 0, 1: 0}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
            finishes[c.index] += c.finish_reason is not None
    assert streamed == {0: a.choices[0].text, 1: a.choices[1].text} and finishes == {0: 1, 1: 1}


def test_stop_string_ends_the_text(client, offline):
    text = greedy(offline, "The quick brown fox", max_tokens=12, ignore_eos=True).outputs[0].text
    stop = text[4:6]
    cut = text[:text.index(stop)]
    r = client.completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=12, temperature=0,
                                  stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=12,
                                              temperature=0, stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == cut and streamed[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) >= 3 and max(top.values()) == pytest.approx(logprob)  # greedy = top-1


def test_chat_non_streaming_and_streaming(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world."}]
    [want] = offline.chat(messages, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want.outputs[0].text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids) and r.usage.completion_tokens == 8
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=8,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    *content, usage = chunks
    assert content[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in content) == want.outputs[0].text
    assert content[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert usage.choices == [] and usage.usage.total_tokens == r.usage.total_tokens


def test_chat_content_parts_equal_the_string(client):
    kw = dict(model=MODEL_NAME, max_tokens=5, temperature=0, response_format={"type": "text"})
    a = client.chat.completions.create(messages=[{"role": "user", "content": "Hi\nthere"}], **kw)
    b = client.chat.completions.create(messages=[{"role": "user", "content": [
        {"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}], **kw)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_chat_logprobs_n_and_seed(client):
    kw = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Hello"}], max_tokens=6, n=2, seed=7,
              temperature=0.9, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    for choice in a.choices:
        content = choice.logprobs.content
        assert len(content) == 6 and "".join(t.token for t in content) == choice.message.content
        assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
                   for t in content)


def test_concurrent_streams_each_get_the_offline_greedy_text(server, offline):
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(32)]
    expected = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                                use_tqdm=False)

    async def one(c, prompt):
        text = ""
        stream = await c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            text += chunk.choices[0].text
        return text

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    texts = asyncio.run(main())
    assert texts == [e.outputs[0].text for e in expected]


def test_models_health_version(client, server):
    names = [m.id for m in client.models.list().data]
    assert names == [MODEL_NAME, "other-name"]
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_tokenize_and_detokenize(server, offline):
    tok = offline.get_tokenizer()
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello, world."}).json()
    assert r["tokens"] == tok.encode("Hello, world.") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert tok.decode(chat["tokens"]).endswith("assistant:")
    assert httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "Hello, world."
