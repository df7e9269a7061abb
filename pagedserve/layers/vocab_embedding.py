"""The token embedding table, which --quantization gguf may keep quantized: rows are then dequantized as they
are looked up, and a tied LM head computes its logits from the same records (one copy of the table). A tied
bf16 table of a model whose linears are kept quantized is held once too, laid out for the LM head's small-batch
kernel, and rows are read from that layout."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from pagedserve.kernels import quant_gemm, skinny_gemm

if TYPE_CHECKING:
    from pagedserve.kernels.quant_gemm import QuantizedWeight


class VocabEmbedding(nn.Embedding):
    """Computes like nn.Embedding. `quantized`, set by the loader (QuantizedParts), holds the table as a
    [vocab, hidden] QuantizedWeight; `weight` is then empty (its dtype still the model's)."""

    quantized: Optional["QuantizedWeight"] = None
    packed: Optional[skinny_gemm.PackedWeight] = None
    """Set by the model (LlamaForCausalLM.pack_for_small_batches) when the tied LM head's packed copy is the
    table's only copy; `weight` is then empty (bf16)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return quant_gemm.rows(input_ids, self.quantized, self.weight.dtype)
        if self.packed is not None:
            return skinny_gemm.rows(input_ids, self.packed)
        return super().forward(input_ids)
