"""The NVFP4 tensor-core kernel for 16-256 rows on Hopper: a TMA ring fed by a producer warp, the
weights decoded in registers into wgmma's A operand (Gluon, sm_90).

Why this shape (docs/engine.md): from 64 rows on, cuBLAS bf16 stops being bound by weight
bytes, so a 4-bit kernel must keep the tensor cores as busy as cuBLAS does while it decodes. Here
- one producer warp (`_load`) streams each K chunk's codes, block scales and activations into a
  `STAGES`-deep shared-memory ring by TMA, as far ahead as the ring allows; the consumers never wait
  on HBM latency, only on the ring;
- two consumer warpgroups (`_consume`, 128 weight rows: 16 a warp) read their codes from the ring
  into registers (they are stored in the A fragments' order, `layout.relayout_nvfp4`, so each
  thread's 16 bytes are one contiguous read and become its fragment by relabelling), decode them
  with the same E2M1 x E4M3 inline PTX as `nvfp4_mma` (exact in fp16), and issue asynchronous
  wgmmas against the activation tile in shared memory, one a half chunk (32 inputs); each half's
  wgmma runs while the next half is decoded into other registers (a wgmma reads its register
  operand while it runs), and a ring slot goes back to the producer once both wgmmas that read it
  have retired;
- the activations arrive as fp16 x' / 16 (`norm.norm_shrink(..., h16=True)` writes them with the
  norm and the LoRA shrink; the down projection's, the GLU epilogue before it: `LinearPlan.takes_x16`),
  so TMA puts them where wgmma reads them with no pass over registers;
- the schedule fills whole waves: as many tiles as make whole waves of programs take all of K, and
  only the tiles left over are split along K (`config`). At full rate a program's time is its
  tile's, so 7B gate/up's 296 tiles on 132 SMs took 3 tile times as 2.24 waves; now 2.25.

Same contract as the other NVFP4 paths: K slice `pid_k` of x' @ W^T in units of 2^-6 / 16, fp32,
into ws[pid_k]; the raw `_linear_kernel` launch finishes the tile (summing slices past 0 only in
the columns that were split, `launch`'s sk_from).
"""

from __future__ import annotations

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from qerl_exp.engine.nvfp4_mma import _segment, code_layout, decode_half, decode_operands, fragment, scale_layout

WARPS = gl.constexpr(8)  # consumer warps: two warpgroups
BLOCK_N = gl.constexpr(16 * WARPS.value)  # weight rows a program
RB = gl.constexpr(WARPS.value)  # 16-row blocks a program
# rows up to -> BLOCK_M (more rows: m blocks of 128, or of 256 where `dispatch.json` says so), ring
# stages, registers a thread (ptxas' cap over all 12 warps; the consumers take the producer's spare ones)
TILES = ((16, dict(BLOCK_M=16, STAGES=8, maxnreg=128)), (32, dict(BLOCK_M=32, STAGES=8, maxnreg=128)),
         (64, dict(BLOCK_M=64, STAGES=6, maxnreg=128)), (128, dict(BLOCK_M=128, STAGES=4, maxnreg=168)))
MIN_CPS = 4  # chunks of 64 inputs a K slice takes at least


