"""A linear weight kept quantized, as the loaders hand it to the model: codes, per-32 scales and offsets
(quant_gemm's kinds 8, 4 and 6), and QuantizedParts, which joins a fused linear's shards into one
QuantizedWeight (or dequantizes them where it cannot). gguf_weights.py and hf_quantized.py make them."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from pagedserve.kernels.quant_gemm import GroupScales, SuperScales

logger = logging.getLogger(__name__)


@dataclass
class QuantizedTensor:
    """A weight left quantized by a loader (GGUF, AWQ, GPTQ): [out_features, in_features] in groups of 32 along in_features."""

    name: str
    qtype: object
    """The GGUF type (a GGMLQuantizationType), or the checkpoint's method for HF checkpoints ("AWQ", "GPTQ")."""
    codes: torch.Tensor
    """[N, K]: int8 (kind 8), uint8 0..15 (kind 4) or uint8 0..63 (kind 6: w = scale * (q - 32))."""
    scales: torch.Tensor
    """[N, K / 32] float32 ([N, K / 16] for kind 6)."""
    offsets: torch.Tensor
    """[N, K / 32] float32 (zeros for kind 8)."""
    kind: int
    input_order: Optional[torch.Tensor] = None
    """GPTQ with act-order: the input features in the order the codes' columns are stored (their groups are
    then contiguous); the layer gathers its input in this order first. None: the natural order."""
    super_scales: Optional[SuperScales] = None
    """Q4_K / Q6_K: the scales as the file holds them (`scales` and `offsets` are their products), which the
    packed weight keeps instead of float32 scales."""
    group_scales: Optional[GroupScales] = None
    """AWQ / GPTQ: a float16 scale and an integer zero point per group of inputs, as the checkpoint holds them
    (`scales` and `offsets` are what they give per 32), kept by the packed weight instead of float32 scales."""

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def source(self) -> str:
        return getattr(self.qtype, "name", str(self.qtype))

    def rows(self, index: torch.Tensor) -> "QuantizedTensor":
        """The same weight with its output rows reordered (llama's q/k un-permutation)."""
        return QuantizedTensor(self.name, self.qtype, self.codes[index], self.scales[index],
                               self.offsets[index], self.kind, self.input_order,
                               None if self.super_scales is None else self.super_scales.rows(index),
                               None if self.group_scales is None else self.group_scales.rows(index))

    def dequantize(self) -> torch.Tensor:
        """The float32 weight (the reference the kernel is tested against)."""
        n, k = self.codes.shape
        group = 16 if self.kind == 6 else 32
        q = (self.codes.view(torch.int8) if self.kind == 8 else self.codes).float().view(n, k // group, group)
        if self.kind == 6:
            q = q - 32.0
        w = q * self.scales.unsqueeze(-1)
        if self.kind == 4:
            w = w + self.offsets.unsqueeze(-1)
        w = w.view(n, k)
        if self.input_order is not None:  # back to the natural input order
            w = torch.empty_like(w).index_copy_(1, self.input_order, w)
        return w


class QuantizedParts:
    """The quantized tensors a model's load_weights meets, by parameter (a fused one has several shards): as
    soon as every shard of a linear (or the embedding table) is in, `add` gives the module its QuantizedWeight
    and drops its float weight, so that a load holds the unpacked codes of one linear at a time. Shards of
    different kinds (Q4_K_M files: Q4_K q/k with a Q6_K v) are packed each alone and joined
    (QuantizedWeight.pack_shards). `finish` dequantizes what is left: linears only partly quantized (logged)."""

    def __init__(self, model: torch.nn.Module, num_shards, allocate=None) -> None:
        """allocate: where packed weights go (quant_gemm.Allocate; default: new tensors)."""
        self._model, self._num_shards, self._allocate = model, num_shards, allocate
        self._parts: dict[str, dict[int, tuple[QuantizedTensor, torch.Tensor]]] = {}

    def add(self, target: str, shard: int, tensor: QuantizedTensor, dest: torch.Tensor) -> bool:
        """Whether this completed the target: it is then packed, and its float weight gone (the caller drops
        its own references to it, so that its memory is freed now)."""
        parts = self._parts.setdefault(target, {})
        parts[shard] = (tensor, dest)
        tensors = [parts[i][0] for i in sorted(parts)]
        if len(parts) < self._num_shards(target) or _why_not_packed(tensors, len(parts)):
            return False
        del self._parts[target]
        self._attach(target, tensors)
        return True

    def finish(self) -> None:
        """Dequantize, into their float weights, the parts of every linear that could not be packed."""
        for target, parts in self._parts.items():
            tensors = [parts[i][0] for i in sorted(parts)]
            logger.info("%s: %s; dequantized", target, _why_not_packed(tensors, self._num_shards(target)))
            for tensor, dest in parts.values():
                dest.copy_(tensor.dequantize())
        self._parts.clear()

    def _attach(self, target: str, tensors: list[QuantizedTensor]) -> None:
        from pagedserve.kernels.quant_gemm import QuantizedWeight
        from pagedserve.layers.linear import empty_weight

        module = self._model.get_submodule(target.removesuffix(".weight"))
        if len({_storage(t) for t in tensors}) == 1:
            supers, groups = [t.super_scales for t in tensors], [t.group_scales for t in tensors]
            module.quantized = QuantizedWeight.pack(
                torch.cat([t.codes for t in tensors]), torch.cat([t.scales for t in tensors]),
                torch.cat([t.offsets for t in tensors]), tensors[0].kind,
                "+".join(sorted({t.source for t in tensors})),
                super_scales=None if supers[0] is None else SuperScales.cat(supers),
                group_scales=None if groups[0] is None else GroupScales.cat(groups), allocate=self._allocate)
        else:
            module.quantized = QuantizedWeight.pack_shards(
                [QuantizedWeight.pack(t.codes, t.scales, t.offsets, t.kind, t.source, super_scales=t.super_scales,
                                      group_scales=t.group_scales) for t in tensors], allocate=self._allocate)
        module.input_order = tensors[0].input_order
        module.weight = empty_weight(module.weight)


def _storage(tensor: QuantizedTensor) -> tuple[int, bool, Optional[int]]:
    """What decides a packed layout: the kind, whether the scales come as super-block factors, and the group
    size of scales per group."""
    return tensor.kind, tensor.super_scales is not None, getattr(tensor.group_scales, "group_size", None)


def _why_not_packed(tensors: list[QuantizedTensor], num_shards: int) -> Optional[str]:
    """Why the shards of one linear cannot become one QuantizedWeight (None: they can)."""
    columns = tensors[0].shape[1]
    if len(tensors) < num_shards:
        return f"only {len(tensors)} of its {num_shards} shards are quantized"
    if len({_storage(t) for t in tensors}) > 1 and any(t.shape[0] % 16 for t in tensors):
        return f"shards of mixed types ({', '.join(t.source for t in tensors)}) not each a multiple of 16 rows"
    if sum(t.shape[0] for t in tensors) % 16 or columns % 32:
        return f"shape [{sum(t.shape[0] for t in tensors)}, {columns}] is not a multiple of [16, 32]"
    orders = [t.input_order for t in tensors]
    if any(o is not None for o in orders) and not all(o is not None and torch.equal(o, orders[0]) for o in orders):
        return "its shards order their inputs differently (GPTQ act-order)"
    return None
