"""The fused linear's kernels (`linear` chooses and launches them): `_splitk_kernel`, the base
product over K slices for dense, NVFP4 and NF4 weights (normalising and shrinking on load where its
plan says so), and `_linear_kernel`, the epilogue every format ends in (summing the slices or a
cuBLAS product, the output scale, bias, LoRA expand, GLU, residual, the next shrink, sums of
squares; MXFP4's product too), with the device functions they share.
"""

from __future__ import annotations

from qerl_exp.engine.norm import _rstd, _x_tile
from qerl_exp.engine.triton_util import _dot, _f16_div16, tl, triton
from qerl_exp.quant.fp4_decode import _e2m1_to, _nvfp4_chunk  # how the FP4 formats decode, in every kernel

FMT_ID = {"dense": 0, "nvfp4": 1, "nf4": 2, "mxfp4": 3, "raw": 4}  # the kernels' FMT constexpr (raw: a cuBLAS buffer)


@triton.jit
def _segment(n0, N1, N2, NSEG: tl.constexpr):
    # (segment, its first column) of output column n0 when up to three segments sit side by
    # side: [0, N1), [N1, N2), [N2, ...). Tiles never straddle a boundary (BLOCK_N | seg_gcd).
    if NSEG == 1:
        seg = n0 * 0
        start = n0 * 0
    elif NSEG == 2:
        seg = (n0 >= N1).to(tl.int32)
        start = tl.where(n0 >= N1, N1, 0)
    else:
        seg = (n0 >= N1).to(tl.int32) + (n0 >= N2).to(tl.int32)
        start = tl.where(n0 >= N2, N2, tl.where(n0 >= N1, N1, 0))
    return seg, start


@triton.jit
def _tab(tab_ptr, i):
    # A size or an address from a plan table. `make_plan` checks that both are multiples of 16:
    # with the hint, loads through them become 16-byte vector loads.
    return tl.multiple_of(tl.load(tab_ptr + i), 16)


@triton.jit
def _tab_ptr(tab_ptr, i, DT: tl.constexpr):
    return tl.multiple_of(tl.load(tab_ptr + i).to(tl.pointer_type(DT)), 16)


@triton.jit
def _seg_ptrs(tab_ptr, seg, FMT: tl.constexpr):
    # (codes, scales, rows) of segment `seg` for a 4-bit format; scales as the layout stores
    # them: NVFP4 int32 (four E4M3 bytes), NF4 float32 absmax, MXFP4 uint8 E8M0
    code_ptr = _tab_ptr(tab_ptr, seg * 8, tl.uint8)
    if FMT == 1:
        sc_ptr = _tab_ptr(tab_ptr, seg * 8 + 1, tl.int32)
    elif FMT == 2:
        sc_ptr = _tab_ptr(tab_ptr, seg * 8 + 1, tl.float32)
    else:
        sc_ptr = _tab_ptr(tab_ptr, seg * 8 + 1, tl.uint8)
    return code_ptr, sc_ptr, _tab(tab_ptr, seg * 8 + 4)


