"""The soak's judge: each way a reply can be wrong is a violation, and each sound reply is its one outcome."""

from __future__ import annotations

from pagedserve.benchmarks.soak.checks import Reference, judge, reference_of
from pagedserve.benchmarks.soak.client import Reply
from pagedserve.benchmarks.soak.malformed import MALFORMED
from pagedserve.benchmarks.soak.mix import SoakRequest

ERROR = {"error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}}


def completion(n=2, stream=False, max_tokens=3, probe=None) -> SoakRequest:
    body = {"prompt": "hi", "max_tokens": max_tokens, "n": n, "stream": stream, "return_token_ids": True}
    return SoakRequest(1, "/v1/completions", body, probe=probe)


def chat(n=1, stream=True, max_tokens=3) -> SoakRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, "n": n, "stream": stream}
    return SoakRequest(1, "/v1/chat/completions", body)


def body_reply(choices, completion_tokens=None) -> Reply:
    tokens = sum(len(c["token_ids"]) for c in choices) if completion_tokens is None else completion_tokens
    return Reply(200, {"choices": choices, "usage": {"prompt_tokens": 2, "completion_tokens": tokens}})


def choice(index, ids=(5, 6, 7), finish="length", text="abc") -> dict:
    return {"index": index, "text": text, "token_ids": list(ids), "finish_reason": finish, "prompt_token_ids": [1, 2]}


def test_a_sound_completion_is_complete_with_its_token_count():
    verdict = judge(completion(), body_reply([choice(0), choice(1, ids=(5,), finish="stop")]), {})
    assert verdict.outcome == "complete" and verdict.completion_tokens == 4 and not verdict.problems


def test_usage_that_disagrees_with_the_token_ids_is_a_violation():
    verdict = judge(completion(), body_reply([choice(0), choice(1)], completion_tokens=5), {})
    assert verdict.outcome == "violation" and "usage.completion_tokens 5 but 6" in verdict.problems[0]


def test_a_missing_or_duplicated_choice_is_a_violation():
    assert judge(completion(), body_reply([choice(0)]), {}).outcome == "violation"
    verdict = judge(completion(), body_reply([choice(0), choice(0)]), {})
    assert verdict.outcome == "violation" and "choice 0 twice" in verdict.problems


def test_a_length_finish_short_of_max_tokens_or_too_many_tokens_is_a_violation():
    short = judge(completion(n=1), body_reply([choice(0, ids=(5,), finish="length")]), {})
    assert short.outcome == "violation" and "finish_reason length after 1 of 3" in short.problems[0]
    long = judge(completion(n=1), body_reply([choice(0, ids=(5, 6, 7, 8), finish="stop")]), {})
    assert long.outcome == "violation" and "4 tokens for max_tokens 3" in long.problems[0]


def test_a_greedy_probe_must_equal_its_reference():
    request = completion(n=1, probe=0)
    same = {0: Reference("abc", (5, 6, 7))}
    assert judge(request, body_reply([choice(0)]), same).outcome == "complete"
    other = judge(request, body_reply([choice(0, text="abd")]), same)
    assert other.outcome == "violation" and "greedy probe 0" in other.problems[0]


def test_5xx_transport_errors_and_non_openai_429s_are_violations():
    assert judge(completion(), Reply(500, ERROR), {}).outcome == "violation"
    assert judge(completion(), Reply(None, transport_error="reset"), {}).outcome == "violation"
    assert judge(completion(), Reply(429, "busy"), {}).outcome == "violation"
    assert judge(completion(), Reply(429, ERROR), {}).outcome == "throttled"
    assert judge(completion(), Reply(400, ERROR), {}).outcome == "violation"  # a valid request refused


def test_a_malformed_request_needs_its_expected_status_and_an_openai_body():
    case = next(c for c in MALFORMED if c.name == "unknown model")
    request = SoakRequest(1, case.endpoint, malformed=case)
    assert judge(request, Reply(404, ERROR), {}).outcome == "rejected"
    assert judge(request, Reply(400, ERROR), {}).outcome == "violation"
    assert judge(request, Reply(404, {"detail": "Not Found"}), {}).outcome == "violation"


def test_a_disconnect_of_the_clients_making_is_its_outcome():
    assert judge(completion(), Reply(200, disconnected=True), {}).outcome == "disconnected"


def stream_events(*choice_chunks, usage_tokens=None, done=True) -> list:
    events = [{"choices": [c]} for c in choice_chunks]
    tokens = sum(len(c.get("token_ids", [])) for c in choice_chunks) if usage_tokens is None else usage_tokens
    events.append({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": tokens}})
    return events + (["[DONE]"] if done else [])


def delta(index, content, ids, finish=None) -> dict:
    return {"index": index, "delta": {"content": content}, "token_ids": list(ids), "finish_reason": finish}


def chat_stream(*chunks, **kwargs) -> Reply:
    events = stream_events(*chunks, **kwargs)
    events[0]["prompt_token_ids"] = [1, 2]
    return Reply(200, events=events)


def test_a_sound_chat_stream_is_complete():
    reply = chat_stream(delta(0, "", []), delta(0, "ab", [5, 6]), delta(0, "c", [7], "length"))
    assert judge(chat(), reply, {}).outcome == "complete"


def test_stream_faults_are_violations():
    after_finish = chat_stream(delta(0, "ab", [5, 6], "stop"), delta(0, "c", [7]))
    assert "choice 0 has a chunk after its finish" in judge(chat(), after_finish, {}).problems
    no_done = chat_stream(delta(0, "abc", [5, 6, 7], "length"), done=False)
    assert "the stream does not end with one [DONE]" in judge(chat(), no_done, {}).problems
    error = chat_stream(delta(0, "abc", [5, 6, 7], "length"))
    error.events.insert(1, {"error": {"message": "engine died"}})
    assert judge(chat(), error, {}).outcome == "violation"
    interleaved = chat_stream(delta(0, "ab", [5, 6]), delta(1, "x", [9], "stop"), delta(0, "c", [7], "length"))
    assert judge(chat(), interleaved, {}).outcome == "violation"  # n = 1: a choice 1 is another request's


def test_a_reference_comes_only_from_a_sound_reply():
    request = completion(n=1, probe=0)
    assert reference_of(request, body_reply([choice(0)])) == Reference("abc", (5, 6, 7))
    try:
        reference_of(request, Reply(500, ERROR))
    except ValueError as e:
        assert "greedy probe 0" in str(e)
    else:
        raise AssertionError("a 500 made a reference")