@gluon.jit
def _load(cd0, cd1, cd2, sd0, sd1, sd2, xd, codes, scales, xs, ready, empty, seg, rb0, c0, m0, n_chunks,
          NSEG: gl.constexpr):
    # producer: chunk i's codes [RB, 1, 128] and scales [RB, 1, 16] (int32) and x' [BM, 64] (two
    # 32-input halves) into ring slot i % S, once the consumers have released it
    S: gl.constexpr = codes.shape[0]
    nbytes: gl.constexpr = cd0.block_type.nbytes + sd0.block_type.nbytes + 2 * xd.block_type.nbytes
    for i in range(n_chunks):
        s = i % S
        mbarrier.wait(empty.index(s), ((i // S) & 1) ^ 1)
        bar = ready.index(s)
        mbarrier.expect(bar, nbytes)
        g = c0 + i
        if NSEG == 1:
            tma.async_copy_global_to_shared(cd0, [rb0, g, 0], bar, codes.index(s))
            tma.async_copy_global_to_shared(sd0, [rb0, g, 0], bar, scales.index(s))
        else:
            if seg == 0:
                tma.async_copy_global_to_shared(cd0, [rb0, g, 0], bar, codes.index(s))
                tma.async_copy_global_to_shared(sd0, [rb0, g, 0], bar, scales.index(s))
            elif seg == 1:
                tma.async_copy_global_to_shared(cd1, [rb0, g, 0], bar, codes.index(s))
                tma.async_copy_global_to_shared(sd1, [rb0, g, 0], bar, scales.index(s))
            else:
                tma.async_copy_global_to_shared(cd2, [rb0, g, 0], bar, codes.index(s))
                tma.async_copy_global_to_shared(sd2, [rb0, g, 0], bar, scales.index(s))
        tma.async_copy_global_to_shared(xd, [m0, g * 64], bar, xs.index(2 * s))
        tma.async_copy_global_to_shared(xd, [m0, g * 64 + 32], bar, xs.index(2 * s + 1))


@gluon.jit
def _slot(s, phase, codes, scales, ready):
    # wait until ring slot s is filled (phase: the parity of its fills so far); its codes and
    # scales, loaded and broadcast as the decode takes them
    CW: gl.constexpr = gl.SliceLayout(2, code_layout(WARPS))  # [32 RB threads, 4 code words]: 16 bytes a thread
    SW: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, scale_layout(WARPS))))  # [32 RB, b3]
    # scale entry 2 r + b3 of row block w, read by the four threads 32 w + 4 r + c
    PS: gl.constexpr = gl.BlockedLayout([1, 1, 2], [8, 4, 1], [WARPS, 1, 1], [2, 1, 0])  # [8 RB, c, b3]
    mbarrier.wait(ready.index(s), phase)
    cw = codes.index(s).reshape([32 * RB, 4]).load(CW)
    sw = scales.index(s).reshape([8 * RB, 2]).load(gl.SliceLayout(1, PS))
    word = gl.broadcast(gl.expand_dims(sw, 1), gl.full([8 * RB, 4, 2], 0, gl.int32, PS))[0]
    word = gl.convert_layout(gl.reshape(word, [32 * RB, 2]), SW, assert_trivial=True)
    return decode_operands(cw, word, WARPS)


@gluon.jit
def _half(c5, s5, HI: gl.constexpr, ACC: gl.constexpr):
    # a chunk's low or high 32 inputs decoded into wgmma's register A operand
    A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
    return fragment(decode_half(c5, s5, HI, WARPS), A, WARPS)


