"""nn.Linear with a copy of its weight laid out for the CPU's kernel (bf16: kernels/skinny_gemm.py; float32 on
AVX2-only CPUs: kernels/f32_gemm.py), and the model's one LoRA hook: an optional reference to its LoRA slots
(lora/layers.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.executor.forward_context import get_lora_mapping
from pagedserve.kernels import f32_gemm, fused_ops, quant_gemm, skinny_gemm
from pagedserve.layers.activation import silu_and_mul

if TYPE_CHECKING:
    from pagedserve.kernels.quant_gemm import QuantizedWeight
    from pagedserve.lora.layers import LinearLoRA


def empty_weight(like: torch.Tensor) -> nn.Parameter:
    """The weight of a layer that holds it elsewhere (packed only, or kept quantized): empty, of like's dtype."""
    return nn.Parameter(torch.empty(0, dtype=like.dtype), requires_grad=False)


class Linear(nn.Linear):
    """Computes like nn.Linear. After `pack_for_small_batches()` (CPU, bfloat16, where the kernel builds),
    inputs of at most skinny_gemm.MAX_ROWS rows use the packed copy: a decode step with a few sequences is
    then bound by reading the weights once, not by the BLAS re-laying them out. Call it again if the weight
    changes. A float32 weight on an AVX2-only CPU is packed for kernels/f32_gemm.py instead (`packed_f32`),
    which takes every batch size faster than torch there, so the plain weight is dropped.

    With LoRA on, `lora` holds the stacked adapter weights of every slot: when the step has rows with an
    adapter, their delta is added to the base output, which is computed exactly as without LoRA."""

    packed: Optional[skinny_gemm.PackedWeight] = None
    packed_f32: Optional[f32_gemm.PackedWeight] = None
    lora: Optional["LinearLoRA"] = None
    quantized: Optional["QuantizedWeight"] = None
    """Set by the loader for kept-quantized weights (--quantization gguf, AWQ and GPTQ checkpoints): every batch
    size computes from them (kernels/quant_gemm.py); `weight` is then empty."""
    input_order: Optional[torch.Tensor] = None
    """With `quantized` from a GPTQ act-order checkpoint: the order of the input features in its columns."""

    @property
    def held_packed_only(self) -> bool:
        """Whether the packed copy is the weight's only copy (`weight` then empty): where the packed kernel takes
        every batch as fast as torch (skinny_gemm.takes_every_batch, and f32_gemm wherever it runs)."""
        return (self.packed is not None or self.packed_f32 is not None) and self.weight.numel() == 0

    def pack_for_small_batches(self, out: Optional[torch.Tensor] = None) -> bool:
        """Pack the weight (into `out`, sized by PackedWeight.packed_shape, when given); where the packed kernel
        takes every batch, drop the plain weight then (one copy in memory)."""
        if self.quantized is not None:
            return False
        if self.held_packed_only:
            return True
        if self.weight.dtype == torch.float32:
            self.packed_f32 = f32_gemm.PackedWeight.of(self.weight, out)
            if self.packed_f32 is not None:
                self.weight = empty_weight(self.weight)
            return self.packed_f32 is not None
        self.packed = skinny_gemm.PackedWeight.of(self.weight, out)
        if self.packed is not None and skinny_gemm.takes_every_batch():
            self.weight = empty_weight(self.weight)
        return self.packed is not None

    def forward_swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this fused gate/up projection (gate rows first) of x: silu_and_mul(self(x)) bit for
        bit. Where the packed kernel ends in SwiGLU (skinny_gemm.fuses_swiglu) and no adapter delta is due, one
        pass that never stores the projection."""
        if (self.quantized is None and x.dim() == 2 and self._uses_packed(x) and fused_ops.fuses_swiglu(x)
                and (self.lora is None or get_lora_mapping() is None) and skinny_gemm.fuses_swiglu(self.packed)):
            return skinny_gemm.linear_swiglu(x, self.packed, self.bias)
        return silu_and_mul(self(x))

    def _uses_packed(self, x: torch.Tensor) -> bool:
        """Whether x goes through the packed copy (when the weight is not kept quantized)."""
        return self.packed is not None and (self.held_packed_only
                                            or (x.dim() == 2 and x.shape[0] <= skinny_gemm.MAX_ROWS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            rows = x.reshape(-1, x.shape[-1])
            out = quant_gemm.linear(rows, self.quantized, self.bias, self.input_order).view(*x.shape[:-1], -1)
        elif self.packed_f32 is not None:
            rows = x.reshape(-1, x.shape[-1])
            out = f32_gemm.linear(rows, self.packed_f32, self.bias).view(*x.shape[:-1], -1)
        elif self._uses_packed(x):
            rows = x.reshape(-1, x.shape[-1])
            out = skinny_gemm.linear(rows, self.packed, self.bias).view(*x.shape[:-1], -1)
        else:
            out = F.linear(x, self.weight, self.bias)
        if self.lora is not None:
            mapping = get_lora_mapping()
            if mapping is not None:
                self.lora.add_delta(x, out, mapping)
        return out
