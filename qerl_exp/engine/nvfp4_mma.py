"""The NVFP4 split-K kernel for decode shapes on the GPU: mma.sync with the weights loaded straight
into its A fragments (Gluon, Triton with explicit layouts; sm_89 and later, for the e4m3 conversion).

`linear_kernels._splitk_kernel` computes the same K slices for every format and under the
interpreter; on CUDA, NVFP4 tiles of up to `MAX_M` rows come here instead. Why it is faster
(measured in docs/engine.md):
- no shared memory for the weights: the codes are stored in the fragment order of
  `mma.sync.m16n8k16` (`layout.relayout_nvfp4`), so each thread reads the 16 bytes it multiplies
  with one 16-byte load, two chunks ahead, and decodes them in registers into its A fragment
  (a layout relabelling, checked trivial at compile time);
- each warp streams its 16 rows' K slice from one contiguous run of codes and scales, and the
  scale words are stored so that the decode converts them as loaded;
- only the activations pass through shared memory (swizzled: the plain layout's bank conflicts
  cost a third of the kernel's time), one chunk of 64 inputs a step;
- the loop is bound by latency, so the launch keeps as many warps in flight as fit: registers are
  capped (`MAX_REGS`) and K is cut into as many slices as keep every program resident at once.

Same contract as the NVFP4 tiles of `_splitk_kernel`: K slice `pid_k` of x' (x, or RMSNorm(x) *
gamma) pre-scaled by 1/16 into fp16, times the weights in units of 2^-6, fp32 into ws[pid_k];
the first programs compute the LoRA shrink t += x' @ A^T (fp32 atomics). The raw `_linear_kernel`
launch finishes the tile.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.runtime.jit import constexpr_function

from qerl_exp.quant.ptx import e2m1x2_asm, e2m1x4_asm
from qerl_exp.engine.norm import norm_shrink_args
from qerl_exp.engine.triton_util import pow2, tl_dtype

MAX_M = 8  # rows up to which `linear.fused_linear` takes this kernel for NVFP4 (docs/engine.md)
BLOCK_N = 64  # weight rows a program: 4 warps x 16
MAX_REGS = 56  # registers a thread (ptxas' maxnreg): 9 programs of 128 threads fit an SM's 65536
RESIDENT = 65536 // (MAX_REGS * 128)  # programs an SM holds at once
MIN_CPS = 4  # chunks of 64 inputs a K slice takes at least
_ASM = gl.constexpr(e2m1x4_asm(4, 8, scale_word=True))  # code word broadcast over $4..$7, scales $8..$11
_ASM_LO = gl.constexpr(e2m1x2_asm("lo", 2, 6))  # one half: code word over $2..$5, scales $6..$9
_ASM_HI = gl.constexpr(e2m1x2_asm("hi", 2, 6))


@gluon.jit
def _segment(n0, N1, N2, NSEG: gl.constexpr):
    # (segment, its first column) of output column n0 when up to three projections sit side by side
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
def _rstd(ss_ptr, stride_ss, T, offs_m, M, K, eps, T_PAD: gl.constexpr, OUT: gl.constexpr):
    # 1 / RMS of the rows from the residual epilogue's T partial sums of squares
    TL: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [4, 1], [0, 1])
    tt = gl.arange(0, T_PAD, layout=gl.SliceLayout(1, TL))
    om = gl.convert_layout(offs_m, gl.SliceLayout(0, TL))
    ssp = gl.load(ss_ptr + tt[:, None] * stride_ss + om[None, :], mask=(tt[:, None] < T) & (om[None, :] < M),
                  other=0.0)
    return gl.convert_layout(gl.rsqrt(gl.sum(ssp, 0) / K + eps), OUT)


@gluon.jit
def _x_load(x_ptr, stride_xm, offs_m, m_ok, offs_k):
    # x[m, k] of one chunk, transposed: [64, BM]
    return gl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None], mask=m_ok[None, :], other=0.0)


@gluon.jit
def _x_norm(x, gamma, rstd):
    # RMSNorm(x) * gamma of loaded rows, rounded where HF rounds
    hn = (x.to(gl.float32) * rstd[None, :]).to(x.dtype)
    return (gamma[:, None].to(gl.float32) * hn.to(gl.float32)).to(x.dtype)


@constexpr_function
def code_layout(warps):
    """[32 warps threads, 4 code words, 4] with each thread's 16 code bytes (its fragments of one
    chunk) in its own registers: a slice over dim 2 is how the kernels load the codes."""
    return gl.BlockedLayout([1, 4, 4], [32, 1, 1], [warps, 1, 1], [2, 1, 0])


@constexpr_function
def scale_layout(warps):
    """[32 warps threads, b3, b2, b1, b0]: the decode's operand layout; a slice to [threads, b3] is
    how the kernels load the scale words."""
    return gl.BlockedLayout([1, 2, 2, 2, 2], [32, 1, 1, 1, 1], [warps, 1, 1, 1, 1], [4, 3, 2, 1, 0])


@gluon.jit
def decode_operands(cw, word, WARPS: gl.constexpr):
    # a chunk's code words [32 WARPS threads, 4] (slice of `code_layout`) and scale words [32 WARPS,
    # b3] (slice of `scale_layout`) -> the decode asm's operands: each code word broadcast over its
    # four bytes and each scale word over the (b2, b1, b0) it scales, so the asm takes both
    # registers as loaded
    L3: gl.constexpr = code_layout(WARPS)
    L5: gl.constexpr = scale_layout(WARPS)
    c5 = gl.broadcast(gl.expand_dims(cw, 2), gl.full([32 * WARPS, 4, 4], 0, gl.int32, L3))[0]
    c5 = gl.convert_layout(gl.reshape(c5, [32 * WARPS, 2, 2, 2, 2]), L5, assert_trivial=True)
    s5 = gl.broadcast(gl.expand_dims(gl.expand_dims(gl.expand_dims(word, 2), 3), 4),
                      gl.full([32 * WARPS, 2, 2, 2, 2], 0, gl.int32, L5))[0]
    return c5, s5


@gluon.jit
def decode(cw, word, WARPS: gl.constexpr):
    # code and scale words (see decode_operands) -> the fp16 weights of the chunk's low and high 32
    # inputs, [32 WARPS threads, 16 registers] each
    c5, s5 = decode_operands(cw, word, WARPS)
    a_lo, a_hi = gl.inline_asm_elementwise(_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [c5, s5],
                                           dtype=(gl.float16, gl.float16), is_pure=True, pack=4)
    return gl.reshape(a_lo, [32 * WARPS, 16]), gl.reshape(a_hi, [32 * WARPS, 16])


@gluon.jit
def decode_half(c5, s5, HI: gl.constexpr, WARPS: gl.constexpr):
    # decode_operands' operands -> the fp16 weights of the low (HI False) or high 32 inputs alone
    asm: gl.constexpr = _ASM_HI if HI else _ASM_LO
    v = gl.inline_asm_elementwise(asm, "=r,=r,r,r,r,r,r,r,r,r", [c5, s5], dtype=gl.float16, is_pure=True, pack=4)
    return gl.reshape(v, [32 * WARPS, 16])


@gluon.jit
def fragment(v, A: gl.constexpr, WARPS: gl.constexpr):
    # [32 WARPS threads, 16 registers] -> the [16 WARPS, 32] A fragments: row 16 w + 8 b1 + r, k
    # 16 b3 + 8 b2 + 2 c + b0 for thread 32 w + 4 r + c, register 8 b3 + 4 b2 + 2 b1 + b0 (no data
    # moves; mma.sync's A and wgmma's register A place a warp's 16 rows alike)
    v = gl.reshape(v, [WARPS, 8, 4, 2, 2, 2, 2])
    v = gl.permute(v, (0, 5, 1, 3, 4, 2, 6))
    return gl.convert_layout(gl.reshape(v, [16 * WARPS, 32]), A, assert_trivial=True)


@gluon.jit
def _shrink(x_ptr, stride_xm, g_ptr, ss_ptr, stride_ss, T, eps, a_tab_ptr, t_ptr, stride_tm, M, K, NSH, r, p,
            NORM: gl.constexpr, R: gl.constexpr, LDT: gl.constexpr, T_PAD: gl.constexpr, BLOCK_M: gl.constexpr):
    # t[:, 16j:16j+16] += x'[:, chunk] @ A[16j:16j+16, chunk]^T (products of model-dtype values in
    # fp32, FMA), one chunk a program: a shrink program is a chain of dependent round trips (A's
    # address, the loads, the norm, the atomics), so it stays shorter than the tiles' programs
    ACT: gl.constexpr = x_ptr.dtype.element_ty
    P3: gl.constexpr = gl.BlockedLayout([1, 8, 1], [2, 1, 16], [1, 4, 1], [2, 1, 0])  # [BM, 64, 16]
    XL: gl.constexpr = gl.SliceLayout(2, P3)
    AL: gl.constexpr = gl.SliceLayout(0, P3)
    TO: gl.constexpr = gl.SliceLayout(1, P3)
    XT: gl.constexpr = gl.BlockedLayout([4, 1], [16, 2], [1, 4], [0, 1])  # [64 k, BM], as the tiles load x
    j = p % NSH
    kc = p // NSH
    mm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, XT))
    kk = kc * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, XT))
    ka = gl.arange(0, 64, layout=gl.SliceLayout(1, AL))
    rr = (j * 16) % R + gl.arange(0, 16, layout=gl.SliceLayout(0, AL))
    a_ptr = gl.multiple_of(gl.load(a_tab_ptr + (j * 16) // R).to(gl.pointer_type(LDT)), 16)
    a = gl.load(a_ptr + rr[None, :] * K + kc * 64 + ka[:, None], mask=rr[None, :] < r, other=0.0)
    x = _x_load(x_ptr, stride_xm, mm, mm < M, kk)
    if NORM:  # loads first, so that their round trips overlap the sums of squares'
        g = gl.load(g_ptr + kk)
        x = _x_norm(x, g, _rstd(ss_ptr, stride_ss, T, mm, M, K, eps, T_PAD, gl.SliceLayout(0, XT)))
    xt = gl.convert_layout(gl.permute(x, (1, 0)), XL).to(gl.float32)
    acc = gl.sum(xt[:, :, None] * a.to(ACT).to(gl.float32)[None, :, :], 1)
    om = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, TO))
    oc = gl.arange(0, 16, layout=gl.SliceLayout(0, TO))
    gl.atomic_add(t_ptr + om[:, None] * stride_tm + (j * 16 + oc)[None, :], acc,
                  mask=(om < M)[:, None] & ((j * 16) % R + oc < r)[None, :])


@gluon.jit
def _tile(x_ptr, stride_xm, tab_ptr, ws_ptr, stride_wm, stride_ws, g_ptr, ss_ptr, stride_ss, T, eps,
          M, K, N1, N2, CPS, NT, q, NSEG: gl.constexpr, NORM: gl.constexpr, T_PAD: gl.constexpr,
          BLOCK_M: gl.constexpr):
    # ws[pid_k, m, n0:n0+64] = x'[m, slice] / 16 @ W[n0:n0+64, slice]^T / 2^-6, W from its fragments
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    CW: gl.constexpr = gl.SliceLayout(2, code_layout(4))  # [128 threads, 4 code words]: 16 bytes a thread
    SW: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, scale_layout(4))))  # [128, b3]
    XT: gl.constexpr = gl.BlockedLayout([4, 1], [16, 2], [1, 4], [0, 1])  # [64 k, BM] activations
    XS: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [0, 1])

    pid_n = q % NT
    pid_k = q // NT
    n0 = pid_n * 64
    c0 = pid_k * CPS
    n_chunks = gl.minimum(CPS, K // 64 - c0)  # the last slice may be shorter
    seg, start = _segment(n0, N1, N2, NSEG)
    # 16-byte aligned (`linear.make_plan` checks): without the hint the code and scale loads
    # split into 4-byte ones
    c_ptr = gl.multiple_of(gl.load(tab_ptr + seg * 8).to(gl.pointer_type(gl.int32)), 16)
    s_ptr = gl.multiple_of(gl.load(tab_ptr + seg * 8 + 1).to(gl.pointer_type(gl.int32)), 16)
    G = K // 64
    rb0 = (n0 - start) // 16  # the tile's first row block within its segment

    kk = gl.arange(0, 64, layout=gl.SliceLayout(1, XT))
    mm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, XT))
    m_ok = mm < M
    xs = gl.allocate_shared_memory(gl.float16, [2, 64, BLOCK_M], XS)

    # thread t = 32 w + lane reads its 16 code bytes and its two scale words (b3) of each chunk
    t = gl.arange(0, 128, layout=gl.SliceLayout(1, CW))
    cptr = c_ptr + ((rb0 + t // 32) * G + c0)[:, None] * 128 + ((t % 32) * 4)[:, None] \
        + gl.arange(0, 4, layout=gl.SliceLayout(0, CW))[None, :]
    ts = gl.arange(0, 128, layout=gl.SliceLayout(1, SW))
    b3 = gl.arange(0, 2, layout=gl.SliceLayout(0, SW))
    sptr = s_ptr + ((rb0 + ts // 32) * G + c0)[:, None] * 16 + ((ts % 32) // 4 * 2)[:, None] + b3[None, :]

    acc = gl.zeros([64, BLOCK_M], gl.float32, layout=MMA)
    # codes and scales of chunks i + 1 and i + 2 (HBM) and x, gamma of chunk i + 1 (L2) are in
    # flight while chunk i is decoded; x is normalised only when staged (loaded values are not
    # waited for early), and registers stay under MAX_REGS
    q_1 = gl.load(cptr)
    w_1 = gl.load(sptr)
    x_1 = _x_load(x_ptr, stride_xm, mm, m_ok, c0 * 64 + kk)
    if NORM:
        g_1 = gl.load(g_ptr + c0 * 64 + kk)
    i2 = gl.minimum(1, n_chunks - 1)
    q_2 = gl.load(cptr + i2 * 128)
    w_2 = gl.load(sptr + i2 * 16)
    if NORM:  # after the first loads are issued, so that the round trips overlap
        rstd = _rstd(ss_ptr, stride_ss, T, mm, M, K, eps, T_PAD, gl.SliceLayout(0, XT))
    for i in range(n_chunks):
        cw = q_1
        word = w_1
        xv = x_1
        q_1 = q_2
        w_1 = w_2
        nxt = gl.minimum(i + 2, n_chunks - 1)
        q_2 = gl.load(cptr + nxt * 128)
        w_2 = gl.load(sptr + nxt * 16)
        k1 = (c0 + gl.minimum(i + 1, n_chunks - 1)) * 64 + kk
        x_1 = _x_load(x_ptr, stride_xm, mm, m_ok, k1)
        if NORM:
            xv = _x_norm(xv, g_1, rstd)
            g_1 = gl.load(g_ptr + k1)
        buf = xs.index(i % 2)
        buf.store((xv * 0.0625).to(gl.float16))  # scaled in x's dtype (exact), then one rounding
        a_lo, a_hi = decode(cw, word, 4)
        acc = mma_v2(fragment(a_lo, A, 4), buf.slice(0, 32).load(B), acc)
        acc = mma_v2(fragment(a_hi, A, 4), buf.slice(32, 32).load(B), acc)

    offs_n = n0 + gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
    gl.store(ws_ptr + pid_k * stride_ws + offs_m[None, :] * stride_wm + offs_n[:, None], acc,
             mask=(offs_m < M)[None, :])


@gluon.jit
def nvfp4_splitk_kernel(
    x_ptr, stride_xm, tab_ptr, ws_ptr, stride_wm, stride_ws,
    g_ptr, ss_ptr, stride_ss, T, eps, a_tab_ptr, t_ptr, stride_tm,
    M, K, N1, N2, CPS, NT, NSH, r,
    NSEG: gl.constexpr, NORM: gl.constexpr, R: gl.constexpr, LDT: gl.constexpr, T_PAD: gl.constexpr,
    BLOCK_M: gl.constexpr,
):
    # Programs in id order: [0, NSH * K / 64) the LoRA shrink (16 columns of t over one chunk
    # each), then the tiles (pid_n, K slice) of 64 weight rows; all for M <= BLOCK_M rows.
    p = gl.program_id(0)
    n_sh = NSH * (K // 64)
    if p < n_sh:
        _shrink(x_ptr, stride_xm, g_ptr, ss_ptr, stride_ss, T, eps, a_tab_ptr, t_ptr, stride_tm, M, K, NSH, r,
                p, NORM, R, LDT, T_PAD, BLOCK_M)
    else:
        _tile(x_ptr, stride_xm, tab_ptr, ws_ptr, stride_wm, stride_ws, g_ptr, ss_ptr, stride_ss, T, eps,
              M, K, N1, N2, CPS, NT, p - n_sh, NSEG, NORM, T_PAD, BLOCK_M)


def usable(plan, m: int) -> bool:
    """Whether `linear.fused_linear` can take this kernel: NVFP4 segments in whole 64-row tiles, m rows."""
    return plan.fmt == "nvfp4" and m <= MAX_M and plan.seg_gcd % BLOCK_N == 0


def tiles(plan) -> int:
    """Tile programs a K slice of the launch: its weight rows (gate and up for GLU) / BLOCK_N."""
    return plan.n * (2 if plan.glu else 1) // BLOCK_N


def norm_on_load(plan, sms: int) -> bool:
    """Whether the tiles normalise x and shrink it on load (else `norm.norm_shrink` first): every
    tile normalises its K slice again, which a launch of many tiles pays many times: at 7B's decode
    shapes a separate launch won from the gate/up launch's tile count down to q/k/v's
    (docs/engine.md). The threshold sits between the measured tile counts."""
    return tiles(plan) < 2 * sms


def split_of(plan, sms: int, max_slices: int, shrink_programs: int = 0) -> tuple[int, int]:
    """(K slices, chunks a slice; the last slice may be shorter): as many slices as keep every tile
    program resident at once (`RESIDENT` an SM) beside the launch's `shrink_programs`, each at least
    `MIN_CPS` chunks, at most `max_slices` (what the workspace holds): more slices made the 7B
    gate/up and down launches faster (docs/engine.md)."""
    chunks, nt = plan.k // 64, tiles(plan)
    room = max(RESIDENT * sms - shrink_programs, nt)
    slices = max(1, min(room // nt, chunks // MIN_CPS, max_slices))
    cps = -(-chunks // slices)
    return -(-chunks // cps), cps


def launch(plan, x, t, norm, shrink, sms: int):
    """K slices of x' @ W^T into the workspace (and the LoRA shrink into t with `shrink`).

    Returns (slices, ws): the slices as `linear_kernels._linear_kernel` sums them, a [slices, m, n]
    view of plan.workspace (more slices than its SPLIT_MAX rows of B_max fit when m is small)."""
    m = x.shape[0]
    nt = tiles(plan)
    R = pow2(plan.r)
    nsh = plan.nseg * R // 16 if shrink is not None else 0
    n_shrink = nsh * (plan.k // 64)  # one program a (16 columns of t, chunk)
    flat = plan.workspace.view(-1)
    split, cps = split_of(plan, sms, flat.numel() // (m * nt * BLOCK_N), n_shrink)
    ws = flat[: split * m * nt * BLOCK_N].view(split, m, nt * BLOCK_N)
    ns_args, t_pad = norm_shrink_args(x, norm, shrink, t)
    grid = (n_shrink + nt * split,)
    nvfp4_splitk_kernel[grid](
        x, x.stride(0), plan.tab, ws, ws.stride(1), ws.stride(0), *ns_args,
        m, plan.k, plan.n1, plan.n2, cps, nt, nsh, max(plan.r, 1),
        NSEG=plan.nseg, NORM=norm is not None, R=R, LDT=tl_dtype(plan.lora_dtype or x.dtype),
        T_PAD=t_pad, BLOCK_M=MAX_M, num_warps=4, maxnreg=MAX_REGS,
    )
    return split, ws
