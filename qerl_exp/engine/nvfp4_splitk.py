"""The NVFP4 split-K decode kernel in Gluon (Triton with explicit layouts and shared memory), Hopper.

Plain Triton decodes the 4-bit weights in registers and then has to move them into the wgmma
operand layout itself, byte by byte (docs/engine.md). Here every step is spelled out:
- cp.async brings the codes, block scales and activations of chunk i + STAGES - 1 into a ring of
  shared-memory slots while chunk i is decoded, so ~STAGES chunks of HBM reads are in flight;
- each thread decodes 16 code bytes of one row (32 weights) with the same inline PTX as
  `kernels._E2M1X4_TO_F16`, and stores them as fp16 with 16-byte shared stores into an
  NVMMA-swizzled tile;
- wgmma multiplies that tile (BLOCK_N weight rows: the wide operand) by the activation tile
  (BLOCK_M rows, at least 8) asynchronously, while the next chunk is decoded into the other buffer.

Same contract as the NVFP4 tiles of `kernels._splitk_kernel`: fp32 products of x' (x or
RMSNorm(x) * gamma) pre-scaled by 1/16 into fp16, times weights in units of 2^-6, one K slice a
program into ws[pid_k]; the raw `_linear_kernel` launch finishes them.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp

from .kernels import _E2M1X4_TO_F16


@gluon.jit
def _segment(n0, N1, N2, NSEG: gl.constexpr):
    seg = 0
    start = 0
    if NSEG == 2:
        seg = (n0 >= N1).to(gl.int32)
        start = gl.where(n0 >= N1, N1, 0)
    elif NSEG == 3:
        seg = (n0 >= N1).to(gl.int32) + (n0 >= N2).to(gl.int32)
        start = gl.where(n0 >= N2, N2, gl.where(n0 >= N1, N1, 0))
    return seg, start


@gluon.jit
def _issue(c_ring, s_ring, slot, g, c_ptr, s_ptr, nrows, rows, j32):
    # one cp.async group: chunk g's code bytes [BN, 32] and block-scale words [BN]
    cp.async_copy_global_to_shared(c_ring.index(slot), c_ptr + g * nrows * 32 + rows[:, None] * 32 + j32[None, :])
    cp.async_copy_global_to_shared(s_ring.index(slot), s_ptr + g * nrows + rows)
    cp.commit_group()


@gluon.jit
def _x_half(x_ptr, stride_xm, offs_m, m_ok, offs_k, g_ptr, rstd, NORM: gl.constexpr):
    # [BM, 32] activations as fp16 / 16; NORM: RMSNorm(x) * gamma first, rounded where HF rounds
    x = gl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None], other=0.0)
    if NORM:
        hn = (x.to(gl.float32) * rstd[:, None]).to(x.dtype)
        x = (gl.load(g_ptr + offs_k)[None, :].to(gl.float32) * hn.to(gl.float32)).to(x.dtype)
    # explicit cvt: LLVM would otherwise round to fp16 first and scale after, losing the headroom
    return gl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [x.to(gl.float32) * 0.0625],
                                     dtype=gl.float16, is_pure=True, pack=2)


@gluon.jit
def nvfp4_splitk_kernel(
    x_ptr, stride_xm, tab_ptr, ws_ptr, stride_wm, stride_ws,
    g_ptr, ss_ptr, stride_ss, T, eps,
    M, K, N1, N2, NT,
    NSEG: gl.constexpr, NORM: gl.constexpr, T_PAD: gl.constexpr, SPLIT: gl.constexpr, CPS: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
):
    # Program p: tile (pid_n, pid_k, pid_m) over chunks [pid_k * CPS, (pid_k + 1) * CPS) of 64 inputs.
    gl.static_assert(BLOCK_N == 64, "one warpgroup: 64 weight rows")
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_M, 16])
    DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    ROWS: gl.constexpr = gl.SliceLayout(1, DOT)
    CL: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0])  # cp.async of [BN, 32] codes
    SL: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    XL: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])  # [BM, 32] activations
    GL: gl.constexpr = gl.SliceLayout(0, XL)
    PLAIN2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    PLAIN1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    MMA_SH: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)

    p = gl.program_id(0)
    pid_n = p % NT
    pid_k = (p // NT) % SPLIT
    pid_m = p // (NT * SPLIT)
    n0 = pid_n * BLOCK_N
    seg, start = _segment(n0, N1, N2, NSEG)
    c_ptr = gl.multiple_of(gl.load(tab_ptr + seg * 8).to(gl.pointer_type(gl.uint8)), 16)
    s_ptr = gl.multiple_of(gl.load(tab_ptr + seg * 8 + 1).to(gl.pointer_type(gl.int32)), 16)
    nrows = gl.multiple_of(gl.load(tab_ptr + seg * 8 + 4), 16)
    c0 = pid_k * CPS

    # the codes' ring: chunk i + STAGES - 2 is in flight while chunk i is decoded
    c_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, 32], PLAIN2)
    s_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N], PLAIN1)
    crow = n0 - start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, CL))
    cj = gl.arange(0, 32, layout=gl.SliceLayout(0, CL))
    srow = n0 - start + gl.arange(0, BLOCK_N, layout=SL)
    for i in gl.static_range(STAGES - 1):
        if i < CPS:
            _issue(c_ring, s_ring, i, c0 + i, c_ptr, s_ptr, nrows, crow, cj)

    # the program's activations, all chunks, as fp16 / 16 in shared memory (wgmma's B operand)
    offs_xm = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, XL))
    xm_ok = offs_xm < M
    j32x = gl.arange(0, 32, layout=GL)
    rstd = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, XL))
    if NORM:  # 1 / RMS of the rows from the residual epilogue's partial sums of squares
        TL: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [4, 1], [0, 1])
        tt = gl.arange(0, T_PAD, layout=gl.SliceLayout(1, TL))
        om = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, TL))
        ssp = gl.load(ss_ptr + tt[:, None] * stride_ss + om[None, :], mask=(tt[:, None] < T) & (om[None, :] < M),
                      other=0.0)
        rstd = gl.convert_layout(gl.rsqrt(gl.sum(ssp, 0) / K + eps), gl.SliceLayout(1, XL))
    x_lo = gl.allocate_shared_memory(gl.float16, [CPS, BLOCK_M, 32], MMA_SH)
    x_hi = gl.allocate_shared_memory(gl.float16, [CPS, BLOCK_M, 32], MMA_SH)
    for i in gl.static_range(CPS):
        k0 = (c0 + i) * 64
        x_lo.index(i).store(_x_half(x_ptr, stride_xm, offs_xm, xm_ok, k0 + j32x, g_ptr, rstd, NORM))
        x_hi.index(i).store(_x_half(x_ptr, stride_xm, offs_xm, xm_ok, k0 + 32 + j32x, g_ptr, rstd, NORM))
    hopper.fence_async_shared()

    # block b of a row's chunk is byte b of its scale word: low nibbles (j < 32) use blocks j // 16,
    # high nibbles blocks 2 + j // 16
    shift = 8 * (gl.arange(0, 32, layout=gl.SliceLayout(0, DOT)) // 16)[None, :]
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=ACC)
    for i in range(CPS):
        slot = i % STAGES
        cp.wait_group(STAGES - 2)
        gl.thread_barrier()  # chunk i is in its slot for every thread; slot i - 1 is free again
        if i + STAGES - 1 < CPS:
            _issue(c_ring, s_ring, (i + STAGES - 1) % STAGES, c0 + i + STAGES - 1, c_ptr, s_ptr, nrows, crow, cj)
        else:
            cp.commit_group()
        c = c_ring.index(slot).load(DOT)
        word = s_ring.index(slot).load(ROWS)[:, None]
        s_lo = ((word >> shift) & 0xFF).to(gl.uint8).to(gl.float8e4nv, bitcast=True).to(gl.float16)
        s_hi = ((word >> (16 + shift)) & 0xFF).to(gl.uint8).to(gl.float8e4nv, bitcast=True).to(gl.float16)
        a_lo, a_hi = gl.inline_asm_elementwise(
            asm=_E2M1X4_TO_F16, constraints="=r,=r,=r,=r,r,r,r,r,r", args=[c, s_lo, s_hi],
            dtype=(gl.float16, gl.float16), is_pure=True, pack=4)
        acc = hopper.warpgroup_mma(a_lo, x_lo.index(i).permute((1, 0)), acc, is_async=True)
        acc = hopper.warpgroup_mma(a_hi, x_hi.index(i).permute((1, 0)), acc, is_async=True)
        acc, a_lo, a_hi = hopper.warpgroup_mma_wait(num_outstanding=2, deps=[acc, a_lo, a_hi])
    acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc])

    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ACC))
    offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, ACC))
    gl.store(ws_ptr + pid_k * stride_ws + offs_m[None, :] * stride_wm + offs_n[:, None], acc,
             mask=offs_m[None, :] < M)
