"""Prototype: NVFP4 split-K decode GEMM in Gluon with TMA (one segment, x' precomputed as fp16/16)."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from qerl_exp.engine.kernels import _E2M1X4_TO_F16


@gluon.jit
def _issue(c_desc, s_desc, x_desc, c_ring, s_ring, xl_ring, xh_ring, ready, slot, g, n0, m0, N,
           BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr):
    bar = ready.index(slot)
    mbarrier.expect(bar, BLOCK_N * 32 + BLOCK_N * 4 + 2 * BLOCK_M * 32 * 2)
    tma.async_copy_global_to_shared(c_desc, [g * N + n0, 0], bar, c_ring.index(slot))
    tma.async_copy_global_to_shared(s_desc, [g, n0], bar, s_ring.index(slot))
    tma.async_copy_global_to_shared(x_desc, [m0, g * 64], bar, xl_ring.index(slot))
    tma.async_copy_global_to_shared(x_desc, [m0, g * 64 + 32], bar, xh_ring.index(slot))


@gluon.jit
def nvfp4_tma_kernel(c_desc, s_desc, x_desc, ws_ptr, stride_wm, stride_ws, M, N, NT,
                     SPLIT: gl.constexpr, CPS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr, MODE: gl.constexpr = 0):
    # MODE (diagnostic): 0 full; 1 no decode (codes widened, wrong values); 2 no wgmma; 3 neither
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    DOT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    ROWS: gl.constexpr = gl.SliceLayout(1, DOT)

    p = gl.program_id(0)
    pid_n = p % NT
    pid_k = (p // NT) % SPLIT
    pid_m = p // (NT * SPLIT)
    n0 = pid_n * BLOCK_N
    m0 = pid_m * BLOCK_M
    c0 = pid_k * CPS

    c_ring = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, 32], c_desc.layout)
    s_ring = gl.allocate_shared_memory(gl.int32, [STAGES, 1, BLOCK_N], s_desc.layout)
    xl_ring = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_M, 32], x_desc.layout)
    xh_ring = gl.allocate_shared_memory(gl.float16, [STAGES, BLOCK_M, 32], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
    for i in gl.static_range(STAGES - 1):
        if i < CPS:
            _issue(c_desc, s_desc, x_desc, c_ring, s_ring, xl_ring, xh_ring, ready, i, c0 + i, n0, m0, N,
                   BLOCK_N, BLOCK_M)

    shift = 8 * (gl.arange(0, 32, layout=gl.SliceLayout(0, DOT)) // 16)[None, :]
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=ACC)
    keep_lo = gl.zeros([BLOCK_N, 32], gl.float16, layout=DOT)
    keep_hi = gl.zeros([BLOCK_N, 32], gl.float16, layout=DOT)
    for i in range(CPS):
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        c = c_ring.index(slot).load(DOT)
        word = s_ring.index(slot).reshape([BLOCK_N]).load(ROWS)[:, None]
        s_lo = ((word >> shift) & 0xFF).to(gl.uint8).to(gl.float8e4nv, bitcast=True).to(gl.float16)
        s_hi = ((word >> (16 + shift)) & 0xFF).to(gl.uint8).to(gl.float8e4nv, bitcast=True).to(gl.float16)
        if MODE == 0 or MODE == 2:
            a_lo, a_hi = gl.inline_asm_elementwise(
                asm=_E2M1X4_TO_F16, constraints="=r,=r,=r,=r,r,r,r,r,r", args=[c, s_lo, s_hi],
                dtype=(gl.float16, gl.float16), is_pure=True, pack=4)
        else:
            a_lo = (c.to(gl.int16) | (word >> 8).to(gl.int16)).to(gl.float16, bitcast=True)
            a_hi = (c.to(gl.int16) + 7).to(gl.float16, bitcast=True)
        if MODE < 2:
            acc = hopper.warpgroup_mma(a_lo, xl_ring.index(slot).permute((1, 0)), acc, is_async=True)
            acc = hopper.warpgroup_mma(a_hi, xh_ring.index(slot).permute((1, 0)), acc, is_async=True)
            # retire chunk i - 1's wgmmas; their A registers (keep_*) live until here
            acc, keep_lo, keep_hi = hopper.warpgroup_mma_wait(num_outstanding=2, deps=[acc, keep_lo, keep_hi])
            keep_lo = a_lo
            keep_hi = a_hi
        else:
            keep_lo = keep_lo + a_lo
            keep_hi = keep_hi + a_hi
        gl.thread_barrier()  # every thread is past its loads of slot i - 1, whose wgmmas retired
        nxt = i + STAGES - 1
        if nxt < CPS:
            _issue(c_desc, s_desc, x_desc, c_ring, s_ring, xl_ring, xh_ring, ready, nxt % STAGES, c0 + nxt, n0, m0, N,
                   BLOCK_N, BLOCK_M)
    acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ACC))
    offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, ACC))
    if MODE >= 2:  # keep the decode alive
        acc += gl.convert_layout(gl.sum((keep_lo + keep_hi).to(gl.float32), 1), gl.SliceLayout(1, ACC))[:, None]
    gl.store(ws_ptr + pid_k * stride_ws + offs_m[None, :] * stride_wm + offs_n[:, None], acc, mask=offs_m[None, :] < M)


def descriptors(codes, scales, xh, bm, bn=64):
    """codes uint8 [K/64, N, 32], scales int32 [K/64, N], xh fp16 [M_pad, K] (x / 16)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    g, n, _ = codes.shape
    c_desc = TensorDescriptor.from_tensor(codes.view(g * n, 32), [bn, 32], gl.NVMMASharedLayout(0, 8, rank=2))
    s_desc = TensorDescriptor.from_tensor(scales, [1, bn], gl.NVMMASharedLayout(0, 32, rank=2))
    x_desc = TensorDescriptor.from_tensor(xh, [bm, 32], gl.NVMMASharedLayout(64, 16, rank=2))
    return c_desc, s_desc, x_desc
