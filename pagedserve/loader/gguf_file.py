"""A fast reader for the GGUF container: metadata as Python values, tensors as memory-mapped byte ranges.

gguf.GGUFReader builds a numpy view per metadata item, which for a 49k-token vocabulary (two 49k-string
lists, scores, types, merges) is ~250k tiny arrays and 2.5 s of a 5 s model load. This reader walks the same
layout with `struct` and returns plain values (0.1 s); the gguf package still supplies the enums and is
what writes files. Layout (GGUF v2/v3, little-endian): magic, version, tensor count, metadata count, the
metadata key/value pairs, the tensor infos, then the tensor data at `general.alignment`.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_MAGIC = b"GGUF"
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_ALIGNMENT = 1 << 20
# What parsing a corrupt header raises (a short read, bad UTF-8, an unknown type code); each becomes a
# ValueError naming the file.
_HEADER_ERRORS = (struct.error, UnicodeDecodeError, ValueError)
# The fewest bytes a metadata item (key length, value type, a 1-byte value) and a tensor info (name length,
# dimension count, type, offset) take: a count is checked against them before it is looped over.
_MIN_FIELD_BYTES, _MIN_TENSOR_INFO_BYTES = 8 + 4 + 1, 8 + 4 + 4 + 8
_SCALARS = {  # value type -> (struct format, numpy dtype)
    GGUFValueType.UINT8: ("<B", np.uint8), GGUFValueType.INT8: ("<b", np.int8),
    GGUFValueType.UINT16: ("<H", np.uint16), GGUFValueType.INT16: ("<h", np.int16),
    GGUFValueType.UINT32: ("<I", np.uint32), GGUFValueType.INT32: ("<i", np.int32),
    GGUFValueType.FLOAT32: ("<f", np.float32), GGUFValueType.BOOL: ("<?", np.bool_),
    GGUFValueType.UINT64: ("<Q", np.uint64), GGUFValueType.INT64: ("<q", np.int64),
    GGUFValueType.FLOAT64: ("<d", np.float64),
}


@dataclass
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    """Dimensions innermost first, as GGUF (and GGUFReader) list them."""
    data: np.ndarray
    """The tensor's bytes (uint8), a view of the memory-mapped file."""


class GGUFFile:
    """`fields`: metadata key -> str, int, float, bool, list[str] or a numpy array (numeric arrays);
    `tensors`: GGUFTensor in file order. Float32 scalars come back as the shortest decimal that round-trips
    (1e-05, not 9.999999747378752e-06), the value the original config had."""

    def __init__(self, path: str) -> None:
        # mode "c" (copy-on-write) maps the file privately and writable, so torch.from_numpy can wrap
        # the data without copying it and without warning about read-only memory. Nothing writes to it.
        self._pos = 0
        try:
            self._map = np.memmap(path, mode="c")
            self._buf = memoryview(self._map)
            self._parse(path)
        except _HEADER_ERRORS as e:
            if isinstance(e, ValueError) and str(e).startswith(path):
                raise
            raise ValueError(f"{path}: corrupt or truncated GGUF header at byte {self._pos} ({e})") from e

    def _parse(self, path: str) -> None:
        if bytes(self._buf[:4]) != _MAGIC:
            raise ValueError(f"{path}: not a GGUF file (magic {bytes(self._buf[:4])!r})")
        self._pos = 4
        version, num_tensors, num_fields = self._unpack("<I"), self._unpack("<Q"), self._unpack("<Q")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
        self._need(num_fields * _MIN_FIELD_BYTES, f"{num_fields} metadata items")
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = self._string()
            self.fields[key] = self._value(GGUFValueType(self._unpack("<I")), key)
        self._need(num_tensors * _MIN_TENSOR_INFO_BYTES, f"{num_tensors} tensor infos")
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            num_dims = self._unpack("<I")
            if num_dims > _MAX_DIMS:
                raise ValueError(f"{path}: tensor {name!r} has {num_dims} dimensions (at most {_MAX_DIMS})")
            dims = [self._unpack("<Q") for _ in range(num_dims)]
            if any(dim >= 1 << 63 for dim in dims):  # ggml's dims are int64, and so are torch's
                raise ValueError(f"{path}: tensor {name!r} has dims {dims}, past int64")
            infos.append((name, dims, GGMLQuantizationType(self._unpack("<I")), self._unpack("<Q")))
        alignment = self.fields.get("general.alignment", 32)
        if not isinstance(alignment, int) or isinstance(alignment, bool) or not 0 < alignment <= _MAX_ALIGNMENT:
            raise ValueError(f"{path}: general.alignment is {alignment!r}, not an alignment (1 to {_MAX_ALIGNMENT})")
        data_start = -(-self._pos // alignment) * alignment
        self.tensors: list[GGUFTensor] = []
        for name, dims, qtype, offset in infos:
            block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
            elements = math.prod(dims)  # Python ints: bogus dims cannot wrap around to a small size
            if elements % block_elems:
                raise ValueError(f"{path}: tensor {name!r} has {elements} elements, not whole {qtype.name} blocks "
                                 f"of {block_elems}")
            nbytes = elements // block_elems * block_bytes
            start = data_start + offset
            if start + nbytes > len(self._map):
                raise ValueError(f"{path}: tensor {name!r} runs past the end of the file (truncated?)")
            self.tensors.append(GGUFTensor(name, qtype, np.array(dims, dtype=np.uint64),
                                           self._map[start:start + nbytes]))

    def _unpack(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _need(self, num_bytes: int, what: str) -> None:
        """A count or length read from the file is checked against what is left of it before anything is
        allocated or looped over: a corrupt 2**63 must not become a huge list or a loop that never ends."""
        if num_bytes > len(self._buf) - self._pos:
            raise ValueError(f"{what} would take {num_bytes} bytes, more than the {len(self._buf) - self._pos} "
                             "left in the file")

    def _string(self) -> str:
        length = self._unpack("<Q")
        self._need(length, "a string")
        text = bytes(self._buf[self._pos:self._pos + length]).decode("utf-8")
        self._pos += length
        return text

    def _value(self, kind: GGUFValueType, key: str) -> Any:
        if kind == GGUFValueType.STRING:
            return self._string()
        if kind == GGUFValueType.ARRAY:
            item_kind, count = GGUFValueType(self._unpack("<I")), self._unpack("<Q")
            if item_kind == GGUFValueType.ARRAY:
                raise ValueError(f"nested arrays are not supported (metadata key {key!r})")
            # A string item takes at least its 8-byte length.
            item_bytes = 8 if item_kind == GGUFValueType.STRING else struct.calcsize(_SCALARS[item_kind][0])
            self._need(count * item_bytes, f"the {count}-item array of metadata key {key!r}")
            if item_kind == GGUFValueType.STRING:
                return [self._string() for _ in range(count)]
            if count == 0:
                return []
            dtype = np.dtype(_SCALARS[item_kind][1]).newbyteorder("<")
            values = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._pos).copy()
            self._pos += count * dtype.itemsize
            return values
        value = self._unpack(_SCALARS[kind][0])
        if kind == GGUFValueType.FLOAT32:
            return float(str(np.float32(value)))
        return value
