"""Paths that a request names (a LoRA adapter's `lora_path` on the runtime load route) are confined to the
directories the operator allows: a request must not make the server read any file it can reach.

A path is resolved first (os.path.realpath: `..` and every symlink followed), then must lie inside one of the
allowed directories (themselves resolved); so must every entry directly inside it, since the loader opens the
files in the adapter's folder and one of them may be a symlink out."""

from __future__ import annotations

import os
from typing import Sequence


class PathNotAllowedError(ValueError):
    pass


def resolved_dirs(dirs: Sequence[str], flag: str) -> tuple[str, ...]:
    """The allowed directories, resolved; ValueError naming `flag` for one that is not a directory."""
    out = []
    for d in dirs:
        if not os.path.isdir(d):
            raise ValueError(f"{flag}: {d!r} is not a directory")
        out.append(os.path.realpath(d))
    return tuple(out)


def confined(path: str, allowed: Sequence[str], what: str) -> str:
    """`path` resolved, when it and the entries directly in it are inside `allowed` (resolved directories);
    PathNotAllowedError otherwise (without saying where a symlink pointed: that is the operator's to know)."""
    real = os.path.realpath(path)
    if not _inside(real, allowed):
        raise PathNotAllowedError(f"{what} {path!r} is not inside a directory this server allows "
                                  f"({', '.join(allowed) or 'none'})")
    try:
        entries = list(os.scandir(real)) if os.path.isdir(real) else []
    except OSError as e:  # unreadable, or removed meanwhile
        raise PathNotAllowedError(f"{what} {path!r} cannot be listed: {e.strerror}") from None
    for entry in entries:
        if not _inside(os.path.realpath(entry.path), allowed):
            raise PathNotAllowedError(f"{what} {path!r}: {entry.name} links outside the allowed directories")
    return real


def _inside(real: str, allowed: Sequence[str]) -> bool:
    return any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in allowed)
