"""The soak's request mix: what each request is, drawn from one seeded random stream."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

from pagedserve.benchmarks.soak.malformed import MALFORMED, MalformedCase

WORDS = ("the quick brown fox jumps over a lazy dog while paged attention keeps blocks of keys and values "
         "for every request that the scheduler admits under continuous batching with chunked prefill").split()
STOP_STRINGS = (".", " the", "\n", "s ", "ing")


@dataclass(frozen=True)
class MixConfig:
    """Shares of the mix and sizes of its requests."""

    max_tokens: int = 48
    disconnect_fraction: float = 0.10
    malformed_fraction: float = 0.05
    greedy_fraction: float = 0.30
    num_prefixes: int = 4
    prefix_words: int = 24
    num_probes: int = 8
    seed: int = 0


@dataclass
class SoakRequest:
    """One request of the soak. `body` is None for a malformed case (its raw bytes are in `malformed`)."""

    number: int
    endpoint: str
    body: Optional[dict] = None
    malformed: Optional[MalformedCase] = None
    probe: Optional[int] = None
    """Index of the greedy probe this request repeats (its text must equal the probe's reference)."""
    disconnect_after: Optional[float] = None
    """Disconnect of its own making: after this many chunks (streams) or seconds (otherwise)."""
    tags: list[str] = field(default_factory=list)

    @property
    def stream(self) -> bool:
        return bool(self.body and self.body.get("stream"))

    @property
    def n(self) -> int:
        return int((self.body or {}).get("n", 1))

    @property
    def max_tokens(self) -> int:
        return int((self.body or {})["max_tokens"])


class RequestMix:
    """Draws SoakRequests; the greedy probes are fixed at construction (their references are taken alone)."""

    def __init__(self, config: MixConfig, model: str) -> None:
        self.config, self.model = config, model
        self._random = random.Random(config.seed)
        self._count = 0
        self.prefixes = [" ".join(self._random.choices(WORDS, k=config.prefix_words))
                         for _ in range(config.num_prefixes)]
        self.probes = [self._probe_body(i) for i in range(config.num_probes)]

    def next(self, allow_faults: bool = True) -> SoakRequest:
        """The next request; `allow_faults` False leaves out disconnects and malformed bodies."""
        r, c = self._random, self.config
        self._count += 1
        if allow_faults and r.random() < c.malformed_fraction:
            case = r.choice(MALFORMED)
            return SoakRequest(self._count, case.endpoint, malformed=case, tags=["malformed"])
        probe = r.randrange(len(self.probes)) if r.random() < c.greedy_fraction else None
        body = dict(self.probes[probe]) if probe is not None else self._random_body()
        body.update(stream=r.random() < 0.5, n=r.choice((1, 1, 1, 2, 3)))
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        request = SoakRequest(self._count, body.pop("_endpoint"), body, probe=probe)
        if allow_faults and r.random() < c.disconnect_fraction:
            request.disconnect_after = (r.randint(0, body["max_tokens"]) if body["stream"]
                                        else r.uniform(0.0, 1.0))
            request.tags.append("disconnect")
        return request

    def probe_alone(self, index: int) -> SoakRequest:
        """Probe `index` as its reference is taken: non-streaming, n = 1."""
        body = dict(self.probes[index])
        return SoakRequest(0, body.pop("_endpoint"), {**body, "stream": False, "n": 1}, probe=index)

    def _prompt(self) -> str:
        r = self._random
        return f"{r.choice(self.prefixes)} {' '.join(r.choices(WORDS, k=r.randint(1, 12)))}"

    def _base(self, endpoint: str) -> dict:
        body = {"_endpoint": endpoint, "model": self.model, "return_token_ids": True,
                "max_tokens": self._random.randint(1, self.config.max_tokens)}
        if endpoint == "/v1/completions":
            body["prompt"] = self._prompt()
        else:
            body["messages"] = [{"role": "user", "content": self._prompt()}]
        return body

    def _random_body(self) -> dict:
        r = self._random
        body = self._base(r.choice(("/v1/completions", "/v1/chat/completions")))
        body.update(temperature=r.choice((0.7, 1.0)), top_p=r.choice((0.9, 1.0)))
        if r.random() < 0.5:
            body["seed"] = r.randrange(1 << 30)
        if r.random() < 0.2:
            body["stop"] = r.sample(STOP_STRINGS, r.randint(1, 2))
        if r.random() < 0.2:
            if body["_endpoint"] == "/v1/completions":
                body["logprobs"] = 2
            else:
                body.update(logprobs=True, top_logprobs=2)
        return body

    def _probe_body(self, index: int) -> dict:
        body = self._base("/v1/completions" if index % 2 == 0 else "/v1/chat/completions")
        body["temperature"] = 0
        if index % 4 == 3:
            body["stop"] = [self._random.choice(STOP_STRINGS)]
        return body
