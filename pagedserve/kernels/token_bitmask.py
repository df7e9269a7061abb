"""Applying a grammar's token bitmask to logits in C (csrc/token_bitmask.c): banned tokens get -inf. None
where the library cannot run (no compiler, CUDA, other dtypes): structured_output/bitmask.py then uses torch."""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from pagedserve.kernels.build import load_library

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _lib() -> Optional[ctypes.CDLL]:
    library = load_library("token_bitmask")
    if library is not None and getattr(library, "_typed", None) is None:
        library.apply_token_bitmask.argtypes = [_P, _P, _P, _I64, _I64, _I64, _INT, _INT]
        library.apply_token_bitmask.restype = _INT
        library._typed = True
    return library


def applies(logits: torch.Tensor) -> bool:
    return (logits.device.type == "cpu" and logits.dtype in _DTYPES and logits.dim() == 2
            and logits.is_contiguous() and _lib() is not None)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits [R, vocab] in place: row rows[i] gets bitmask[i] ([len(rows), words] int32). Needs applies()."""
    bitmask = bitmask.contiguous()
    index = torch.tensor(rows, dtype=torch.int64)
    status = _lib().apply_token_bitmask(logits.data_ptr(), bitmask.data_ptr(), index.data_ptr(), len(rows),
                                        logits.shape[1], bitmask.shape[1], _DTYPES[logits.dtype],
                                        torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"apply_token_bitmask failed (status {status}): bitmask narrower than the vocabulary")
