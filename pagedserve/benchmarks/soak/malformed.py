"""Malformed and over-limit requests of the soak, each with the statuses a sound server answers it with."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class MalformedCase:
    name: str
    endpoint: str
    data: bytes
    expected: tuple[int, ...]
    content_type: str = "application/json"


def _case(name: str, body, expected=(400,), endpoint: str = "/v1/completions", **kwargs) -> MalformedCase:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return MalformedCase(name, endpoint, data, expected, **kwargs)


MALFORMED = (
    _case("invalid JSON", b'{"prompt": "a", "max_tokens": '),
    _case("lone surrogate", b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
    _case("max_tokens over the context", {"prompt": "hi", "max_tokens": 10 ** 7}),
    _case("n over the limit", {"prompt": "hi", "max_tokens": 2, "n": 100000}),
    _case("unknown model", {"prompt": "hi", "max_tokens": 2, "model": "no-such-model"}, (404,)),
    _case("token id out of the vocabulary", {"prompt": [2 ** 31 - 1], "max_tokens": 2}),
    _case("negative token id", {"prompt": [-5, 1], "max_tokens": 2}),
    _case("prompt of the wrong type", {"prompt": 5, "max_tokens": 2}),
    _case("negative temperature", {"prompt": "hi", "max_tokens": 2, "temperature": -1}),
    _case("NaN top_p", b'{"prompt": "hi", "max_tokens": 2, "top_p": NaN}'),
    _case("nested 10,000 deep", b'{"prompt": ' + b"[" * 10000 + b"]" * 10000 + b"}"),
    _case("duplicate keys", b'{"prompt": "hi", "prompt": "ho", "max_tokens": 2}'),
    _case("stop string too long", {"prompt": "hi", "max_tokens": 2, "stop": ["x" * 5000]}),
    _case("text/plain body", {"prompt": "hi", "max_tokens": 2}, content_type="text/plain"),
    _case("no messages", {"messages": [], "max_tokens": 2}, endpoint="/v1/chat/completions"),
    _case("unknown role", {"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 2},
          endpoint="/v1/chat/completions"),
    _case("logit_bias flood", {"prompt": "hi", "max_tokens": 2,
                               "logit_bias": {str(10 ** 7 + i): 1.0 for i in range(5000)}}),
    _case("prompt longer than the context", {"prompt": "word " * 200000, "max_tokens": 2}, (400, 413)),
)
