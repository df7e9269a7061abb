"""GGUF weights kept quantized: a tensor's raw blocks -> the quantized matmul's codes, scales and offsets.

Q8_0 becomes kind 8 (w = d * q); Q4_0, Q4_1 and Q4_K become kind 4 (w = d * q + m, q in 0..15, per group of
32 along the input dimension: Q4_0's m is -8d, Q4_K's 32-value sub-blocks carry d * scale and -dmin * min).
The values are exactly those loader/gguf_quants.py dequantizes to (every product of a code and a scale is
exact in float32, so d * q + (-8d) is (q - 8) * d), so the kernel computes with the weights the float path
would have loaded. Other types (Q6_K, ...) are dequantized on load.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from pagedserve.loader.gguf_quants import _half, _nibbles, q4_k_groups

logger = logging.getLogger(__name__)

KEPT_TYPES = frozenset({QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q4_K})


@dataclass
class GGUFQuantizedTensor:
    """A weight left quantized by the loader: [out_features, in_features] in groups of 32 along in_features."""

    name: str
    qtype: object
    """The GGUF type (a GGMLQuantizationType), or the checkpoint's method for HF checkpoints ("AWQ", "GPTQ")."""
    codes: torch.Tensor
    """[N, K]: int8 (kind 8) or uint8 0..15 (kind 4)."""
    scales: torch.Tensor
    """[N, K / 32] float32."""
    offsets: torch.Tensor
    """[N, K / 32] float32 (zeros for kind 8)."""
    kind: int
    input_order: Optional[torch.Tensor] = None
    """GPTQ with act-order: the input features in the order the codes' columns are stored (their groups are
    then contiguous); the layer gathers its input in this order first. None: the natural order."""

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def source(self) -> str:
        return getattr(self.qtype, "name", str(self.qtype))

    def rows(self, index: torch.Tensor) -> "GGUFQuantizedTensor":
        """The same weight with its output rows reordered (llama's q/k un-permutation)."""
        return GGUFQuantizedTensor(self.name, self.qtype, self.codes[index], self.scales[index],
                                   self.offsets[index], self.kind, self.input_order)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight (the reference the kernel is tested against)."""
        n, k = self.codes.shape
        q = (self.codes.view(torch.int8) if self.kind == 8 else self.codes).float().view(n, k // 32, 32)
        w = q * self.scales.unsqueeze(-1)
        if self.kind == 4:
            w = w + self.offsets.unsqueeze(-1)
        w = w.view(n, k)
        if self.input_order is not None:  # back to the natural input order
            w = torch.empty_like(w).index_copy_(1, self.input_order, w)
        return w


def from_gguf(name: str, raw: np.ndarray, qtype: QType, shape: tuple[int, int]) -> GGUFQuantizedTensor:
    """One GGUF tensor (raw data, numpy-order shape [N, K]) as codes/scales/offsets."""
    if qtype not in KEPT_TYPES:
        raise ValueError(f"GGUF type {qtype.name} is not kept quantized (kept: {', '.join(sorted(t.name for t in KEPT_TYPES))})")
    n, k = shape
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = torch.from_numpy(np.ascontiguousarray(raw).reshape(-1).view(np.uint8)).reshape(-1, type_size)
    if qtype == QType.Q8_0:
        codes, scales, offsets, kind = blocks[:, 2:].clone(), _half(blocks, 0), None, 8
    elif qtype in (QType.Q4_0, QType.Q4_1):
        codes = _nibbles(blocks[:, 2 if qtype == QType.Q4_0 else 4:])
        scales = _half(blocks, 0)
        offsets = -8.0 * scales if qtype == QType.Q4_0 else _half(blocks, 2)
        kind = 4
    else:
        codes, scales, offsets, kind = _q4_k_groups(blocks)
    groups = k // 32
    scales = scales.reshape(n, groups).contiguous()
    offsets = torch.zeros_like(scales) if offsets is None else offsets.reshape(n, groups).contiguous()
    return GGUFQuantizedTensor(name, qtype, codes.reshape(n, k).contiguous(), scales, offsets, kind)


def _q4_k_groups(blocks: torch.Tensor):
    """Q4_K super-blocks of 256 as 8 groups of 32 each (the float loader's own split, gguf_quants.q4_k_groups)."""
    codes, scales, mins = q4_k_groups(blocks)
    return codes.reshape(blocks.shape[0], 256), scales, -mins, 4


class QuantizedParts:
    """The quantized tensors a model's load_weights met, by parameter (a fused one has several shards): once
    every shard of a linear is in, `attach` gives the Linear its QuantizedWeight and drops its float weight.
    A fused linear whose shards are of different kinds (say Q4_K q/k with a Q8_0 v), or only partly
    quantized, is dequantized into its float weight instead (logged)."""

    def __init__(self) -> None:
        self._parts: dict[str, dict[int, tuple[GGUFQuantizedTensor, torch.Tensor]]] = {}

    @property
    def targets(self) -> list[str]:
        return list(self._parts)

    def add(self, target: str, shard: int, tensor: GGUFQuantizedTensor, dest: torch.Tensor) -> None:
        self._parts.setdefault(target, {})[shard] = (tensor, dest)

    def attach(self, model: torch.nn.Module, num_shards: dict[str, int]) -> None:
        from pagedserve.kernels.quant_gemm import QuantizedWeight

        for target, parts in self._parts.items():
            tensors = [parts[i][0] for i in sorted(parts)]
            reason = _why_not_packed(tensors, num_shards[target])
            if reason:
                logger.info("%s: %s; dequantized", target, reason)
                for tensor, dest in parts.values():
                    dest.copy_(tensor.dequantize())
                continue
            linear = model.get_submodule(target.removesuffix(".weight"))
            linear.quantized = QuantizedWeight.pack(
                torch.cat([t.codes for t in tensors]), torch.cat([t.scales for t in tensors]),
                torch.cat([t.offsets for t in tensors]), tensors[0].kind,
                "+".join(sorted({t.source for t in tensors})))
            linear.input_order = tensors[0].input_order
            linear.weight = torch.nn.Parameter(torch.empty(0, dtype=linear.weight.dtype), requires_grad=False)


def _why_not_packed(tensors: list[GGUFQuantizedTensor], num_shards: int) -> Optional[str]:
    """Why the shards of one linear cannot become one QuantizedWeight (None: they can)."""
    rows, columns = sum(t.shape[0] for t in tensors), tensors[0].shape[1]
    if len(tensors) < num_shards or len({t.kind for t in tensors}) > 1:
        return f"shards of mixed types ({', '.join(t.source for t in tensors)})"
    if rows % 16 or columns % 32:
        return f"shape [{rows}, {columns}] is not a multiple of [16, 32]"
    orders = [t.input_order for t in tensors]
    if any(o is not None for o in orders) and not all(o is not None and torch.equal(o, orders[0]) for o in orders):
        return "its shards order their inputs differently (GPTQ act-order)"
    return None
