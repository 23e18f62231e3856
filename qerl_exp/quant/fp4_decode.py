"""Decoding E2M1 weights on the GPU: the Triton device functions every FP4 kernel decodes with
(`_e2m1_to` for any E2M1 byte of the kernel layout, `_nvfp4_chunk` for a 64-input NVFP4 chunk of
16-row blocks), and the dequantize kernel that writes NVFP4 weights out dense
(`layout.stacked_weight` launches it). The rollout engine's kernels call the device functions too.

Without a GPU the kernels run only under the Triton interpreter, which the caller turns on with
TRITON_INTERPRET=1 before triton is first imported (`interpreting` says whether it is on; inline
PTX is then replaced by the same bit tricks in Triton ops).
"""

from __future__ import annotations

import os

from qerl_exp.quant.ptx import e2m1x4_asm

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU builds of torch ship without Triton: weights then decode through torch, and
    # the kernels below (and the engine's) are defined all the same, by a stand-in that refuses a launch
    from qerl_exp.quant import without_triton as triton

    tl = triton.language
    HAS_TRITON = False


def interpreting() -> bool:
    """Whether the kernels run in the Triton interpreter (then without inline PTX)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _e2m1_to(c, DT: tl.constexpr):
    # permuted E2M1 bytes -> (low, high) elements in DT, in units of 2^-6 (`layout`'s docstring)
    lo = (c & 0x9C).to(tl.float8e4nv, bitcast=True).to(DT)
    hi = (((c << 2) & 0x8C) | ((c >> 2) & 0x10)).to(tl.float8e4nv, bitcast=True).to(DT)
    return lo, hi

_E2M1X4_TO_F16 = tl.constexpr(e2m1x4_asm(4, 5))


@triton.jit
def _e4m3_byte(word, b: tl.constexpr):
    return ((word >> (8 * b)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def _nvfp4_chunk(c_ptr, s_ptr, G, g, row0, ASM: tl.constexpr, BLOCK_N: tl.constexpr):
    # One 64-input chunk g (of G) of BLOCK_N NVFP4 rows from row0 (a multiple of 16) as fp16
    # (w_lo, w_hi), each [BN, 32], in units of 2^-6 (exact: e2m1 * e4m3 needs 6 significant bits
    # and stays inside fp16's range).
    # The rows' 16-row blocks are read whole (contiguous) and their bytes put back in row order
    # in registers (the mma.sync kernel, `nvfp4_mma`, multiplies them in fragment order).
    blk = (row0 // 16 + tl.arange(0, BLOCK_N // 16)) * G + g
    c = tl.load(c_ptr + blk[:, None] * 512 + tl.arange(0, 512)[None, :])
    c = tl.permute(tl.reshape(c, (BLOCK_N // 16, 8, 4, 2, 2, 2, 2)), (0, 5, 1, 3, 4, 2, 6))
    c = tl.reshape(c, (BLOCK_N, 2, 16))  # [row 16 rb + 8 b1 + r, half b3, byte 8 b2 + 2 c + b0]
    word = tl.reshape(tl.load(s_ptr + blk[:, None] * 16 + tl.arange(0, 16)[None, :]), (BLOCK_N // 16, 8, 2))
    # byte 2 h + b1 of entry (r, b3): block 2 h + b3 of row 8 b1 + r -> [row, b3] per half h
    s_lo = tl.reshape(tl.permute(tl.join(_e4m3_byte(word, 0), _e4m3_byte(word, 1)), (0, 3, 1, 2)), (BLOCK_N, 2))
    s_hi = tl.reshape(tl.permute(tl.join(_e4m3_byte(word, 2), _e4m3_byte(word, 3)), (0, 3, 1, 2)), (BLOCK_N, 2))
    s_lo = tl.broadcast_to(s_lo[:, :, None], (BLOCK_N, 2, 16))
    s_hi = tl.broadcast_to(s_hi[:, :, None], (BLOCK_N, 2, 16))
    if ASM:
        w_lo, w_hi = tl.inline_asm_elementwise(
            asm=_E2M1X4_TO_F16, constraints="=r,=r,=r,=r,r,r,r,r,r", args=[c, s_lo, s_hi],
            dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:  # the interpreter cannot run PTX: the same bit tricks with Triton ops
        lo, hi = _e2m1_to(c, tl.float16)
        w_lo = lo * s_lo
        w_hi = hi * s_hi
    return tl.reshape(w_lo, (BLOCK_N, 32)), tl.reshape(w_hi, (BLOCK_N, 32))


@triton.jit
def _nvfp4_dequant_kernel(c0, s0, c1, s1, c2, s2, out_ptr, K, scale0, scale1, scale2, B1, B2,
                          ASM: tl.constexpr, BLOCK_N: tl.constexpr):
    # out[n, 64g + j] = W[n, 64g + j] in out's dtype, one (BLOCK_N rows, chunk g) tile a program
    # (prefill multiplies whole prompts, where dequantize + cuBLAS beats the decode kernel). Up to
    # three weights stacked by rows in one launch (a learner's projection group): row blocks
    # [0, B1) of out are weight 0's, [B1, B2) weight 1's, the rest weight 2's.
    pid = tl.program_id(0)
    g = tl.program_id(1)
    if pid < B1:
        w_lo, w_hi = _nvfp4_chunk(c0, s0, K // 64, g, pid * BLOCK_N, ASM, BLOCK_N)
        out_scale = scale0
    elif pid < B2:
        w_lo, w_hi = _nvfp4_chunk(c1, s1, K // 64, g, (pid - B1) * BLOCK_N, ASM, BLOCK_N)
        out_scale = scale1
    else:
        w_lo, w_hi = _nvfp4_chunk(c2, s2, K // 64, g, (pid - B2) * BLOCK_N, ASM, BLOCK_N)
        out_scale = scale2
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, 32)
    dst = out_ptr + rows[:, None] * K + g * 64 + j[None, :]
    tl.store(dst, (w_lo.to(tl.float32) * (out_scale * 64.0)).to(out_ptr.dtype.element_ty))
    tl.store(dst + 32, (w_hi.to(tl.float32) * (out_scale * 64.0)).to(out_ptr.dtype.element_ty))
