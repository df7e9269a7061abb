"""RMSNorm, computed the way the HF Llama/Qwen2 reference does (float32 statistics)."""

from typing import Optional, Union

import torch
from torch import nn

from pagedserve.kernels import fused_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
                ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """norm(x); or, given the residual stream, (norm(residual + x), residual + x). The fused kernel
        updates `residual` in place, so pass one that nothing else holds."""
        if fused_ops.fuses_norm(x) and x.dim() == 2:
            if residual is None:
                return fused_ops.rms_norm(x, self.weight, self.eps)
            return fused_ops.rms_norm(x, self.weight, self.eps, residual), residual
        if residual is None:
            return self._norm(x)
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