@gluon.jit
def _consume(codes, scales, xs, ready, empty, n_chunks, BLOCK_M: gl.constexpr):
    # consumers: each chunk in two halves of 32 inputs, one wgmma each. A wgmma reads its register
    # operand while it runs, so a half's registers are decoded again only after the wgmma that read
    # them has retired: each wait carries the fragments of the half it retires (`deps`) and allows
    # the other half's wgmma to run on while the next half is decoded. Two sets of 8 registers, so
    # ptxas keeps them apart even at 80 registers a thread (two programs an SM), where whole-chunk
    # sets (16 registers each) made it serialise every wgmma (C7512). A ring slot goes back to the
    # producer once both its halves have retired. Chunk 0 is peeled (use_acc=False), so no path
    # reaches the last wait with an accumulator that a wgmma did not write (ptxas would then
    # serialise every wgmma, C7515)
    S: gl.constexpr = codes.shape[0]
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                  instr_shape=[16, BLOCK_M, 16])
    c5, s5 = _slot(0, 0, codes, scales, ready)
    lo = _half(c5, s5, False, ACC)
    acc = warpgroup_mma(lo, xs.index(0).permute((1, 0)), gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=ACC),
                        use_acc=False, is_async=True)
    hi = _half(c5, s5, True, ACC)
    acc = warpgroup_mma(hi, xs.index(1).permute((1, 0)), acc, is_async=True)
    s = 0  # the ring slot and its fill parity, carried (i % S in the loop cost 9 of its 111 instructions)
    phase = 0
    for i in range(1, n_chunks):
        prev = s
        s += 1
        if s == S:
            s = 0
            phase ^= 1
        c5, s5 = _slot(s, phase, codes, scales, ready)
        acc, lo = warpgroup_mma_wait(num_outstanding=1, deps=(acc, lo))  # chunk i - 1's low half retired
        lo = _half(c5, s5, False, ACC)
        acc = warpgroup_mma(lo, xs.index(2 * s).permute((1, 0)), acc, is_async=True)
        acc, hi = warpgroup_mma_wait(num_outstanding=1, deps=(acc, hi))  # and its high half
        mbarrier.arrive(empty.index(prev))  # reads done: no proxy fence before TMA overwrites
        hi = _half(c5, s5, True, ACC)
        acc = warpgroup_mma(hi, xs.index(2 * s + 1).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    return (acc,)


@gluon.jit
def nvfp4_wgmma_kernel(cd0, cd1, cd2, sd0, sd1, sd2, xd, ws_ptr, stride_wm, stride_ws,
                       M, K, N1, N2, NT, DP, CPS,
                       NSEG: gl.constexpr, GLU: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    # Work item j = q // MB (q = program id), m block q % MB (BLOCK_M rows): the m blocks of a weight
    # tile run side by side, so only the first reads it from HBM. Items below DP are whole tiles
    # (all of K, slice 0); the rest split the last NT - DP tiles' K into slices of CPS chunks (the
    # last may be shorter), slice pid_k. Tiles are counted in `config`'s order: GLU interleaves gate
    # and up tiles, so the split ones are gate's and up's last (NT - DP) / 2 alike
    q = gl.program_id(0)
    mb = gl.cdiv(M, BLOCK_M)
    j = q // mb
    tile = j
    pid_k = 0
    c0 = 0
    n_chunks = K // 64
    if j >= DP:
        tile = DP + (j - DP) % (NT - DP)
        pid_k = (j - DP) // (NT - DP)
        c0 = pid_k * CPS
        n_chunks = gl.minimum(CPS, K // 64 - c0)
    if GLU:
        tile = tile // 2 + (tile % 2) * (NT // 2)
    n0 = tile * BLOCK_N
    m0 = (q % mb) * BLOCK_M
    seg, start = _segment(n0, N1, N2, NSEG)
    rb0 = (n0 - start) // 16

    codes = gl.allocate_shared_memory(gl.int32, [STAGES, RB, 1, 128], cd0.layout)
    scales = gl.allocate_shared_memory(gl.int32, [STAGES, RB, 1, 16], sd0.layout)
    xs = gl.allocate_shared_memory(gl.float16, [2 * STAGES, BLOCK_M, 32], xd.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)

    (acc,) = gl.warp_specialize([
        (_consume, (codes, scales, xs, ready, empty, n_chunks, BLOCK_M)),
        (_load, (cd0, cd1, cd2, sd0, sd1, sd2, xd, codes, scales, xs, ready, empty, seg, rb0, c0, m0,
                 n_chunks, NSEG)),
    ], [1], [40])

    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                  instr_shape=[16, BLOCK_M, 16])
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ACC))
    offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, ACC))
    gl.store(ws_ptr + pid_k * stride_ws + offs_m[None, :] * stride_wm + offs_n[:, None], acc,
             mask=(offs_m < M)[None, :])


