"""Prompt + SamplingParams -> the core's child Requests, checked on the front end before the core sees them.

Both front ends (`LLMEngine` in-process, `AsyncLLM` over the engine-core process) use this, so a request is
validated and tokenized in one place, and a bad one fails at once with a ValueError instead of travelling to
the core.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Union

from pagedserve.core.request import Request
from pagedserve.lora.request import LoRARequest
from pagedserve.sampling_params import SamplingParams

PromptType = Union[str, dict, list[int]]


@dataclass
class ProcessedRequest:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    children: list[Request]

    @property
    def child_ids(self) -> list[str]:
        return [child.request_id for child in self.children]


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: frozenset[int],
                 scheduling_policy: str = "fcfs", enable_lora: Optional[bool] = None) -> None:
        """`enable_lora` False refuses requests with a LoRA adapter here; None leaves that to the core."""
        self.tokenizer = tokenizer
        self.enable_lora = enable_lora
        self.scheduling_policy = scheduling_policy
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self._valid_constraints: set[tuple] = set()  # structured_outputs keys already checked

    def tokenize_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """A prompt is text, vLLM's {"prompt_token_ids": [...]} (or {"prompt": text}) or a list of ids."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (the engine was started with skip_tokenizer_init)")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, self._check_token_ids(prompt)
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}: expected str, dict or list of ids")

    def _check_token_ids(self, ids) -> list[int]:
        vocab = self.vocab_size
        ids = list(ids)
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        return ids

    def _check_token_params(self, params: SamplingParams) -> None:
        """Token ids inside the params must exist in the vocabulary (the sampler indexes logits with them)."""
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {})):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name} has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")

    def check_structured_outputs(self, constraint) -> None:
        """A constraint (StructuredOutputsParams) the grammar library cannot compile, or would not enforce,
        fails here (ValueError)."""
        if constraint is None:
            return
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer (the engine was started with skip_tokenizer_init)")
        key = constraint.key()
        if key not in self._valid_constraints:
            from pagedserve.structured_output import grammar

            grammar.validate(constraint)
            if len(self._valid_constraints) >= 1024:
                self._valid_constraints.clear()
            self._valid_constraints.add(key)

    def _check_length(self, request_id: str, num_prompt_tokens: int) -> None:
        if num_prompt_tokens == 0:
            raise ValueError(f"request {request_id}: the prompt is empty")
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"request {request_id}: prompt has {num_prompt_tokens} tokens, which leaves no room "
                f"to generate within max_model_len={self.max_model_len}")

    def _check_lora_request(self, lora_request: Optional[LoRARequest]) -> None:
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        if self.enable_lora is False:
            raise ValueError(f"lora_request {lora_request.lora_name!r} needs the engine started with "
                             "enable_lora=True (--enable-lora)")

    def process(self, request_id: str, prompt: PromptType, params: Optional[SamplingParams] = None,
                arrival_time: Optional[float] = None, cache_salt: Optional[str] = None, priority: int = 0,
                tenant: Optional[str] = None, lora_request: Optional[LoRARequest] = None) -> ProcessedRequest:
        """Check and tokenize one request; n > 1 becomes n children with ids "{i}_{request_id}" and seeds
        params.child(i). `cache_salt` (also read from a prompt dict's "cache_salt") isolates prefix caching;
        `priority` (lower runs first) and `tenant` are for the scheduling policy; `lora_request` picks a
        LoRA adapter (None: the base model), which the core loads and checks on admission."""
        self._check_lora_request(lora_request)
        if cache_salt is None and isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.scheduling_policy == "fcfs":
            # As vLLM: a priority that would be ignored is an error, not a silent no-op.
            raise ValueError(f"priority {priority} needs scheduling_policy 'priority' or 'fair' "
                             "(this engine schedules first come, first served)")
        if tenant is not None and not isinstance(tenant, str):
            raise ValueError(f"tenant must be a string, got {type(tenant).__name__}")
        params = params or SamplingParams()
        self._check_token_params(params)
        self.check_structured_outputs(params.structured_outputs)
        text, token_ids = self.tokenize_prompt(prompt)
        self._check_length(request_id, len(token_ids))
        arrival_time = time.time() if arrival_time is None else arrival_time
        child_ids = [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        children = [Request(child_id, token_ids, params if params.n == 1 else params.child(i), self.eos_token_ids,
                            arrival_time=arrival_time, cache_salt=cache_salt, priority=priority, tenant=tenant,
                            lora_request=lora_request)
                    for i, child_id in enumerate(child_ids)]
        return ProcessedRequest(request_id, text, token_ids, params, arrival_time, children)
