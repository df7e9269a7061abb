import torch
import torch.nn.functional as F

from pagedserve.kernels import fused_ops


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [.., 2 * d] gate/up projection: silu(gate) * up (in one C pass on CPU bfloat16)."""
    if gate_up.dim() == 2 and fused_ops.fuses_swiglu(gate_up):
        return fused_ops.swiglu(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
