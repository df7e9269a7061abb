"""The token embedding table, which --quantization gguf may keep quantized: rows are then dequantized as they
are looked up, and a tied LM head computes its logits from the same records (one copy of the table)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from pagedserve.kernels import quant_gemm

if TYPE_CHECKING:
    from pagedserve.kernels.quant_gemm import QuantizedWeight


class VocabEmbedding(nn.Embedding):
    """Computes like nn.Embedding. `quantized`, set by the loader (QuantizedParts), holds the table as a
    [vocab, hidden] QuantizedWeight; `weight` is then empty (its dtype still the model's)."""

    quantized: Optional["QuantizedWeight"] = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is None:
            return super().forward(input_ids)
        return quant_gemm.rows(input_ids, self.quantized, self.weight.dtype)
