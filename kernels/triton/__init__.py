"""Triton kernels for the AR engine's GPU hot paths, each beside its torch reference.

    from omnistage.kernels import triton as triton_kernels
    if triton_kernels.selected(device):   # decided once, when an engine is built
        ...

Modules: decode_attention (paged decode attention, GQA, split-K), extend_attention
(prefill / extend over paged K/V with a causal mask and a cached prefix), elementwise
(RMSNorm (+ residual), RoPE / M-RoPE in place, SiLU-and-multiply, KV-cache store), engine_ops
(the glue the AR engine calls). Importing this package does not import triton.

OMNISTAGE_TRITON: "0" (or off/false/no) forces the torch path; "1" forces the kernels on any
device (CPU tensors run only under TRITON_INTERPRET=1: tests); unset or "auto": on CUDA when
triton imports.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def env_mode(name: str) -> str:
    """'off', 'on' or 'auto' from an on/off/auto environment switch."""
    value = os.environ.get(name, "auto").strip().lower()
    if value in _OFF:
        return "off"
    if value in _ON:
        return "on"
    return "auto"


def mode() -> str:
    """'off', 'on' or 'auto' from OMNISTAGE_TRITON."""
    return env_mode("OMNISTAGE_TRITON")


@functools.cache
def available() -> bool:
    return importlib.util.find_spec("triton") is not None


def selected(device: torch.device | str) -> bool:
    """Whether an engine on `device` uses the Triton kernels (read once, at engine build)."""
    m = mode()
    if m == "off" or not available():
        return False
    return m == "on" or torch.device(device).type == "cuda"
