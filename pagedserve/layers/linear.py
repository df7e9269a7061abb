"""nn.Linear with a second copy of its weight laid out for small batches on CPU (kernels/skinny_gemm.py)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import skinny_gemm


class Linear(nn.Linear):
    """Computes like nn.Linear. After `pack_for_small_batches()` (CPU, bfloat16, where the kernel builds),
    inputs of at most skinny_gemm.MAX_ROWS rows use the packed copy: a decode step with a few sequences is
    then bound by reading the weights once, not by the BLAS re-laying them out. Call it again if the weight
    changes."""

    packed: Optional[skinny_gemm.PackedWeight] = None

    def pack_for_small_batches(self, out: Optional[torch.Tensor] = None) -> bool:
        """Pack the weight (into `out`, sized by PackedWeight.packed_shape, when given)."""
        self.packed = skinny_gemm.PackedWeight.of(self.weight, out)
        return self.packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.dim() == 2 and x.shape[0] <= skinny_gemm.MAX_ROWS:
            return skinny_gemm.linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)
