"""The offline API: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

from typing import Optional, Sequence, Union

from pagedserve.engine.llm_engine import LLMEngine, PromptType
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

Conversation = list[dict]


class LLM:
    """Batch generation on one engine. Keyword arguments are the engine arguments (see EngineConfig):
    dtype, max_model_len, max_num_seqs, max_num_batched_tokens, block_size, kv_cache_memory_bytes, kv_cache_dtype,
    enable_lora, max_loras, max_lora_rank, max_cpu_loras, ..."""

    def __init__(self, model: Optional[str] = None, **engine_kwargs) -> None:
        self.engine = LLMEngine.from_kwargs(model=model, **engine_kwargs)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True, priority: Optional[Sequence[int]] = None,
                 lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        A prompt is a string, {"prompt_token_ids": [...]} or a list of token ids. `sampling_params` is one
        SamplingParams for all prompts or one per prompt. `priority` (one int per prompt, lower runs first,
        as in vLLM) needs scheduling_policy="priority" or "fair". `lora_request` (enable_lora=True) is one
        LoRARequest for all prompts or one per prompt, None entries running on the base model.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompts)} prompts")
        loras = _per_prompt(lora_request, len(prompts))
        request_ids = []
        try:
            for prompt, params, prio, lora in zip(prompts, params_list, priorities, loras):
                request_id = self.engine.new_request_id()
                self.engine.add_request(request_id, prompt, params, priority=prio, lora_request=lora)
                request_ids.append(request_id)
            return self._run(request_ids, use_tqdm)
        except BaseException:
            self.engine.abort_request(request_ids)  # nothing stays queued after an error or Ctrl-C
            raise

    def chat(self, messages: Union[Conversation, Sequence[Conversation]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             add_generation_prompt: bool = True, use_tqdm: bool = True,
             lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer (the engine was started with skip_tokenizer_init)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
                   for text in (tokenizer.apply_chat_template(c, tokenize=False,
                                                              add_generation_prompt=add_generation_prompt)
                                for c in conversations)]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache, as vLLM's LLM.reset_prefix_cache: later prompts are computed afresh."""
        return self.engine.reset_prefix_cache()

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm and len(request_ids) > 1:
            from tqdm import tqdm

            progress = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()
        return [finished[request_id] for request_id in request_ids]


def _per_prompt(lora_request, num_prompts: int) -> list[Optional[LoRARequest]]:
    """One LoRARequest (or None) for every prompt, or a list with one per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if not isinstance(lora_request, (list, tuple)):
        raise ValueError(f"lora_request must be a LoRARequest, a list with one per prompt, or None; got "
                         f"{type(lora_request).__name__}")
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(f"got {len(loras)} lora_requests for {num_prompts} prompts")
    return loras
