"""Hugging Face checkpoints quantized with AWQ (GEMM layout) or GPTQ (4-bit), read from their tensors into the
quantized matmul's groups of 32 (kind 4: w = d * q + m), so they run on the same kernel as GGUF weights.

From config.json's `quantization_config`:
- AWQ (`quant_method: awq`, `version: gemm`, `bits: 4`, `zero_point: true`): per linear `qweight` int32
  [in, out / 8] with 8 output columns per word in AWQ's order (nibble i holds column 8c + [0, 2, 4, 6, 1, 3, 5,
  7][i]), `qzeros` int32 [in / group, out / 8] packed the same way, `scales` [in / group, out];
  w = (q - z) * s.
- GPTQ (`quant_method: gptq`, `bits: 4`): `qweight` int32 [in / 8, out] with 8 input rows per word (nibble j:
  row 8r + j), `qzeros` int32 [in / group, out / 8] (nibble j: column 8c + j) holding z - 1 (the original
  `checkpoint_format: gptq`; `gptq_v2` holds z), `scales` [in / group, out], `g_idx` [in] (each input's group;
  with `desc_act: true` not in order: the inputs are then stored sorted by group and the layer gathers its
  input in that order); w = (q - z) * s.
A group of 128 inputs is four groups of 32 with the same scale and offset (group_size -1: one group per
column); the packed weight keeps one float16 scale and zero point per group, as the checkpoint does
(GroupScales), where the scales are float16 values. Anything else (other bit widths, AWQ's GEMV or Marlin layouts, groups that are not a multiple of 32,
other quant_methods) is refused at load, before the weights are read, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pagedserve.kernels.quant_gemm import GroupScales
from pagedserve.quantization.quantized_tensor import QuantizedTensor

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AWQ's GEMM packing: nibble i of a word holds output column 8c + AWQ_ORDER[i]."""
TENSOR_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class QuantizationConfig:
    method: str  # "awq" or "gptq"
    group_size: int
    zeros_minus_one: bool  # GPTQ's original checkpoint format stores z - 1
    desc_act: bool

    @staticmethod
    def from_hf(config: dict) -> "QuantizationConfig":
        """A checked quantization_config; a ValueError naming what is not supported."""
        method = str(config.get("quant_method", "")).lower()
        bits = config.get("bits", config.get("w_bit"))
        group = config.get("group_size", config.get("q_group_size"))
        if method not in ("awq", "gptq"):
            raise ValueError(f"quantization_config.quant_method {method!r} is not supported (supported: awq, gptq)")
        if bits != 4:
            raise ValueError(f"{method} with bits={bits} is not supported (only 4-bit)")
        if not isinstance(group, int) or (group != -1 and (group <= 0 or group % 32)):
            raise ValueError(f"{method} group_size={group} is not supported (a positive multiple of 32, or -1)")
        if method == "awq":
            version = str(config.get("version", "gemm")).lower()
            if version != "gemm" or not config.get("zero_point", True):
                raise ValueError(f"awq version={version!r}, zero_point={config.get('zero_point')} is not supported "
                                 "(only the GEMM layout with zero points)")
            return QuantizationConfig("awq", group, False, False)
        if config.get("is_marlin_format"):
            raise ValueError("gptq in the Marlin format is not supported (the GPTQ layout: qweight/qzeros/scales)")
        fmt = str(config.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq checkpoint_format={fmt!r} is not supported (gptq, gptq_v2)")
        return QuantizationConfig("gptq", group, fmt == "gptq", bool(config.get("desc_act", False)))


def _nibbles_of(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., w] -> their 8 nibbles [..., w, 8] (nibble j = bits 4j..4j+3), as uint8."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((words.to(torch.int32).unsqueeze(-1) >> shifts) & 15).to(torch.uint8)


def _columns(words: torch.Tensor, order: Optional[tuple[int, ...]]) -> torch.Tensor:
    """[rows, out / 8] words packed along the output -> [rows, out] nibbles in column order."""
    nibbles = _nibbles_of(words)  # [rows, out / 8, 8]
    if order is not None:  # nibble i is column 8c + order[i]
        nibbles = nibbles[..., torch.argsort(torch.tensor(order))]
    return nibbles.reshape(words.shape[0], -1)


def to_quantized_tensor(name: str, tensors: dict[str, torch.Tensor], config: QuantizationConfig
                        ) -> QuantizedTensor:
    """One linear's checkpoint tensors (keys: TENSOR_SUFFIXES present) -> codes [out, in], per-32 scales and
    offsets; a ValueError naming the tensor when one is missing or has the wrong shape."""
    for key in ("qweight", "qzeros", "scales"):
        if key not in tensors:
            raise ValueError(f"{config.method} checkpoint lacks {name}.{key}")
    scales = tensors["scales"].float()  # [groups, out]
    groups, out = scales.shape
    if config.method == "awq":
        codes = _columns(tensors["qweight"], AWQ_ORDER)  # [in, out]
        zeros = _columns(tensors["qzeros"], AWQ_ORDER)  # [groups, out]
    else:
        qweight = tensors["qweight"]
        codes = _nibbles_of(qweight).permute(0, 2, 1).reshape(qweight.shape[0] * 8, qweight.shape[1])
        zeros = _columns(tensors["qzeros"], None)
        if config.zeros_minus_one:
            zeros = zeros + 1  # nibble wrap-around: a stored 15 with z - 1 convention means z = 16, kept in int
    in_features = codes.shape[0]
    group_size = in_features if config.group_size == -1 else config.group_size  # -1: one group per column
    if group_size % 32:
        raise ValueError(f"{name}: {in_features} inputs in one group are not a multiple of 32")
    _check_shapes(name, codes, zeros, scales, in_features, groups, out, group_size)
    if config.desc_act and "g_idx" not in tensors:
        raise ValueError(f"gptq with desc_act needs {name}.g_idx")
    group_of = _group_index(name, tensors.get("g_idx"), group_size, in_features)
    order = None
    if not torch.equal(group_of, torch.arange(in_features) // group_size):
        order = torch.argsort(group_of, stable=True)  # inputs sorted by group: each group contiguous again
        if not torch.equal(group_of[order], torch.arange(in_features) // group_size):
            raise ValueError(f"{name}.g_idx does not give each group exactly group_size={group_size} inputs")
        codes = codes[order]
    z = zeros.float()
    per_32 = group_size // 32
    d = scales.repeat_interleave(per_32, dim=0).T.contiguous()  # [out, in / 32]
    m = (-(z * scales)).repeat_interleave(per_32, dim=0).T.contiguous()
    return QuantizedTensor(name, config.method.upper(), codes.T.contiguous(), d, m, 4, order,
                           group_scales=_group_scales(scales, z, group_size))


def _group_scales(scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> Optional[GroupScales]:
    """The checkpoint's scales kept per group (float16 d, uint8 z: nibbles, or 16 for GPTQ's wrapped 15), where
    float16 holds them exactly (bfloat16 or float32 scales may not); None (per-32 float32 scales) where not."""
    if not torch.equal(scales.half().float(), scales):
        return None
    return GroupScales(scales.half().T.contiguous(), zeros.to(torch.uint8).T.contiguous(), group_size)


def _check_shapes(name, codes, zeros, scales, in_features, groups, out, group_size) -> None:
    if codes.shape[1] != out or zeros.shape != (groups, out):
        raise ValueError(f"{name}: qweight / qzeros / scales shapes {tuple(codes.shape)} / {tuple(zeros.shape)} / "
                         f"({groups}, {out}) do not fit a [{out}, {in_features}] weight")
    if in_features != groups * group_size:
        raise ValueError(f"{name}.scales has {groups} groups; {in_features} inputs in groups of "
                         f"{group_size} need {in_features // group_size}")


def _group_index(name: str, g_idx: Optional[torch.Tensor], group_size: int, in_features: int) -> torch.Tensor:
    natural = torch.arange(in_features) // group_size
    if g_idx is None:
        return natural
    if g_idx.shape != (in_features,):
        raise ValueError(f"{name}.g_idx has shape {tuple(g_idx.shape)}, expected ({in_features},)")
    return g_idx.to(torch.int64)
