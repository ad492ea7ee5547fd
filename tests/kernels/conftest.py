"""Kernel tests run the Triton kernels on CPU tensors through Triton's interpreter.

triton.jit picks the interpreter when a kernel is *defined* (it reads TRITON_INTERPRET at
decoration time), so the variable is set here, before any test module imports a kernel
module; a kernel module some earlier test imported without it is reloaded.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest

os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

_KERNEL_MODULES = [
    "omnistage.kernels.triton.elementwise",
    "omnistage.kernels.triton.decode_attention",
    "omnistage.kernels.triton.extend_attention",
    "omnistage.kernels.triton.engine_ops",
    "omnistage.kernels.triton.adaln",
]
for _name in _KERNEL_MODULES:
    if _name in sys.modules:
        importlib.reload(sys.modules[_name])


def pytest_collection_modifyitems(items):
    from omnistage.kernels.triton import decode_attention

    kernel = decode_attention._decode_kernel
    assert type(kernel).__name__ == "InterpretedFunction", "kernels were not defined under the interpreter"


# Tolerances (absolute, on values of order 1): float32 kernels accumulate in float32 in another
# order than the float32 reference: ~1e-6. float16 inputs are exact in both, but the kernels
# round softmax probabilities (and norm/rope/silu results) to float16 once before the last
# product or store: relative 2^-11 ~ 5e-4 per element, so 2e-3 on outputs of magnitude ~2.
TOL = {"float32": dict(atol=2e-5, rtol=1e-5), "float16": dict(atol=2e-3, rtol=2e-3)}
