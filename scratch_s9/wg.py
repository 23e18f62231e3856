# scratch: NVFP4 split-K tile with wgmma (A = decoded weight fragments from registers, B = x^T in smem)
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from qerl_exp.engine import kernels as K
from qerl_exp.engine import nvfp4_mma as NM

_ASM = NM._ASM


@gluon.jit
def _fragment(v, A: gl.constexpr, W: gl.constexpr):
    v = gl.reshape(v, [W, 8, 4, 2, 2, 2, 2])
    v = gl.permute(v, (0, 5, 1, 3, 4, 2, 6))
    return gl.convert_layout(gl.reshape(v, [16 * W, 32]), A, assert_trivial=True)


@gluon.jit
def wg_kernel(x_ptr, stride_xm, tab_ptr, ws_ptr, stride_wm, stride_ws, M, K, N1, N2, CPS, NT,
              NSEG: gl.constexpr, BLOCK_M: gl.constexpr, W: gl.constexpr, ASYNC: gl.constexpr, MODE: gl.constexpr = 0):
    # MODE (diagnostic): 0 full, 1 no wgmma, 2 no decode, 3 loads + x staging only
    # ws[pid_k, m, n0:n0+16W] = x[m, slice] / 16 @ W[n0:n0+16W, slice]^T / 2^-6
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1], instr_shape=[16, BLOCK_M, 16])
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    L3: gl.constexpr = gl.BlockedLayout([1, 4, 4], [32, 1, 1], [W, 1, 1], [2, 1, 0])
    CW: gl.constexpr = gl.SliceLayout(2, L3)
    L5: gl.constexpr = gl.BlockedLayout([1, 2, 2, 2, 2], [32, 1, 1, 1, 1], [W, 1, 1, 1, 1], [4, 3, 2, 1, 0])
    SW: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, L5)))
    XL: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [W, 1], [1, 0])  # [BM, 32] of x, 16 bytes a thread
    XS: gl.constexpr = gl.NVMMASharedLayout(64, 16, rank=2)
    T: gl.constexpr = 32 * W
    BN: gl.constexpr = 16 * W

    q = gl.program_id(0)
    pid_n = q % NT
    pid_k = q // NT
    n0 = pid_n * BN
    c0 = pid_k * CPS
    n_chunks = gl.minimum(CPS, K // 64 - c0)
    seg, start = NM._segment(n0, N1, N2, NSEG)
    c_ptr = gl.multiple_of(gl.load(tab_ptr + seg * 8).to(gl.pointer_type(gl.int32)), 16)
    s_ptr = gl.multiple_of(gl.load(tab_ptr + seg * 8 + 1).to(gl.pointer_type(gl.int32)), 16)
    G = K // 64
    rb0 = (n0 - start) // 16

    xm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, XL))
    xk = gl.arange(0, 32, layout=gl.SliceLayout(0, XL))
    xp = x_ptr + xm[:, None] * stride_xm + xk[None, :]
    x_ok = (xm < M)[:, None]
    xs_lo = gl.allocate_shared_memory(gl.float16, [2, BLOCK_M, 32], XS)
    xs_hi = gl.allocate_shared_memory(gl.float16, [2, BLOCK_M, 32], XS)

    t = gl.arange(0, T, layout=gl.SliceLayout(1, CW))
    cptr = c_ptr + ((rb0 + t // 32) * G + c0)[:, None] * 128 + ((t % 32) * 4)[:, None] \
        + gl.arange(0, 4, layout=gl.SliceLayout(0, CW))[None, :]
    ts = gl.arange(0, T, layout=gl.SliceLayout(1, SW))
    b3 = gl.arange(0, 2, layout=gl.SliceLayout(0, SW))
    sptr = s_ptr + ((rb0 + ts // 32) * G + c0)[:, None] * 16 + ((ts % 32) // 4 * 2)[:, None] + b3[None, :]
    zero3 = gl.full([T, 4, 4], 0, gl.int32, L3)
    zero5 = gl.full([T, 2, 2, 2, 2], 0, gl.int32, L5)

    acc = gl.zeros([BN, BLOCK_M], gl.float32, layout=MMA)
    q_1 = gl.load(cptr)
    w_1 = gl.load(sptr)
    xl_1 = gl.load(xp + c0 * 64, mask=x_ok, other=0.0)
    xh_1 = gl.load(xp + c0 * 64 + 32, mask=x_ok, other=0.0)
    i2 = gl.minimum(1, n_chunks - 1)
    q_2 = gl.load(cptr + i2 * 128)
    w_2 = gl.load(sptr + i2 * 16)
    keep_lo = gl.zeros([BN, 32], gl.float16, layout=A)
    keep_hi = gl.zeros([BN, 32], gl.float16, layout=A)
    for i in range(n_chunks):
        cw = q_1
        word = w_1
        xl = xl_1
        xh = xh_1
        q_1 = q_2
        w_1 = w_2
        nxt = gl.minimum(i + 2, n_chunks - 1)
        q_2 = gl.load(cptr + nxt * 128)
        w_2 = gl.load(sptr + nxt * 16)
        k1 = (c0 + gl.minimum(i + 1, n_chunks - 1)) * 64
        blo = xs_lo.index(i % 2)
        bhi = xs_hi.index(i % 2)
        if MODE != 4:
            xl_1 = gl.load(xp + k1, mask=x_ok, other=0.0)
            xh_1 = gl.load(xp + k1 + 32, mask=x_ok, other=0.0)
            blo.store((xl * 0.0625).to(gl.float16))
            bhi.store((xh * 0.0625).to(gl.float16))
            hopper.fence_async_shared()
            gl.thread_barrier()
        c5 = gl.broadcast(gl.expand_dims(cw, 2), zero3)[0]
        c5 = gl.convert_layout(gl.reshape(c5, [T, 2, 2, 2, 2]), L5, assert_trivial=True)
        s5 = gl.broadcast(gl.expand_dims(gl.expand_dims(gl.expand_dims(word, 2), 3), 4), zero5)[0]
        if MODE <= 1:
            a_lo, a_hi = gl.inline_asm_elementwise(_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [c5, s5],
                                                   dtype=(gl.float16, gl.float16), is_pure=True, pack=4)
        else:
            a_lo = (c5.to(gl.int16) | s5.to(gl.int16)).to(gl.float16, bitcast=True)
            a_hi = (c5.to(gl.int16) + 7).to(gl.float16, bitcast=True)
        fa_lo = _fragment(gl.reshape(a_lo, [T, 16]), A, W)
        fa_hi = _fragment(gl.reshape(a_hi, [T, 16]), A, W)
        if MODE == 1 or MODE >= 3:
            keep_lo = keep_lo + fa_lo
            keep_hi = keep_hi + fa_hi
        elif ASYNC:
            acc = hopper.warpgroup_mma(fa_lo, blo.permute((1, 0)), acc, is_async=True)
            acc = hopper.warpgroup_mma(fa_hi, bhi.permute((1, 0)), acc, is_async=True)
            acc, keep_lo, keep_hi = hopper.warpgroup_mma_wait(num_outstanding=2, deps=[acc, keep_lo, keep_hi])
            keep_lo = fa_lo
            keep_hi = fa_hi
        else:
            acc = hopper.warpgroup_mma(fa_lo, blo.permute((1, 0)), acc)
            acc = hopper.warpgroup_mma(fa_hi, bhi.permute((1, 0)), acc)
    if ASYNC:
        acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    if MODE == 1 or MODE >= 3:
        acc += gl.convert_layout(gl.sum((keep_lo + keep_hi).to(gl.float32), 1), gl.SliceLayout(1, MMA))[:, None]
    offs_n = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
    gl.store(ws_ptr + pid_k * stride_ws + offs_m[None, :] * stride_wm + offs_n[:, None], acc,
             mask=(offs_m < M)[None, :])


def launch(plan, x, sms, W=4, block_m=None, maxnreg=None, split=None, ASYNC=False, MODE=0):
    m = x.shape[0]
    bm = block_m or max(16, 1 << (m - 1).bit_length())
    bn = 16 * W
    nt = plan.n * (2 if plan.glu else 1) // bn
    chunks = plan.k // 64
    flat = plan.workspace.view(-1)
    if split is None:
        split = max(1, min(sms * 2 // nt, chunks // 4)) or 1
    cps = -(-chunks // split)
    split = -(-chunks // cps)
    ws = flat[: split * m * nt * bn].view(split, m, nt * bn)
    opts = dict(num_warps=W) if maxnreg is None else dict(num_warps=W, maxnreg=maxnreg)
    wg_kernel[(nt * split,)](x, x.stride(0), plan.tab, ws, ws.stride(1), ws.stride(0), m, plan.k, plan.n1, plan.n2,
                             cps, nt, NSEG=plan.nseg, BLOCK_M=bm, W=W, ASYNC=ASYNC, MODE=MODE, **opts)
    return split, ws