@triton.jit
def _nf4_tile(code_ptr, sc_ptr, nrows, g, rows, lut_ptr, jj, DT: tl.constexpr):
    # k-group g (32 inputs) of BLOCK_N NF4 weight rows, dequantized: (w_lo, w_hi), [BN, 16] each.
    c = tl.load(code_ptr + g * nrows * 16 + rows[:, None] * 16 + jj[None, :])
    am = tl.load(sc_ptr + (g // 2) * nrows + rows)
    w_lo = (tl.load(lut_ptr + (c & 15).to(tl.int32)) * am[:, None]).to(DT)
    w_hi = (tl.load(lut_ptr + (c >> 4).to(tl.int32)) * am[:, None]).to(DT)
    return w_lo, w_hi


@triton.jit
def _mxfp4_tile(code_ptr, sc_ptr, nrows, g, rows, jj, DT: tl.constexpr):
    # k-group g (32 inputs) of BLOCK_N MXFP4 weight rows, dequantized: (w_lo, w_hi), [BN, 16] each.
    c = tl.load(code_ptr + g * nrows * 16 + rows[:, None] * 16 + jj[None, :])
    e = tl.load(sc_ptr + g * nrows + rows).to(tl.float32)
    s = tl.exp2(e - 121.0).to(DT)  # 2^(e - 127) * 64
    lo, hi = _e2m1_to(c, DT)
    return lo * s[:, None], hi * s[:, None]


@triton.jit
def _mxfp4_tile3(code_ptr, sc_ptr, nrows, gidx, rows, jj, DT: tl.constexpr):
    # GB k-groups at once: (w_lo, w_hi), each [GB, BN, 16]; many independent loads in flight.
    c = tl.load(code_ptr + gidx[:, None, None] * nrows * 16 + rows[None, :, None] * 16 + jj[None, None, :])
    e = tl.load(sc_ptr + gidx[:, None] * nrows + rows[None, :]).to(tl.float32)
    sc = tl.exp2(e - 121.0).to(DT)[:, :, None]
    lo, hi = _e2m1_to(c, DT)
    return lo * sc, hi * sc


@triton.jit
def _lora_tile(tab_ptr, fsc_ptr, seg, rows, t_ptr, stride_tm, offs_m, m_ok, r,
               R: tl.constexpr, ACT: tl.constexpr, LDT: tl.constexpr):
    # scaling * (t_seg @ B_seg[rows]^T): [BM, BN] fp32; t is rounded to the model dtype first,
    # as peft's lora_A output is.
    rr = tl.arange(0, R)
    b_ptr = _tab_ptr(tab_ptr, seg * 8 + 2, LDT)
    tt = tl.load(t_ptr + offs_m[:, None] * stride_tm + seg * R + rr[None, :],
                 mask=m_ok[:, None] & (rr[None, :] < r), other=0.0).to(ACT)
    bb = tl.load(b_ptr + rows[None, :] * r + rr[:, None], mask=rr[:, None] < r, other=0.0).to(ACT)
    return _dot(tt, bb, None) * tl.load(fsc_ptr + seg * 2)


@triton.jit
def _finish(acc, acc2, tab_ptr, fsc_ptr, seg, n0, rows, offs_m, offs_n, m_ok, t_ptr, stride_tm, r,
            out_ptr, stride_om, res_ptr, stride_rm, an_ptr, tn_ptr, stride_tnm, N, r_next, sso_ptr, stride_sso,
            GLU: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, HAS_RES: tl.constexpr,
            SHRINK_NEXT: tl.constexpr, SS_OUT: tl.constexpr, OUT16: tl.constexpr, R: tl.constexpr,
            R_NEXT: tl.constexpr, ACT: tl.constexpr, LDT: tl.constexpr, BLOCK_N: tl.constexpr):
    # The epilogue of one [BM, BN] output tile from its fp32 base product(s): output scale, bias,
    # LoRA expand; GLU: silu(gate) * up (acc2 = up, segment seg + 1); residual; store (rounded to
    # the model dtype ACT; OUT16: then / 16 in fp16). SS_OUT:
    # row n0 / 16 of ss gets the sums of squares of this tile's part of out's rows and the tile's
    # other rows zero, so the next norm sums the same rows whatever BLOCK_N wrote them.
    # SHRINK_NEXT: t_next += out_tile @ A_next[:, tile]^T (the down projection's LoRA shrink).
    y = acc * tl.load(fsc_ptr + seg * 2 + 1)
    if HAS_BIAS:
        bias_ptr = _tab_ptr(tab_ptr, seg * 8 + 3, ACT)
        y += tl.load(bias_ptr + rows).to(tl.float32)[None, :]
    if HAS_LORA:
        y += _lora_tile(tab_ptr, fsc_ptr, seg, rows, t_ptr, stride_tm, offs_m, m_ok, r, R, ACT, LDT)
    if GLU:
        y2 = acc2 * tl.load(fsc_ptr + (seg + 1) * 2 + 1)
        if HAS_LORA:
            y2 += _lora_tile(tab_ptr, fsc_ptr, seg + 1, rows, t_ptr, stride_tm, offs_m, m_ok, r, R, ACT, LDT)
        gt = y.to(ACT).to(tl.float32)
        y = (gt * tl.sigmoid(gt)).to(ACT).to(tl.float32) * y2.to(ACT).to(tl.float32)
    if HAS_RES:
        res = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=m_ok[:, None], other=0.0)
        y = y.to(ACT).to(tl.float32) + res.to(tl.float32)
    out = y.to(ACT)
    if OUT16:
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], _f16_div16(out), mask=m_ok[:, None])
    else:
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=m_ok[:, None])
    if SS_OUT:
        of = out.to(tl.float32)
        q = tl.arange(0, BLOCK_N // 16)
        part = tl.where(q[:, None] == 0, tl.sum(of * of, 1)[None, :], 0.0)
        tl.store(sso_ptr + (n0 // 16 + q)[:, None] * stride_sso + offs_m[None, :], part, mask=m_ok[None, :])
    if SHRINK_NEXT:
        rn = tl.arange(0, R_NEXT)
        a = tl.load(an_ptr + rn[None, :] * N + offs_n[:, None], mask=rn[None, :] < r_next, other=0.0).to(ACT)
        tl.atomic_add(tn_ptr + offs_m[:, None] * stride_tnm + rn[None, :], _dot(out, a, None),
                      mask=m_ok[:, None] & (rn[None, :] < r_next))


@triton.jit
def _splitk_kernel(
    x_ptr, stride_xm, tab_ptr, lut_ptr, ws_ptr, stride_wm, stride_ws,
    g_ptr, ss_ptr, stride_ss, T, eps, a_tab_ptr, t_ptr, stride_tm,
    M, K, N1, N2, CPS, NT, NSH, r,
    FMT: tl.constexpr, NSEG: tl.constexpr, ASM: tl.constexpr, NORM: tl.constexpr, R: tl.constexpr,
    LDT: tl.constexpr, T_PAD: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # The base product of a linear for decode shapes (dense FMT 0, NVFP4 1, NF4 2), K split into
    # SPLIT slices so that enough programs keep HBM busy; a raw `_linear_kernel` launch then sums
    # the slices and applies scale, bias, LoRA, GLU and residual. x' = x, or with NORM
    # RMSNorm(x) * gamma computed on load (HF's rounding; the rows' sums of squares come as T
    # partial sums). Programs, in id order:
    # - [0, NSH * SPLIT * MB): the LoRA shrink, t[:, 16j:16j+16] += x'[:, slice] @ A^T (fp32
    #   atomics; t is zeroed by the caller);
    # - the rest: tile (pid_n, pid_k, pid_m) of up to three segments side by side (q|k|v,
    #   gate|up) writes x'[:, slice] @ W_seg^T in fp32 to ws[pid_k].
    # NVFP4: 64 inputs a step, fp16 dot with the weight tile as the wide operand, x pre-scaled by
    # 1/16 (the epilogue's output scale undoes that and the 2^-6 of the decoded values). NF4:
    # the same 64 inputs as its two k-groups of 32 (table lookup times absmax), in fp16 the
    # same way (the epilogue's output scale undoes the 1/16).
    ACT = x_ptr.dtype.element_ty
    p = tl.program_id(0)
    MB = tl.cdiv(M, BLOCK_M)
    n_sh = NSH * SPLIT * MB
    j = 0
    pid_n = 0
    if p < n_sh:
        j = p % NSH
        pid_k = (p // NSH) % SPLIT
        pid_m = p // (NSH * SPLIT)
    else:
        pid_n = (p - n_sh) % NT
        pid_k = ((p - n_sh) // NT) % SPLIT
        pid_m = (p - n_sh) // (NT * SPLIT)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    rstd = tl.zeros((BLOCK_M,), tl.float32)
    if NORM:
        rstd = _rstd(ss_ptr, stride_ss, T, offs_m, m_ok, K, eps, T_PAD)
    c0 = pid_k * CPS
    kk = tl.arange(0, BLOCK_K)
    if p < n_sh:  # LoRA shrink: 16 columns of t (one segment: R is a multiple of 16)
        rr = (j * 16) % R + tl.arange(0, 16)
        a_ptr = tl.multiple_of(tl.load(a_tab_ptr + (j * 16) // R).to(tl.pointer_type(LDT)), 16)
        acc_t = tl.zeros((BLOCK_M, 16), tl.float32)
        for kc in range(c0, c0 + CPS):
            xt = _x_tile(x_ptr, stride_xm, offs_m, m_ok, kc * BLOCK_K + kk, g_ptr, rstd, NORM)
            a = tl.load(a_ptr + rr[None, :] * K + kc * BLOCK_K + kk[:, None], mask=rr[None, :] < r, other=0.0)
            acc_t = _dot(xt, a.to(ACT), acc_t)
        tl.atomic_add(t_ptr + offs_m[:, None] * stride_tm + (j * 16 + tl.arange(0, 16))[None, :], acc_t,
                      mask=m_ok[:, None] & (rr[None, :] < r))
    else:
        n0 = pid_n * BLOCK_N
        seg, start = _segment(n0, N1, N2, NSEG)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        rows = offs_n - start
        if FMT == 0:
            w_ptr = _tab_ptr(tab_ptr, seg * 8, ACT)
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for kc in range(c0, c0 + CPS):
                x = _x_tile(x_ptr, stride_xm, offs_m, m_ok, kc * BLOCK_K + kk, g_ptr, rstd, NORM)
                w = tl.load(w_ptr + rows[:, None] * K + kc * BLOCK_K + kk[None, :])
                acc = _dot(x, tl.trans(w), acc)
            tl.store(ws_ptr + pid_k * stride_ws + offs_m[:, None] * stride_wm + offs_n[None, :], acc,
                     mask=m_ok[:, None])
        else:  # 4-bit: the weight tile is the dot's wide operand
            acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            c_ptr, s_ptr, nrows = _seg_ptrs(tab_ptr, seg, FMT)
            if FMT == 1:
                j32 = tl.arange(0, 32)
                for g in range(c0, c0 + CPS):
                    x_lo = _x_tile(x_ptr, stride_xm, offs_m, m_ok, g * 64 + j32, g_ptr, rstd, NORM)
                    x_hi = _x_tile(x_ptr, stride_xm, offs_m, m_ok, g * 64 + 32 + j32, g_ptr, rstd, NORM)
                    x_lo = _f16_div16(x_lo)
                    x_hi = _f16_div16(x_hi)
                    w_lo, w_hi = _nvfp4_chunk(c_ptr, s_ptr, K // 64, g, n0 - start, ASM, BLOCK_N)
                    acc = tl.dot(w_lo, tl.trans(x_lo), acc)
                    acc = tl.dot(w_hi, tl.trans(x_hi), acc)
            else:
                j16 = tl.arange(0, 16)
                for g in range(c0, c0 + CPS):
                    for h in tl.static_range(2):  # k-groups 2g and 2g + 1
                        k0 = g * 64 + 32 * h
                        x_lo = _x_tile(x_ptr, stride_xm, offs_m, m_ok, k0 + j16, g_ptr, rstd, NORM)
                        x_hi = _x_tile(x_ptr, stride_xm, offs_m, m_ok, k0 + 16 + j16, g_ptr, rstd, NORM)
                        x_lo = _f16_div16(x_lo)
                        x_hi = _f16_div16(x_hi)
                        w_lo, w_hi = _nf4_tile(c_ptr, s_ptr, nrows, 2 * g + h, rows, lut_ptr, j16, tl.float16)
                        acc = _dot(w_lo, tl.trans(x_lo), acc)
                        acc = _dot(w_hi, tl.trans(x_hi), acc)
            tl.store(ws_ptr + pid_k * stride_ws + offs_m[None, :] * stride_wm + offs_n[:, None], acc,
                     mask=m_ok[None, :])


@triton.jit
def _linear_kernel(
    x_ptr, stride_xm, tab_ptr, fsc_ptr,
    out_ptr, stride_om, res_ptr, stride_rm, t_ptr, stride_tm,
    an_ptr, tn_ptr, stride_tnm, ss_ptr, stride_ss, ws_ptr, stride_wm, stride_ws, sk_from,
    M, N, K, N1, N2, r, r_next,
    FMT: tl.constexpr, NSEG: tl.constexpr, GLU: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr, HAS_RES: tl.constexpr, SHRINK_NEXT: tl.constexpr, SS_OUT: tl.constexpr,
    R: tl.constexpr, R_NEXT: tl.constexpr, UNROLL: tl.constexpr, LDT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NSPLIT: tl.constexpr = 0,
    SK: tl.constexpr = False, OUT16: tl.constexpr = False,
):
    # out[:, n] = x @ W_seg[n - start_seg]^T, then the epilogue `_finish`, one launch for up to
    # three segments (q, k, v); GLU: gate = segment 0 and up = segment 1 over the same N columns.
    # The base product: NSPLIT > 0: the sum of the fp32 K slices in ws (dense, NVFP4, NF4); SK: only
    # the columns from sk_from on (a multiple of 128, so of BLOCK_N) have more than slice 0
    # (`nvfp4_wgmma`'s split remainder); format raw: cuBLAS output in the plan's buffers; MXFP4:
    # computed here, in the model dtype (E8M0 scales may leave fp16's range). OUT16 (GLU): out is
    # fp16 and gets out / 16, the down projection's `nvfp4_wgmma` operand; x has the model dtype.
    if OUT16:
        ACT = x_ptr.dtype.element_ty
    else:
        ACT = out_ptr.dtype.element_ty
    pid_n = tl.program_id(0)
    if SK:  # the split columns (the last) sum more slices: they go first, not in the last wave
        pid_n = tl.num_programs(0) - 1 - pid_n
    pid_m = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    seg, start = _segment(n0, N1, N2, 1 if GLU else NSEG)  # GLU: gate and up share the columns
    rows = offs_n - start
    seg2 = seg + 1  # GLU: the up projection
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if NSPLIT > 0:
        part = ws_ptr + offs_m[:, None] * stride_wm + offs_n[None, :]
        if SK:  # a few column tiles are split: a loop (unrolled, GLU with LoRA spilled at 64 x 64)
            n_sp = 1
            if n0 >= sk_from:
                n_sp = NSPLIT
            for sp in range(0, n_sp):
                acc, acc2 = _add_slice(acc, acc2, part + sp * stride_ws, N1, m_ok, GLU)
        else:
            for sp in tl.static_range(NSPLIT):  # unrolled: the slices' loads are in flight together
                acc, acc2 = _add_slice(acc, acc2, part + sp * stride_ws, N1, m_ok, GLU)
    elif FMT == 4:  # raw
        raw_ptr = _tab_ptr(tab_ptr, seg * 8, ACT)
        acc += tl.load(raw_ptr + offs_m[:, None] * _tab(tab_ptr, seg * 8 + 5) + rows[None, :],
                       mask=m_ok[:, None], other=0.0).to(tl.float32)
        if GLU:
            raw2_ptr = _tab_ptr(tab_ptr, seg2 * 8, ACT)
            acc2 += tl.load(raw2_ptr + offs_m[:, None] * _tab(tab_ptr, seg2 * 8 + 5) + rows[None, :],
                            mask=m_ok[:, None], other=0.0).to(tl.float32)
    elif UNROLL > 1:  # GB = UNROLL k-groups per iteration, batched dot over the groups
        jj = tl.arange(0, 16)
        gg = tl.arange(0, UNROLL)
        c_ptr, s_ptr, nrows = _seg_ptrs(tab_ptr, seg, FMT)
        if GLU:
            c2_ptr, s2_ptr, nrows2 = _seg_ptrs(tab_ptr, seg2, FMT)
        xm = m_ok[None, :, None]
        for g0 in range(0, K // 32, UNROLL):
            gidx = g0 + gg
            xp = x_ptr + offs_m[None, :, None] * stride_xm + gidx[:, None, None] * 32 + jj[None, None, :]
            x_lo = tl.load(xp, mask=xm, other=0.0)
            x_hi = tl.load(xp + 16, mask=xm, other=0.0)
            w_lo, w_hi = _mxfp4_tile3(c_ptr, s_ptr, nrows, gidx, rows, jj, ACT)
            p = _dot(x_lo, tl.permute(w_lo, (0, 2, 1)), None) + _dot(x_hi, tl.permute(w_hi, (0, 2, 1)), None)
            acc += tl.sum(p, 0)
            if GLU:
                v_lo, v_hi = _mxfp4_tile3(c2_ptr, s2_ptr, nrows2, gidx, rows, jj, ACT)
                p2 = _dot(x_lo, tl.permute(v_lo, (0, 2, 1)), None) + _dot(x_hi, tl.permute(v_hi, (0, 2, 1)), None)
                acc2 += tl.sum(p2, 0)
    else:
        jj = tl.arange(0, 16)
        c_ptr, s_ptr, nrows = _seg_ptrs(tab_ptr, seg, FMT)
        if GLU:
            c2_ptr, s2_ptr, nrows2 = _seg_ptrs(tab_ptr, seg2, FMT)
        for g in range(0, K // 32):
            xp = x_ptr + offs_m[:, None] * stride_xm + g * 32 + jj[None, :]
            x_lo = tl.load(xp, mask=m_ok[:, None], other=0.0)
            x_hi = tl.load(xp + 16, mask=m_ok[:, None], other=0.0)
            w_lo, w_hi = _mxfp4_tile(c_ptr, s_ptr, nrows, g, rows, jj, ACT)
            acc = _dot(x_lo, tl.trans(w_lo), acc)
            acc = _dot(x_hi, tl.trans(w_hi), acc)
            if GLU:
                v_lo, v_hi = _mxfp4_tile(c2_ptr, s2_ptr, nrows2, g, rows, jj, ACT)
                acc2 = _dot(x_lo, tl.trans(v_lo), acc2)
                acc2 = _dot(x_hi, tl.trans(v_hi), acc2)
    _finish(acc, acc2, tab_ptr, fsc_ptr, seg, n0, rows, offs_m, offs_n, m_ok, t_ptr, stride_tm, r,
            out_ptr, stride_om, res_ptr, stride_rm, an_ptr, tn_ptr, stride_tnm, N, r_next, ss_ptr, stride_ss,
            GLU, HAS_BIAS, HAS_LORA, HAS_RES, SHRINK_NEXT, SS_OUT, OUT16, R, R_NEXT, ACT, LDT, BLOCK_N)


@triton.jit
def _add_slice(acc, acc2, part, N1, m_ok, GLU: tl.constexpr):
    # one split-K slice of the tile into its accumulators (GLU: up's columns N1 further on)
    acc += tl.load(part, mask=m_ok[:, None], other=0.0)
    if GLU:
        acc2 += tl.load(part + N1, mask=m_ok[:, None], other=0.0)
    return acc, acc2
