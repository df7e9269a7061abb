"""Judging one soak request: exactly one outcome, and a complete response that is whole and consistent."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from pagedserve.benchmarks.soak.client import Reply
from pagedserve.benchmarks.soak.mix import SoakRequest

OUTCOMES = ("complete", "rejected", "throttled", "disconnected", "violation")


@dataclass(frozen=True)
class Reference:
    """A greedy probe's output run alone: what every later run of it must produce."""

    text: str
    token_ids: tuple[int, ...]


@dataclass
class Verdict:
    outcome: str
    problems: list[str] = field(default_factory=list)
    completion_tokens: int = 0


@dataclass
class _Choice:
    text: str = ""
    token_ids: list = field(default_factory=list)
    finish_reason: Optional[str] = None


def is_openai_error(body) -> bool:
    """OpenAI's error body: {"error": {"message": str, "type": str, "param", "code"}}."""
    error = body.get("error") if isinstance(body, dict) else None
    return (isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(error.get("type"), str)
            and "param" in error and "code" in error)


def judge(request: SoakRequest, reply: Reply, references: dict[int, Reference]) -> Verdict:
    """The request's one outcome (OUTCOMES); "violation" with what was wrong."""
    if reply.transport_error is not None:
        return Verdict("violation", [f"transport: {reply.transport_error}"])
    if reply.disconnected:
        return Verdict("disconnected")
    if request.malformed is not None:
        return _judge_refusal(request, reply)
    if reply.status == 429 and is_openai_error(reply.body):
        return Verdict("throttled")
    if reply.status != 200:
        return Verdict("violation", [f"HTTP {reply.status} for a valid request: {str(reply.body)[:200]}"])
    problems: list[str] = []
    choices, usage, prompt_ids = (_from_stream(reply, request, problems) if request.stream
                                  else _from_body(reply.body, request, problems))
    if not problems:
        _check_choices(request, choices, usage, prompt_ids, references, problems)
    tokens = sum(len(c.token_ids) for c in choices.values())
    return Verdict("violation" if problems else "complete", problems, tokens)


def _judge_refusal(request: SoakRequest, reply: Reply) -> Verdict:
    case = request.malformed
    if reply.status in case.expected and is_openai_error(reply.body):
        return Verdict("rejected")
    return Verdict("violation", [f"malformed request ({case.name}) got HTTP {reply.status} "
                                 f"(expected {case.expected}, an OpenAI error body): {str(reply.body)[:200]}"])


def _from_body(body, request: SoakRequest, problems: list[str]):
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
        problems.append(f"a 200 without choices: {str(body)[:200]}")
        return {}, None, None
    chat = request.endpoint.endswith("chat/completions")
    choices: dict[int, _Choice] = {}
    for c in body["choices"]:
        if c.get("index") in choices:
            problems.append(f"choice {c.get('index')} twice")
        text = (c.get("message") or {}).get("content") if chat else c.get("text")
        choices[c.get("index")] = _Choice(text or "", list(c.get("token_ids") or []), c.get("finish_reason"))
    prompt_ids = body.get("prompt_token_ids") if chat else (body["choices"][0].get("prompt_token_ids")
                                                           if body["choices"] else None)
    return choices, body.get("usage"), prompt_ids


def _from_stream(reply: Reply, request: SoakRequest, problems: list[str]):
    """Rebuild each choice from its chunks, checking the stream's order: the [DONE] last and once, no error
    event, nothing for a choice after its finish, the usage chunk last."""
    events, chat = reply.events, request.endpoint.endswith("chat/completions")
    if not events or events[-1] != "[DONE]" or events.count("[DONE]") != 1:
        problems.append("the stream does not end with one [DONE]")
    choices: dict[int, _Choice] = {}
    usage = prompt_ids = None
    for event in events[:-1]:
        if not isinstance(event, dict) or "error" in event:
            problems.append(f"stream event {str(event)[:200]}")
            continue
        if prompt_ids is None:
            prompt_ids = event.get("prompt_token_ids") if chat else next(
                (c.get("prompt_token_ids") for c in event.get("choices", [])), None)
        if usage is not None:
            problems.append("a chunk after the usage chunk")
        if not event.get("choices"):
            usage = event.get("usage")
            continue
        for c in event["choices"]:
            choice = choices.setdefault(c.get("index"), _Choice())
            if choice.finish_reason is not None:
                problems.append(f"choice {c.get('index')} has a chunk after its finish")
            choice.text += ((c.get("delta") or {}).get("content") if chat else c.get("text")) or ""
            choice.token_ids += c.get("token_ids") or []
            choice.finish_reason = c.get("finish_reason")
    return choices, usage, prompt_ids


def _check_choices(request: SoakRequest, choices: dict[int, _Choice], usage, prompt_ids,
                   references: dict[int, Reference], problems: list[str]) -> None:
    if set(choices) != set(range(request.n)):
        problems.append(f"choice indices {sorted(choices, key=str)}, expected 0..{request.n - 1}")
        return
    for index, c in choices.items():
        problems.extend(f"choice {index}: {p}" for p in _choice_problems(request, c, references))
    generated = sum(len(c.token_ids) for c in choices.values())
    if not isinstance(usage, dict):
        problems.append("no usage")
    elif usage.get("completion_tokens") != generated:
        problems.append(f"usage.completion_tokens {usage.get('completion_tokens')} but {generated} token ids")
    elif prompt_ids is None or usage.get("prompt_tokens") != len(prompt_ids):
        problems.append(f"usage.prompt_tokens {usage.get('prompt_tokens')} but prompt_token_ids "
                        f"{None if prompt_ids is None else len(prompt_ids)}")


def _choice_problems(request: SoakRequest, c: _Choice, references: dict[int, Reference]) -> list[str]:
    problems = []
    if c.finish_reason not in ("stop", "length"):
        problems.append(f"finish_reason {c.finish_reason!r}")
    if not 1 <= len(c.token_ids) <= request.max_tokens:
        problems.append(f"{len(c.token_ids)} tokens for max_tokens {request.max_tokens}")
    if c.finish_reason == "length" and len(c.token_ids) != request.max_tokens:
        problems.append(f"finish_reason length after {len(c.token_ids)} of {request.max_tokens} tokens")
    reference = references.get(request.probe) if request.probe is not None else None
    if reference is not None and (c.text, tuple(c.token_ids)) != (reference.text, reference.token_ids):
        problems.append(f"greedy probe {request.probe} gave {c.text[:60]!r} ({len(c.token_ids)} tokens), run "
                        f"alone {reference.text[:60]!r} ({len(reference.token_ids)} tokens)")
    return problems


def reference_of(request: SoakRequest, reply: Reply) -> Reference:
    """A probe's Reference from its reply run alone (ValueError when that reply is not a sound completion)."""
    verdict = judge(request, reply, {})
    if verdict.outcome != "complete":
        raise ValueError(f"greedy probe {request.probe} run alone: {verdict.outcome} {verdict.problems}")
    choices, _, _ = _from_body(reply.body, request, [])
    return Reference(choices[0].text, tuple(choices[0].token_ids))
