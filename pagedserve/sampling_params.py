"""User-facing sampling options, with vLLM's names and meanings, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

from pagedserve.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
_LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for logit_bias values; vLLM clamps to it too


@dataclass
class SamplingParams:
    """How to sample one prompt's completions.

    Invalid values raise ``ValueError`` naming the parameter.
    """

    n: int = 1
    """Number of completions of the prompt; each is a child request, returned together."""
    temperature: float = 1.0
    """0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to at least top_p."""
    top_k: int = 0
    """Keep the top_k most likely tokens; 0 or -1 disables."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's."""
    seed: Optional[int] = None
    """Per-request seed: the samples depend on it alone, never on the rest of the batch."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token that already appears in the output."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it appears in the output."""
    repetition_penalty: float = 1.0
    """Divides positive (multiplies negative) logits of tokens in the prompt or output; 1 disables."""
    stop: Optional[Union[str, list[str]]] = None
    """Strings that end generation; the matched string is not included in the text."""
    stop_token_ids: Optional[list[int]] = None
    """Token ids that end generation (the token is kept in the token ids)."""
    max_tokens: Optional[int] = 16
    """Most tokens to generate; None means until the context is full."""
    min_tokens: int = 0
    """Generate at least this many tokens before eos or stop_token_ids may end the sequence."""
    ignore_eos: bool = False
    """Keep generating after the end-of-sequence token."""
    logprobs: Optional[int] = None
    """Return the sampled token's logprob and the top-N logprobs at every generated position."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the output text."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text."""
    logit_bias: Optional[dict[int, float]] = field(default=None)
    """Added to the logits of the given token ids before sampling (keys may be ints or digit strings, as in
    JSON; values are clamped to [-100, 100] like OpenAI and vLLM)."""
    structured_outputs: Optional[StructuredOutputsParams] = None
    """Constrain the output to a JSON schema, a regex, a choice or a grammar (vLLM's name); a dict is taken as
    StructuredOutputsParams' fields."""
    stream_interval: Optional[int] = None
    """Streamed requests: tokens per chunk, the first and last chunks sent at once; raises the engine's
    stream_interval for this request, never lowers it (vLLM's name). None: the engine's."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        self.stop = list(self.stop or [])
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple, set)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = _normalize_logit_bias(self.logit_bias)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        check(_is_int(self.n) and self.n >= 1, "n", "must be an integer >= 1")
        check(_is_num(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0,
              "temperature", "must be a finite number >= 0")
        check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(_is_int(self.top_k) and self.top_k >= 0, "top_k", "must be an integer >= 1, or 0/-1 to disable")
        check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        check(self.seed is None or (_is_int(self.seed) and -(1 << 63) <= self.seed < (1 << 64)),
              "seed", "must be an integer in [-2**63, 2**64) or None")
        for name in ("presence_penalty", "frequency_penalty"):
            check(_is_num(getattr(self, name)) and -2 <= getattr(self, name) <= 2, name, "must be in [-2, 2]")
        check(_is_num(self.repetition_penalty) and math.isfinite(self.repetition_penalty)
              and self.repetition_penalty > 0, "repetition_penalty", "must be a finite number > 0")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be token ids >= 0")
        check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
              "max_tokens", "must be an integer >= 1 or None")
        check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", "must be an integer >= 0")
        check(self.stream_interval is None or (_is_int(self.stream_interval) and self.stream_interval >= 1),
              "stream_interval", "must be an integer >= 1 or None")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens", "must be <= max_tokens")
        check(self.structured_outputs is None or self.min_tokens == 0, "min_tokens",
              "cannot be combined with structured_outputs (the grammar decides when the output may end)")
        check(self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0),
              "logprobs", "must be an integer >= 0 or None")
        check(self.logit_bias is None or all(_is_int(k) and k >= 0 and _is_num(v) and not math.isnan(v)
                                             for k, v in self.logit_bias.items()),
              "logit_bias", "must map token ids >= 0 to numbers")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            check(isinstance(getattr(self, name), bool), name, "must be a bool")

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax: temperature 0 or top_k 1."""
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    def child(self, index: int) -> "SamplingParams":
        """The params of the index-th of n samples: n=1, and seed+index so that the samples differ."""
        from dataclasses import replace

        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)


def _normalize_logit_bias(bias) -> dict:
    """JSON gives string keys: turn digit strings into ints; clamp the values to [-100, 100]."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id to bias, got {bias!r}")
    out = {}
    for key, value in bias.items():
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            key = int(key)
        if _is_num(value) and not math.isnan(value):
            value = min(_LOGIT_BIAS_LIMIT, max(-_LOGIT_BIAS_LIMIT, float(value)))
        out[key] = value
    return out


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
