"""Failure fingerprints: the exception type and the stack's (file's last two path parts,
function) frames, hashed without line numbers or absolute paths so they survive deploys."""

from __future__ import annotations

import hashlib
import traceback
from pathlib import PurePath


def _frame_key(filename: str, function: str) -> str:
    parts = PurePath(filename).with_suffix("").parts[-2:]
    return f"{'/'.join(parts)}:{function}"


def exception_fingerprint(exc: BaseException) -> str:
    kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
    frames = [_frame_key(f.filename, f.name) for f in traceback.extract_tb(exc.__traceback__)]
    return _digest([kind, *frames])


def reason_fingerprint(reason: str) -> str:
    """For failures without an exception (an undecodable body): one group per reason."""
    return _digest([f"reason:{reason}"])


def _digest(parts: list[str]) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
