"""Contracts that both the stage engines and the runtime that moves their data rely on.

This module sits beneath both: the graph validates port types against `PORT_TYPES`, engines
and the runtime join a port's chunks with `combine_chunks`, and a failed request becomes an
`Emission` through `error_emission` wherever it fails (inside an engine or in its worker).
A memory size ("2GiB") is read by `memory_bytes` both where the pipeline file is checked and
in engines that take a size param.
"""

from __future__ import annotations

import re
from typing import Any

from omnistage.errors import DEFAULT_INVALID_CODES, InvalidRequestError
from omnistage.stages.base import Emission

# The types a port (of a stage kind, or of a pipeline's inputs/outputs) may declare.
PORT_TYPES = (
    "text",
    "tokens",
    "audio",
    "image",
    "video",
    "embeddings",
    "hidden_states",
    "latents",
    "tensor",
    "json",
    "any",
)


def combine_chunks(chunks: list[Any]) -> Any:
    """Concatenate the chunks of one port: tensors along dim 0, str/bytes joined, lists
    extended, dicts merged key by key; a single chunk is returned as is."""
    chunks = [c for c in chunks if c is not None]
    if not chunks:
        return None
    if len(chunks) == 1:
        return chunks[0]
    first = chunks[0]
    import torch

    if isinstance(first, torch.Tensor):
        parts = [c if c.dim() > 0 else c.reshape(1) for c in chunks]
        return torch.cat(parts, dim=0)
    if isinstance(first, str):
        return "".join(chunks)
    if isinstance(first, (bytes, bytearray)):
        return b"".join(chunks)
    if isinstance(first, (list, tuple)):
        out: list[Any] = []
        for c in chunks:
            out.extend(c)
        return out
    if isinstance(first, dict):
        keys: list[Any] = []
        for c in chunks:
            keys.extend(k for k in c if k not in keys)
        return {k: combine_chunks([c[k] for c in chunks if k in c]) for k in keys}
    return chunks[-1]


def error_emission(request_id: str, exc: BaseException) -> Emission:
    """The failure of one request: InvalidRequestError is the request's own fault (400, its
    message as is); anything else is a stage failure (500, with the exception type)."""
    if isinstance(exc, InvalidRequestError):
        # a specific code (context_length_exceeded) travels as "invalid_request:CODE"
        kind = "invalid_request" if exc.code in DEFAULT_INVALID_CODES else f"invalid_request:{exc.code}"
        return Emission(request_id, finished=True, error=str(exc), error_kind=kind, param=exc.param)
    return Emission(request_id, finished=True, error=f"{type(exc).__name__}: {exc}", error_kind="internal")


MEMORY_PATTERN = r"^[0-9]+(\.[0-9]+)?\s*(B|[KMGT]i?B|[KMGT])?$"
_MEMORY_UNITS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "M": 1000**2,
    "G": 1000**3,
    "T": 1000**4,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "KIB": 1024,
    "MIB": 1024**2,
    "GIB": 1024**3,
    "TIB": 1024**4,
}


def memory_bytes(text: str) -> int:
    """`2GiB` -> 2147483648; raises ValueError on anything else."""
    match = re.fullmatch(MEMORY_PATTERN, text.strip())
    if match is None:
        raise ValueError(f"malformed memory size {text!r}")
    number = re.match(r"[0-9.]+", text.strip()).group(0)
    unit = (match.group(2) or "").upper()
    return int(float(number) * _MEMORY_UNITS[unit])
