"""Compiles every Triton kernel for an sm_90 target (H100 / H200) with triton's bundled ptxas,
no GPU needed: catches what only the real compiler rejects (the interpreter runs plain Python).
Run by test_gpu_compile.py in a subprocess without TRITON_INTERPRET."""

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from omnistage.kernels.triton import adaln as ad
from omnistage.kernels.triton import decode_attention as da
from omnistage.kernels.triton import elementwise as ew
from omnistage.kernels.triton import extend_attention as ea


def compile_(kernel, sig: dict, consts: dict) -> None:
    """sig: pointer / float argument types (others are i32); consts: constexpr values."""
    names = kernel.arg_names
    signature = {}
    for n in names:
        signature[n] = "constexpr" if n in consts else sig.get(n, "i32")
    src = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in consts.items()})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    assert c.asm["cubin"], kernel.__name__
    print("ok", kernel.__name__)


P = "*bf16"
compile_(
    da._decode_kernel,
    dict(Q=P, KV=P, BT="*i32", LENS="*i32", Out=P, PART_O="*fp32", PART_ML="*fp32", scale="fp32"),
    dict(GROUP=7, GROUP_PAD=16, D=64, D_PAD=64, BLOCK_SIZE=16, TILE_N=32, NUM_SPLITS=4, DOT_PRECISION="tf32"),
)
compile_(
    da._decode_kernel,
    dict(Q=P, KV=P, BT="*i32", LENS="*i32", Out=P, PART_O=P, PART_ML=P, scale="fp32"),
    dict(GROUP=7, GROUP_PAD=16, D=64, D_PAD=64, BLOCK_SIZE=16, TILE_N=32, NUM_SPLITS=1, DOT_PRECISION="tf32"),
)
compile_(
    da._merge_splits_kernel,
    dict(PART_O="*fp32", PART_ML="*fp32", Out=P),
    dict(NUM_HEADS=14, D=64, D_PAD=64, NUM_SPLITS=4),
)
compile_(
    ea._extend_kernel,
    dict(Q=P, KV=P, BT="*i32", Q_START="*i32", Q_LEN="*i32", CTX="*i32", Out=P, scale="fp32"),
    dict(GROUP=7, D=64, D_PAD=64, BLOCK_SIZE=16, BLOCK_M=16, TILE_N=32, DOT_PRECISION="tf32"),
)
F = "*fp32"  # float32 engines: exact ("ieee") dot products
compile_(
    da._decode_kernel,
    dict(Q=F, KV=F, BT="*i32", LENS="*i32", Out=F, PART_O=F, PART_ML=F, scale="fp32"),
    dict(GROUP=2, GROUP_PAD=16, D=64, D_PAD=64, BLOCK_SIZE=16, TILE_N=32, NUM_SPLITS=1, DOT_PRECISION="ieee"),
)
compile_(
    ea._extend_kernel,
    dict(Q=F, KV=F, BT="*i32", Q_START="*i32", Q_LEN="*i32", CTX="*i32", Out=F, scale="fp32"),
    dict(GROUP=2, D=64, D_PAD=64, BLOCK_SIZE=16, BLOCK_M=16, TILE_N=32, DOT_PRECISION="ieee"),
)
compile_(ew._rms_norm_kernel, dict(X=P, RES=P, W=P, OUT=P, eps="fp32"), dict(D=896, D_PAD=1024, HAS_RES=True))
compile_(ew._rms_norm_kernel, dict(X=P, RES=P, W=P, OUT=P, eps="fp32"), dict(D=64, D_PAD=64, HAS_RES=False))
compile_(
    ew._rope_kernel, dict(X=P, COS=P, SIN=P, POS=P, AXIS=P), dict(HALF=32, HALF_PAD=32, GATHER=False, SIGNED_SIN=True)
)
compile_(
    ew._rope_kernel,
    dict(X=P, COS=P, SIN=P, POS="*i64", AXIS="*i32"),
    dict(HALF=32, HALF_PAD=32, GATHER=True, SIGNED_SIN=False),
)
compile_(ew._silu_mul_kernel, dict(G=P, U=P, OUT=P), dict(BLOCK=1024))
compile_(ew._store_kv_kernel, dict(KV_NEW=P, SLOTS="*i64", CACHE=P), dict(D=64, D_PAD=64))
compile_(ad._ada_layer_norm_kernel, dict(X=P, SHIFT=P, SCALE=P, OUT=P, eps="fp32"), dict(D=1536, D_PAD=2048))
compile_(ad._ada_layer_norm_kernel, dict(X=P, SHIFT=P, SCALE=P, OUT=P, eps="fp32"), dict(D=3072, D_PAD=4096))