def config(m: int, tiles: int, chunks: int, sms: int, max_slices: int, over: dict | None = None,
           glu: bool = False) -> dict:
    """BLOCK_M, STAGES, maxnreg and the schedule (DP, SPLIT, CPS, SK_FROM) for m rows of a launch of
    `tiles` weight tiles (gate and up interleaved when `glu`) and `chunks` chunks of 64 inputs.

    `TILES`' row for m (the first whose bound is >= m, else the last), updated with `over` (a
    `dispatch.json` entry's measured tiles). As many whole waves of programs as the launch fills
    take whole tiles (DP of them, all of K); the tiles left over, a part of a wave that would leave
    SMs idle, have their K split into as many slices as fit in the SMs beside each other (each at
    least `MIN_CPS` chunks, at most `max_slices`), so they take a fraction of a tile's time. Fewer
    programs than a wave: DP = 0 and every tile is split that way. `over` may fix SPLIT (then DP =
    0). SK_FROM: the first output column with more than one slice (GLU: of gate's and of up's), 0
    when every column has them."""
    cfg = dict(next((t for bound, t in TILES if m <= bound), TILES[-1][1]))
    cfg.update(over or {})
    mb = -(-m // cfg["BLOCK_M"])
    # programs resident at once (registers; the producer's warp takes a whole warpgroup's)
    slots = 65536 // (cfg["maxnreg"] * 32 * (WARPS.value + 4)) * sms
    dp = 0 if cfg.get("SPLIT") else tiles * mb // slots * slots // mb
    if glu:
        dp -= (tiles - dp) % 2  # the split tiles are gate's and up's alike
    rest = tiles - dp
    split = cfg.get("SPLIT") or max(1, min(slots // max(rest * mb, 1), chunks // MIN_CPS, max_slices))
    cps = -(-chunks // split)
    cfg["DP"], cfg["SPLIT"], cfg["CPS"] = dp, -(-chunks // cps), cps
    cfg["SK_FROM"] = (dp // 2 if glu else dp) * BLOCK_N.value  # the kernel's tile order, gate/up interleaved
    return cfg


def usable(plan, m: int) -> bool:
    """Whether the kernel takes this launch: NVFP4 in whole 128-row tiles, at least 16 rows."""
    return plan.fmt == "nvfp4" and m >= 16 and plan.seg_gcd % BLOCK_N.value == 0


def _descriptors(plan, bm: int, x16: Tensor) -> tuple:
    # TMA descriptors of every segment's codes and scales (int32 views) and of x'; fewer than three
    # segments repeat the first (never read)
    cl = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)
    cds, sds = [], []
    for w in plan.kernel_weights:
        cds.append(TensorDescriptor.from_tensor(w.codes.view(torch.int32), [RB.value, 1, 128], cl))
        sds.append(TensorDescriptor.from_tensor(w.scales, [RB.value, 1, 16], cl))
    cds += [cds[0]] * (3 - len(cds))
    sds += [sds[0]] * (3 - len(sds))
    xd = TensorDescriptor.from_tensor(x16, [bm, 32], gl.NVMMASharedLayout.get_default_for([bm, 32], gl.float16))
    return (*cds, *sds, xd)


def launch(plan, x16: Tensor, sms: int, tiles: dict | None = None) -> tuple[int, int, Tensor]:
    """K slices of x' @ W^T into the workspace from fp16 x16 = x' / 16 [M, K] (contiguous).

    Args:
        tiles: `config`'s keys to use instead of its choice (a `dispatch.json` entry).

    Returns (slices, sk_from, ws): `linear_kernels._linear_kernel` sums slice 0 of every output
    column and the other slices of the columns from sk_from on (GLU: of both gate and up), from
    the [slices, m, n] view of plan.workspace they are in."""
    m = x16.shape[0]
    total = plan.n * (2 if plan.glu else 1)
    nt = total // BLOCK_N.value
    flat = plan.workspace.view(-1)
    cfg = config(m, nt, plan.k // 64, sms, flat.numel() // (m * total), tiles, plan.glu)
    ws = flat[: cfg["SPLIT"] * m * total].view(cfg["SPLIT"], m, total)
    bm = cfg["BLOCK_M"]
    dp = cfg["DP"]
    programs = (dp + (nt - dp) * cfg["SPLIT"]) * -(-m // bm)
    nvfp4_wgmma_kernel[(programs,)](
        *_descriptors(plan, bm, x16), ws, ws.stride(1), ws.stride(0),
        m, plan.k, plan.n1, plan.n2, nt, dp, cfg["CPS"],
        NSEG=plan.nseg, GLU=plan.glu, BLOCK_M=bm, STAGES=cfg["STAGES"], num_warps=WARPS.value,
        maxnreg=cfg["maxnreg"],
    )
    return cfg["SPLIT"], cfg["SK_FROM"], ws
