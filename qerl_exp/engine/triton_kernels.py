"""The engine's Triton kernels: the decode linears (`_splitk_kernel`, `_linear_kernel`), RMSNorm +
LoRA shrink, rope + KV-cache write and the prefill epilogue, with the helpers that pass them their
arguments (decode attention is `attention`'s; decoding FP4 weights is the format's,
`qerl_exp.quant.fp4_decode`).

`linear` and `launch` decide tiles and launch them; the weights arrive in the layouts of
`qerl_exp.quant.layout`; the tests hold each kernel to a torch
oracle (tests/engine_oracle.py) or to float64. Kernel names keep their leading underscore: the
profiles in docs/engine.md name them so. Without a GPU the kernels run only under the Triton
interpreter, which the caller turns on with TRITON_INTERPRET=1 before triton is first imported
(tests/test_engine.py does, in a subprocess).
"""

from __future__ import annotations

import torch
from torch import Tensor

from qerl_exp.quant.fp4_decode import HAS_TRITON, interpreting, tl, triton  # noqa: F401 - the engine's too

FMT_ID = {"dense": 0, "nvfp4": 1, "nf4": 2, "mxfp4": 3, "raw": 4}  # the kernels' FMT constexpr (raw: a cuBLAS buffer)

if HAS_TRITON:
    from qerl_exp.quant.fp4_decode import _e2m1_to, _nvfp4_chunk  # how the FP4 formats decode, in every kernel

    @triton.jit
    def _dot(a, b, acc):
        # tl.dot, exact for fp32 operands (Triton's default there is TF32: a 10-bit mantissa)
        if a.dtype == tl.float32:
            return tl.dot(a, b, acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def _dot_as_peft(x, a, acc):
        # x @ a in a's dtype, as peft's lora_A(x.to(A.dtype)). An fp32 a under 16-bit x is taken as
        # three terms in x's dtype (with bf16 24 significant bits, all of fp32's), each product exact
        # in the fp32 accumulator: the tensor cores do what an ieee fp32 dot does on the FMA units,
        # with which the 7B prefill's norm + shrink launches took 144 ms of its 320 (H200, 64 x 128
        # tokens; 19.7 ms this way)
        if a.dtype == tl.float32:
            if x.dtype != tl.float32:
                hi = a.to(x.dtype)
                rest = a - hi.to(tl.float32)
                mid = rest.to(x.dtype)
                acc = tl.dot(x, hi, acc)
                acc = tl.dot(x, mid, acc)
                return tl.dot(x, (rest - mid.to(tl.float32)).to(x.dtype), acc)
        return _dot(x.to(a.dtype), a, acc)

    @triton.jit
    def _f16_div16(x):
        # x / 16 in fp16 (the fp16 dots' activations): scaled in x's own dtype (exact for bf16),
        # then one conversion. Written as (x.to(fp32) * 0.0625).to(fp16), the compiler emitted
        # "round to fp16, then scale" (seen in the sm_90 PTX): inf from |x| = 65520 on.
        return (x * 0.0625).to(tl.float16)

    @triton.jit
    def _norm_shrink_kernel(
        x_ptr, stride_xm, g_ptr, h_ptr, stride_hm, a_tab_ptr, t_ptr, stride_tm, ss_ptr, stride_ss,
        M, K, r, eps, KCHUNK, T,
        NORM: tl.constexpr, LORA: tl.constexpr, NSEG: tl.constexpr, R: tl.constexpr, RT: tl.constexpr,
        LDT: tl.constexpr, T_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
        H16: tl.constexpr, SS_HERE: tl.constexpr, EXACT: tl.constexpr,
    ):
        # h = RMSNorm(x) * g (HF rounding), written to h, with the rows' sums of squares given as
        # T partial sums ss[:T, m] (written by the residual epilogue that produced x, so no program
        # has to read whole rows; SS_HERE: summed here over whole rows instead, the prefill's
        # case); t[:, s*R + j] += h @ A_s[j]^T over this program's K chunk (split-K with fp32
        # atomics; t is zeroed once per decode step), in x's dtype, or EXACT: in the adapters'
        # (peft's rounding, as the prefill keeps it). H16: h holds h / 16 in fp16 instead (the
        # wgmma kernel's operand), also without the norm (then h = x / 16).
        ACT = x_ptr.dtype.element_ty
        pid_k = tl.program_id(0)
        pid_m = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        if NORM:
            if SS_HERE:
                sq = tl.zeros((BLOCK_M,), tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    offs_k = k0 + tl.arange(0, BLOCK_K)
                    xf = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                                 mask=m_ok[:, None] & (offs_k < K)[None, :], other=0.0).to(tl.float32)
                    sq += tl.sum(xf * xf, 1)
                rstd = tl.rsqrt(sq / K + eps)
            else:
                rstd = _rstd(ss_ptr, stride_ss, T, offs_m, m_ok, K, eps, T_PAD)
        jj = tl.arange(0, RT)
        seg = jj // R
        j_ok = (seg < NSEG) & ((jj % R) < r)
        a_row = tl.multiple_of(tl.load(a_tab_ptr + seg, mask=seg < NSEG, other=0).to(tl.pointer_type(LDT)), 16)
        a_row = a_row + (jj % R) * K
        acc = tl.zeros((BLOCK_M, RT), tl.float32)
        for k0 in range(pid_k * KCHUNK, pid_k * KCHUNK + KCHUNK, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if NORM:
                hn = (x.to(tl.float32) * rstd[:, None]).to(ACT)
                gam = tl.load(g_ptr + offs_k, mask=k_ok, other=0.0)
                x = (gam[None, :].to(tl.float32) * hn.to(tl.float32)).to(ACT)
            if H16:
                tl.store(h_ptr + offs_m[:, None] * stride_hm + offs_k[None, :], _f16_div16(x),
                         mask=m_ok[:, None] & k_ok[None, :])
            elif NORM:
                tl.store(h_ptr + offs_m[:, None] * stride_hm + offs_k[None, :], x,
                         mask=m_ok[:, None] & k_ok[None, :])
            if LORA:
                a = tl.load(a_row[None, :] + offs_k[:, None], mask=j_ok[None, :] & k_ok[:, None], other=0.0)
                if EXACT:
                    acc = _dot_as_peft(x, a, acc)
                else:
                    acc = _dot(x, a.to(ACT), acc)
        if LORA:
            tl.atomic_add(t_ptr + offs_m[:, None] * stride_tm + jj[None, :], acc,
                          mask=m_ok[:, None] & j_ok[None, :])

    @triton.jit
    def _rstd(ss_ptr, stride_ss, T, offs_m, m_ok, K, eps, T_PAD: tl.constexpr):
        # 1 / RMS of rows offs_m from T partial sums of squares ss[:T, m] (written by the residual
        # epilogue that produced the rows, so no program has to read whole rows)
        tt = tl.arange(0, T_PAD)
        ssp = tl.load(ss_ptr + tt[:, None] * stride_ss + offs_m[None, :], mask=(tt[:, None] < T) & m_ok[None, :],
                      other=0.0)
        return tl.rsqrt(tl.sum(ssp, 0) / K + eps)

    @triton.jit
    def _x_tile(x_ptr, stride_xm, offs_m, m_ok, offs_k, g_ptr, rstd, NORM: tl.constexpr):
        # activations [BM, BK] in the model dtype; NORM: RMSNorm(x) * gamma, rounded where HF rounds
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None], other=0.0)
        if NORM:
            ACT = x_ptr.dtype.element_ty
            hn = (x.to(tl.float32) * rstd[:, None]).to(ACT)
            x = (tl.load(g_ptr + offs_k)[None, :].to(tl.float32) * hn.to(tl.float32)).to(ACT)
        return x

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

    @triton.jit
    def _rope_cache_kernel(
        qkv_ptr, stride_qm, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr,
        kc_ptr, vc_ptr, stride_cb, stride_ch, stride_cs, qn_ptr, kn_ptr, eps,
        HQ, HKV, P, D: tl.constexpr, HALF: tl.constexpr, QK_NORM: tl.constexpr,
    ):
        # One (token row, head) per program, P rows a sequence (decode: 1; the prefill: the prompt
        # length, row i of sequence b at slot `slot` + i); heads [0, HQ) are queries (rotated,
        # written to q [B, HQ, P, D]), [HQ, HQ + HKV) keys (rotated, into the cache), the rest
        # values (copied). QK_NORM (Qwen3): queries and keys are first RMS-normalised over the
        # head's D values and scaled by qn / kn [D].
        ACT = qkv_ptr.dtype.element_ty
        row = tl.program_id(0)
        h = tl.program_id(1)
        b = row // P
        i = row - b * P
        d = tl.arange(0, HALF)
        src = qkv_ptr + row * stride_qm + h * D
        x1 = tl.load(src + d)
        x2 = tl.load(src + HALF + d)
        slot = tl.load(slot_ptr) + i
        if h < HQ + HKV:
            pos = tl.load(pos_ptr + row)
            c1 = tl.load(cos_ptr + pos * D + d).to(tl.float32)
            c2 = tl.load(cos_ptr + pos * D + HALF + d).to(tl.float32)
            s1 = tl.load(sin_ptr + pos * D + d).to(tl.float32)
            s2 = tl.load(sin_ptr + pos * D + HALF + d).to(tl.float32)
            f1 = x1.to(tl.float32)
            f2 = x2.to(tl.float32)
            if QK_NORM:  # HF's RMSNorm: in fp32, rounded to the activations' dtype, then times the scale
                rstd = tl.rsqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / D + eps)
                w_ptr = qn_ptr if h < HQ else kn_ptr
                w1 = tl.load(w_ptr + d).to(tl.float32)
                w2 = tl.load(w_ptr + HALF + d).to(tl.float32)
                f1 = (w1 * (f1 * rstd).to(ACT).to(tl.float32)).to(ACT).to(tl.float32)
                f2 = (w2 * (f2 * rstd).to(ACT).to(tl.float32)).to(ACT).to(tl.float32)
            # HF: q * cos + rotate_half(q) * sin, each product rounded to the model dtype
            y1 = ((f1 * c1).to(ACT).to(tl.float32) + (-f2 * s1).to(ACT).to(tl.float32)).to(ACT)
            y2 = ((f2 * c2).to(ACT).to(tl.float32) + (f1 * s2).to(ACT).to(tl.float32)).to(ACT)
            if h < HQ:
                dst = q_ptr + ((b * HQ + h) * P + i) * D
            else:
                dst = kc_ptr + b * stride_cb + (h - HQ) * stride_ch + slot * stride_cs
            tl.store(dst + d, y1)
            tl.store(dst + HALF + d, y2)
        else:
            dst = vc_ptr + b * stride_cb + (h - HQ - HKV) * stride_ch + slot * stride_cs
            tl.store(dst + d, x1)
            tl.store(dst + HALF + d, x2)

    @triton.jit
    def _lora_fp32(y_ptr, t_ptr, b_ptr, scale, stride, stride_t, offs_m, offs_n, m_ok, n_ok, r, R: tl.constexpr):
        # y + scale * t @ B^T over one tile, in fp32 (peft: the bf16 base output plus the LoRA term
        # in the adapters' dtype, promoted to fp32)
        y = tl.load(y_ptr + offs_m[:, None] * stride + offs_n[None, :], mask=m_ok[:, None] & n_ok[None, :],
                    other=0.0).to(tl.float32)
        if R > 0:
            rr = tl.arange(0, R)
            tt = tl.load(t_ptr + offs_m[:, None] * stride_t + rr[None, :], mask=m_ok[:, None] & (rr[None, :] < r),
                         other=0.0).to(tl.float32)
            bb = tl.load(b_ptr + offs_n[None, :] * r + rr[:, None], mask=n_ok[None, :] & (rr[:, None] < r),
                         other=0.0).to(tl.float32)
            # tf32x3: fp32 accuracy on tensor cores (FMA ieee took 72 us a launch, 7B batch 8 prefill)
            y += tl.dot(tt, bb, input_precision="tf32x3") * scale
        return y

    @triton.jit
    def _prefill_epilogue_kernel(
        y_ptr, y2_ptr, stride_y, t_ptr, t2_ptr, stride_t, b_ptr, b2_ptr, scale, scale2,
        res_ptr, stride_r, out_ptr, stride_o, M, N, r,
        GLU: tl.constexpr, HAS_RES: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        # out = y + scale * t @ B^T (R = 0: no LoRA), rounded once; GLU: silu(out) * (the same of
        # y2, t2, B2), each rounded as HF; HAS_RES: + res after rounding (HF's residual add)
        ACT = out_ptr.dtype.element_ty
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        n_ok = offs_n < N
        ok = m_ok[:, None] & n_ok[None, :]
        y = _lora_fp32(y_ptr, t_ptr, b_ptr, scale, stride_y, stride_t, offs_m, offs_n, m_ok, n_ok, r, R)
        if GLU:
            u = _lora_fp32(y2_ptr, t2_ptr, b2_ptr, scale2, stride_y, stride_t, offs_m, offs_n, m_ok, n_ok, r, R)
            g = y.to(ACT).to(tl.float32)
            y = (g * tl.sigmoid(g)).to(ACT).to(tl.float32) * u.to(ACT).to(tl.float32)
        if HAS_RES:
            res = tl.load(res_ptr + offs_m[:, None] * stride_r + offs_n[None, :], mask=ok, other=0.0)
            y = y.to(ACT).to(tl.float32) + res.to(tl.float32)
        tl.store(out_ptr + offs_m[:, None] * stride_o + offs_n[None, :], y.to(ACT), mask=ok)


def pow2(n: int, lo: int = 16) -> int:
    """The smallest power of two >= n, at least `lo` (a padded tile size: LoRA ranks, head groups)."""
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


_DUMMIES: dict = {}


def tl_dtype(dtype: torch.dtype):
    """Triton's dtype for a torch float dtype (the kernels' LDT constexpr)."""
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def dummy_tensor(device: torch.device, dtype: torch.dtype) -> Tensor:
    """A small zero tensor for unused kernel arguments (made once, never inside a graph capture)."""
    key = (str(device), dtype)
    if key not in _DUMMIES:
        _DUMMIES[key] = torch.zeros(64, dtype=dtype, device=device)
    return _DUMMIES[key]


def norm_shrink_args(x: Tensor, norm: tuple | None, shrink: Tensor | None, t: Tensor | None) -> tuple:
    """The split-K kernels' norm and shrink arguments (g, ss, stride_ss, T, eps, a_tab, t,
    stride_tm), dummies where unused, and T_PAD."""
    gamma, eps, ss = norm if norm is not None else (None, 0.0, None)
    f32 = dummy_tensor(x.device, torch.float32)
    args = (gamma if gamma is not None else dummy_tensor(x.device, x.dtype), ss if ss is not None else f32,
            ss.stride(0) if ss is not None else 0, ss.shape[0] if ss is not None else 1, eps,
            shrink if shrink is not None else dummy_tensor(x.device, torch.int64), t if t is not None else f32,
            t.stride(0) if t is not None else 0)
    return args, pow2(ss.shape[0] if ss is not None else 1, 1)
