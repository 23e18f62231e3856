"""The NVFP4 paths for 16-256 rows (`nvfp4_wgmma`; `_splitk_kernel`) against dequantize + matmul in
float64, with norm, LoRA shrink and expand, bias, GLU, residual and the down projection's LoRA
shrink fused as the engine launches them; the GLU epilogue's fp16 operand for a down projection on
`nvfp4_wgmma`; and `engine.dispatch`'s table, its lookup and its fallback on other GPUs."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import engine_oracle as oracle
from conftest import patch_interpreter, run_interpreted
from qerl_exp.engine import dispatch, linear, norm, triton_util
from qerl_exp.engine.fast_engine import FastEngine
from test_engine import _nvfp4_packed, _to, assert_greedy_like_hf, gpu, hf_greedy, needs_cuda, prompts, tiny_model

SHAPES_CPU = [("qkv", [32, 16, 16], 256, False), ("gate/up", [32, 32], 256, True), ("down", [32], 512, False)]
SHAPES_7B = [("qkv", [3584, 512, 512], 3584, False), ("o", [3584], 3584, False),
             ("gate/up", [18944, 18944], 3584, True), ("down", [3584], 18944, False)]
ROWS = (16, 17, 64, 100, 256)


def _check_paths(device: str, dtype: torch.dtype, tol: float, shapes: list, cases: list, lora_dtype=None) -> None:
    """Each shape (name, segments, k, glu) with its cases (rows, kind or None for the plan's own
    choice, tiles) through `fused_linear` against float64, on `device`."""
    torch.manual_seed(0)
    dev = torch.device(device)
    ldt = lora_dtype or dtype
    for (name, segs, k, glu), tiles in zip(shapes, cases):
        ws = [_to(_nvfp4_packed(torch.randn(n, k) * 0.1), dev) for n in segs]
        dense = [w.dequantize().to(dev, torch.float64) for w in ws]
        bias = [None if glu else torch.randn(n).to(dev, dtype) for n in segs]
        a = [(torch.randn(8, k) * 0.1).to(dev, ldt) for _ in segs]
        b = [(torch.randn(n, 8) * 0.1).to(dev, ldt) for n in segs]
        total = sum(segs)
        wsp = torch.full((linear.SPLIT_MAX, max(ROWS), total), float("nan"), device=dev)  # slices overwritten
        plan = linear.make_plan("nvfp4", ws, bias, b, [2.0] * len(segs), 8, glu, dev, workspace=wsp)
        a_tab = torch.tensor([t.data_ptr() for t in a], dtype=torch.int64, device=dev)
        gamma = (1 + 0.1 * torch.randn(k)).to(dev, dtype)
        for m, kind, cfg in tiles:
            x = torch.randn(m, k).to(dev, dtype)
            ss = x.float().pow(2).reshape(m, 4, -1).sum(-1).t().contiguous()  # 4 partial sums a row
            res = torch.randn(m, segs[0] if glu else total).to(dev, dtype)
            xd = oracle.rms_norm(x, gamma, 1e-6).double()
            outs = []
            for s, wd in enumerate(dense):
                y = xd @ wd.T + (xd @ a[s].double().T) @ b[s].double().T * 2.0
                outs.append(y if bias[s] is None else y + bias[s].double())
            ref = torch.nn.functional.silu(outs[0]) * outs[1] if glu else torch.cat(outs, 1) + res.double()
            out = torch.full(ref.shape, float("nan"), device=dev, dtype=dtype)
            t = torch.zeros(m, 64, device=dev)
            ss_out = torch.full((ref.shape[1] // 16, m), float("nan"), device=dev)
            # GLU feeds the down projection's LoRA shrink (rank 8 of a 16-wide accumulator)
            a_next, t_next = (torch.randn(8, segs[0]).to(dev, ldt), torch.zeros(m, 16, device=dev)) if glu else (None, None)
            linear.fused_linear(plan, x, out, t=t, residual=None if glu else res, norm=(gamma, 1e-6, ss),
                                shrink=a_tab, ss_out=ss_out, a_next=a_next, t_next=t_next, r_next=8 if glu else 0,
                                choice=dispatch.Choice(kind, cfg) if kind else None)
            case = (name, m, kind, cfg)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            assert err < tol, (*case, err)
            torch.testing.assert_close(ss_out.sum(0), out.float().pow(2).sum(1), rtol=1e-4, atol=1e-4)
            if glu:  # the shrink multiplies in the model dtype: A_next rounded to it
                want = out.double() @ a_next.to(dtype).double().T
                assert ((t_next[:, :8].double() - want).norm() / want.norm()).item() < 1e-4, case
                assert not t_next[:, 8:].any(), case


def _interp_main() -> None:
    patch_interpreter()
    # on the CPU every NVFP4 launch takes `_splitk_kernel` (wgmma is Gluon, which the interpreter
    # cannot run): 16-256 rows over the three shapes, with every fused term
    _check_paths("cpu", torch.float32, 2e-3, SHAPES_CPU, [[(17, None, None), (100, None, None)]] * 3)
    _check_h16()
    _check_glu_out16()
    _check_split_remainder_epilogue()
    print("MMA INTERPRETER CHECKS OK")


def _check_h16() -> None:
    # `nvfp4_wgmma`'s activations: norm_shrink writes x' / 16 in fp16, x' being what it writes without
    # h16 (RMSNorm(x) * gamma), or x itself without gamma; the shrink is the same either way. fp32 x
    # here, as the interpreter checks above (its bf16 -> fp16 cast overflows)
    torch.manual_seed(1)
    m, k = 5, 256
    x = torch.randn(m, k) * 3
    gamma = 1 + 0.1 * torch.randn(k)
    ss = x.pow(2).sum(-1)[None]
    a = torch.randn(8, k)
    a_tab = torch.tensor([a.data_ptr()], dtype=torch.int64)
    for g in (gamma, None):
        h16, h = torch.full((m, k), float("nan"), dtype=torch.float16), torch.full((m, k), float("nan"))
        t16, t = torch.zeros(m, 8), torch.zeros(m, 8)
        norm.norm_shrink(x, g, 1e-6, h16, a_tab, 1, 8, t16, ss=ss if g is not None else None, h16=True)
        norm.norm_shrink(x, g, 1e-6, h if g is not None else None, a_tab, 1, 8, t, ss=ss if g is not None else None)
        xp = h if g is not None else x
        assert torch.equal(h16, (xp / 16).half()), g
        assert torch.equal(t16, t)
        torch.testing.assert_close(xp, oracle.rms_norm(x, g, 1e-6) if g is not None else x)


def _check_glu_out16() -> None:
    # the GLU epilogue writes the down projection's `nvfp4_wgmma` operand itself (out16): exactly what
    # norm_shrink(h16) makes of the output it writes without out16, and the same next shrink. NVFP4
    # and dense (one epilogue for both), LoRA, norm on load or by a norm_shrink launch (33 rows)
    torch.manual_seed(3)
    k, n = 128, 64
    for fmt in ("nvfp4", "dense"):
        w = [torch.randn(n, k) * 0.1 for _ in range(2)]
        ws = [_nvfp4_packed(wi) for wi in w] if fmt == "nvfp4" else w
        a = [torch.randn(8, k) * 0.1 for _ in range(2)]
        plan = linear.make_plan(fmt, ws, [None, None], [torch.randn(n, 8) * 0.1 for _ in range(2)], [2.0, 2.0], 8,
                                True, torch.device("cpu"), workspace=torch.zeros(linear.SPLIT_MAX, 64, 2 * n))
        a_tab = torch.tensor([t.data_ptr() for t in a], dtype=torch.int64)
        gamma = 1 + 0.1 * torch.randn(k)
        a_next = torch.randn(8, n)
        for m in (5, 33):
            x = torch.randn(m, k) * 3
            ss = x.pow(2).sum(-1)[None]
            got = {}
            for out16 in (False, True):
                out = torch.full((m, n), float("nan"), dtype=torch.float16 if out16 else torch.float32)
                t, t_next = torch.zeros(m, 32), torch.zeros(m, 16)  # ranks padded to 16
                linear.fused_linear(plan, x, out, t=t, norm=(gamma, 1e-6, ss), shrink=a_tab, a_next=a_next,
                                    t_next=t_next, r_next=8, out16=out16)
                got[out16] = out, t_next
            (out, t_next), (out16, t_next16) = got[False], got[True]
            conv = torch.full((m, n), float("nan"), dtype=torch.float16)
            norm.norm_shrink(out, None, 0.0, conv, None, 1, 0, None, h16=True)  # the launch out16 saves
            assert not out.isnan().any() and torch.equal(out16, conv) and torch.equal(out16, (out / 16).half()), (fmt, m)
            assert torch.equal(t_next16, t_next), (fmt, m)
    # one-line errors: out16 outside GLU; x16 where the launch does not take nvfp4_wgmma (on the CPU none does)
    down = linear.make_plan("nvfp4", [_nvfp4_packed(torch.randn(128, 64))], [None], None, [0.0], 0, False,
                            torch.device("cpu"), workspace=torch.zeros(linear.SPLIT_MAX, 32, 128))
    assert not down.takes_x16(32, torch.device("cpu"))
    for kw, msg in ((dict(out16=True), "this launch is not GLU"), (dict(x16=True), "takes splitk")):
        try:
            linear.fused_linear(down, torch.randn(32, 64), torch.empty(32, 128), **kw)
        except ValueError as e:
            assert msg in str(e) and "\n" not in str(e), e
        else:
            raise AssertionError(f"{kw} was accepted")


def _check_split_remainder_epilogue() -> None:
    # `nvfp4_wgmma` splits only the columns from sk_from on (GLU: of gate and up alike): the SK
    # epilogue sums slice 0 elsewhere and never reads the other slices there (NaN here), and agrees
    # with the plain epilogue over the same slices with zeros there
    torch.manual_seed(2)
    m, n, k = 5, 256, 64
    plan = linear.make_plan("nvfp4", [_nvfp4_packed(torch.randn(n, k)) for _ in range(2)], [None, None], None,
                            [0.0, 0.0], 0, True, torch.device("cpu"), workspace=torch.zeros(8, 16, 2 * n))
    ws = torch.randn(3, m, 2 * n)
    sk_from = 128
    for half in (0, n):
        ws[1:, :, half:half + sk_from] = float("nan")
    zeroed = ws.nan_to_num(0.0)
    x = torch.randn(m, k)
    epi = linear.linear_config(m, n, k, "raw", plan.seg_gcd, True)
    outs = []
    for part, sk in ((ws, True), (zeroed, False)):
        out = torch.full((m, n), float("nan"))
        linear._epilogue(plan, x, out, None, None, None, None, 0, {**epi, "NSPLIT": 3, "SK": sk}, None, part,
                         sk_from if sk else 0)
        outs.append(out)
    assert not outs[0].isnan().any() and torch.equal(outs[0], outs[1])


@pytest.mark.slow
def test_nvfp4_paths_in_the_interpreter():
    run_interpreted(__file__, "MMA INTERPRETER CHECKS OK", 600)


@pytest.mark.skipif(linear.nvfp4_wgmma is None, reason="this Triton has no Gluon")
def test_wgmma_config_fills_whole_waves_then_splits_the_rest_and_takes_whole_128_row_tiles():
    wg = linear.nvfp4_wgmma
    # 7B down at 64 rows: 28 tiles, less than a wave: one program an SM at 128 registers -> 4 K
    # slices of 74 chunks; two an SM at 80 registers -> 9 would fit, the workspace holds 8 -> 8 of 37
    cfg = wg.config(64, 28, 296, 132, 8)
    assert (cfg["BLOCK_M"], cfg["DP"], cfg["SPLIT"], cfg["CPS"]) == (64, 0, 4, 74)
    assert (wg.config(64, 28, 296, 132, 8, dict(maxnreg=80))["SPLIT"], cfg["STAGES"]) == (8, 6)
    # gate/up (296 tiles) at 128 rows: two whole waves of 132 tiles, the 32 left split 4 ways (one
    # more wave of a quarter tile each); at 64 rows, two programs an SM: one wave, 32 left, 8 ways;
    # at 256 rows (two m blocks of 128): four waves, 32 tiles x 2 m blocks left, 2 ways
    for m, over, want in ((128, None, (264, 4, 14)), (64, dict(BLOCK_M=64, maxnreg=80), (264, 8, 7)),
                          (256, None, (264, 2, 28))):
        got = wg.config(m, 296, 56, 132, 8, over, glu=True)
        assert (got["DP"], got["SPLIT"], got["CPS"]) == want
        assert got["SK_FROM"] == 132 * 128  # gate's (and up's) columns past its 132 whole tiles
        slots = 65536 // (got["maxnreg"] * 32 * 12) * 132
        mb = -(-m // got["BLOCK_M"])
        assert got["DP"] * mb % slots == 0 and (296 - got["DP"]) * mb * got["SPLIT"] <= slots
    # GLU splits gate and up tiles alike: an odd remainder gives one more tile to the split part
    assert wg.config(128, 296, 56, 97, 8)["DP"] == 291 and wg.config(128, 296, 56, 97, 8, glu=True)["DP"] == 290
    # q/k/v at 16 rows: 36 tiles -> 3 slices; 256 rows of q/k/v in m blocks of 128, still under a
    # wave; 7 chunks of a short K are never cut below MIN_CPS; a fixed SPLIT splits every tile
    assert wg.config(16, 36, 56, 132, 8)["SPLIT"] == 3 and wg.config(16, 1, 7, 132, 8)["SPLIT"] == 1
    assert wg.config(256, 36, 56, 132, 8)["BLOCK_M"] == 128 and wg.config(256, 36, 56, 132, 8)["SPLIT"] == 1
    fixed = wg.config(128, 296, 56, 132, 8, dict(SPLIT=2))
    assert (fixed["DP"], fixed["SPLIT"], fixed["CPS"], fixed["SK_FROM"]) == (0, 2, 28, 0)
    assert wg.config(128, 296, 56, 97, 8)["SK_FROM"] == 291 * 128  # not GLU: the tiles in order
    # whole 128-row tiles of NVFP4, 16 rows and more
    plan = linear.make_plan("nvfp4", [_nvfp4_packed(torch.randn(n, 64)) for n in (256, 128)], [None, None], None,
                            [0.0, 0.0], 0, False, torch.device("cpu"), workspace=torch.zeros(8, 16, 384))
    assert wg.usable(plan, 16) and not wg.usable(plan, 8)
    assert not wg.usable(linear.make_plan("nvfp4", [_nvfp4_packed(torch.randn(48, 64))], [None], None, [0.0], 0,
                                          False, torch.device("cpu"), workspace=torch.zeros(8, 16, 48)), 64)


def test_dispatch_writes_compact_runs_and_follows_them_on_their_capability_only(tmp_path):
    wg = 'wgmma {"BLOCK_M": 64, "maxnreg": 80}'
    rows = [dict(shape="4608x3584", m=m, us=us) for m, us in
            [(4, {"small": 9.0}), (8, {"small": 9.0}), (16, {"small": 20.0, "wgmma": 21.0}),
             (64, {"small": 20.0, "wgmma": float("nan"), wg: 15.0}), (128, {"small": 60.0, wg: 40.0}),
             (256, {"small": 60.0, "wgmma": 41.0, wg: 42.0})]]
    path = tmp_path / "dispatch.json"
    written = dispatch.write_table(path, rows, {"device": "test", "capability": [9, 0], "command": "by hand"})
    assert json.loads(path.read_text()) == json.loads(json.dumps(written))
    assert written["shapes"] == {"4608x3584": [[16, "small"], [128, "wgmma", {"BLOCK_M": 64, "maxnreg": 80}],
                                               [256, "wgmma"]]}  # a NaN (failed) candidate is never chosen
    table = dispatch.load_table(path)
    hopper = (9, 0)
    assert dispatch.choose(4608, 3584, 1, hopper, table) == dispatch.Choice("small")
    assert dispatch.choose(4608, 3584, 17, hopper, table) == dispatch.Choice("wgmma", {"BLOCK_M": 64, "maxnreg": 80})
    assert dispatch.choose(4608, 3584, 4096, hopper, table) == dispatch.Choice("wgmma")  # beyond the last entry
    assert dispatch.choose(3584, 3584, 64, hopper, table).kind == "wgmma"  # nearest measured shape
    # any other GPU, and no GPU, take the decode kernels at every M: never a Hopper-only kernel
    for cap in ((8, 0), (8, 9), (10, 0), (12, 0), None):
        assert {dispatch.choose(4608, 3584, m, cap, table).kind for m in (1, 16, 64, 256)} == {"small"}, cap
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"capability": [9, 0], "shapes": {"1x1": [[4, "cutlass"]]}}))
    with pytest.raises(ValueError, match="regenerate it with"):
        dispatch.load_table(bad)


def test_the_committed_table_was_measured_on_hopper_and_names_only_kept_kernels():
    table = dispatch.load_table()
    assert table.capability == (9, 0)
    assert {c.kind for entries in table.shapes.values() for _, c in entries} == {"small", "wgmma"}


def test_fused_linear_rejects_a_kind_a_plan_cannot_take_in_one_line():
    plan = linear.make_plan("dense", [torch.randn(64, 64)], [None], None, [0.0], 0, False, torch.device("cpu"),
                            workspace=torch.zeros(linear.SPLIT_MAX, 4, 64))
    with pytest.raises(ValueError, match=r"^choice 'wgmma' takes NVFP4 only; a dense launch takes 'small'$"):
        linear.fused_linear(plan, torch.randn(2, 64), torch.empty(2, 64), choice=dispatch.Choice("wgmma"))
    nv = linear.make_plan("nvfp4", [_nvfp4_packed(torch.randn(128, 64))], [None], None, [0.0], 0, False,
                          torch.device("cpu"), workspace=torch.zeros(linear.SPLIT_MAX, 16, 128))
    with pytest.raises(ValueError, match=r"^'wgmma' takes NVFP4 launches of 16 rows or more .* not 2 rows "
                                         r"of 128 columns on cpu$"):
        linear.fused_linear(nv, torch.randn(2, 64), torch.empty(2, 128), choice=dispatch.Choice("wgmma"))
    with pytest.raises(ValueError, match=r"^unknown weight format 'int4'; valid: dense, nvfp4, nf4, mxfp4$"):
        linear.make_plan("int4", [torch.randn(64, 64)], [None], None, [0.0], 0, False, torch.device("cpu"))


@gpu
@needs_cuda
def test_gpu_nvfp4_paths_match_dequantize_matmul_on_every_7b_shape():
    tiles = [(m, kind, None) for m in ROWS for kind in ("small", "wgmma")]
    tiles += [(m, None, None) for m in (1, 8, 16, 17, 32, 64, 256)]  # as the dispatch table picks
    # two wgmma programs an SM (gate/up: a whole wave, then 8 slices of the rest), a uniform split,
    # one m block of 256 rows (and of 200 in it)
    tiles += [(64, "wgmma", dict(BLOCK_M=64, maxnreg=80)), (100, "wgmma", dict(SPLIT=2)),
              (256, "wgmma", dict(BLOCK_M=256)), (200, "wgmma", dict(BLOCK_M=256))]
    _check_paths("cuda", torch.bfloat16, 1.5e-2, SHAPES_7B, [tiles] * len(SHAPES_7B), torch.float32)


@gpu
@needs_cuda
def test_gpu_wgmma_products_are_exact_and_repeat_at_every_tile_width():
    # nvfp4_wgmma alone: fp16 products of exact weights summed in fp32, so its K slices sum to
    # x' @ W^T within fp32 rounding, bit for bit the same on every run. A wgmma reads its register
    # operand while it runs: when the next chunk's decode reused those registers, 256-row tiles
    # were off by ~50 % and differed run to run (with 128 rows the timing hid it)
    torch.manual_seed(5)
    dev = torch.device("cuda")
    sms = triton_util.sm_count(dev)
    for n, k in ((18944, 3584), (3584, 18944)):
        pw = _to(_nvfp4_packed(torch.randn(n, k) * 0.1), dev)
        wsp = torch.zeros(linear.SPLIT_MAX, 256, n, device=dev)
        plan = linear.make_plan("nvfp4", [pw], [None], None, [0.0], 0, False, dev, workspace=wsp)
        wd = pw.dequantize().to(dev, torch.float64)
        for m, tiles in ((16, dict(BLOCK_M=16, maxnreg=80)), (64, dict(BLOCK_M=64, maxnreg=80)), (128, None),
                         (256, None), (256, dict(BLOCK_M=256)), (200, dict(BLOCK_M=256, STAGES=3))):
            x16 = (torch.randn(m, k, device=dev) / 16).half()
            ref = (x16.double() * 16) @ wd.T
            runs = []
            for _ in range(3):
                wsp.fill_(float("nan"))
                split, sk_from, ws = linear.nvfp4_wgmma.launch(plan, x16, sms, tiles)
                got = ws[0].clone()
                got[:, sk_from:] += ws[1:split, :, sk_from:].sum(0)
                runs.append(got)
            err = ((runs[0].double() * plan.fsc[0, 1].double() - ref).norm() / ref.norm()).item()
            assert err < 1e-5, (n, k, m, tiles, err)
            assert all(torch.equal(runs[0], r) for r in runs[1:]), (n, k, m, tiles)


@gpu
@needs_cuda
def test_gpu_glu_launch_writes_the_operand_down_takes_with_nvfp4_wgmma():
    # 7B gate/up then down where down takes nvfp4_wgmma (the table: from 16 rows): the GLU launch's
    # out16 is what the conversion launch makes of its bf16 output, and down from it is down from that
    torch.manual_seed(4)
    dev, k, n = torch.device("cuda"), 3584, 18944
    wsp = torch.full((linear.SPLIT_MAX, max(ROWS), 2 * n), float("nan"), device=dev)
    lora = [(torch.randn(n2, 8) * 0.1).to(dev) for n2 in (n, n, k)]
    glu = linear.make_plan("nvfp4", [_to(_nvfp4_packed(torch.randn(n, k) * 0.1), dev) for _ in range(2)],
                           [None, None], lora[:2], [2.0, 2.0], 8, True, dev, workspace=wsp)
    down = linear.make_plan("nvfp4", [_to(_nvfp4_packed(torch.randn(k, n) * 0.1), dev)], [None], lora[2:], [2.0], 8,
                            False, dev, workspace=wsp)
    gamma = (1 + 0.1 * torch.randn(k)).to(dev, torch.bfloat16)
    a_next = (torch.randn(8, n) * 0.1).to(dev)
    for m in ROWS:
        assert down.takes_x16(m, dev), m
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ss = x.float().pow(2).sum(-1)[None]
        t = torch.randn(m, 32, device=dev) * 0.1  # given, not shrunk here: no atomics, both runs alike
        inter, inter16 = (torch.full((m, n), float("nan"), device=dev, dtype=d) for d in (torch.bfloat16, torch.float16))
        t_next = torch.zeros(m, 16, device=dev)
        for out, out16 in ((inter, False), (inter16, True)):
            linear.fused_linear(glu, x, out, t=t, norm=(gamma, 1e-6, ss), a_next=a_next, t_next=t_next, r_next=8,
                                out16=out16)
        assert torch.equal(inter16, (inter.float() / 16).half()), m
        res = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        outs = []
        for xin, x16 in ((inter, False), (inter16, True)):
            out = torch.full((m, k), float("nan"), device=dev, dtype=torch.bfloat16)
            linear.fused_linear(down, xin, out, t=t_next, residual=res, x16=x16)
            outs.append(out)
        assert not outs[0].isnan().any() and torch.equal(outs[0], outs[1]), m


@gpu
@needs_cuda
def test_gpu_nvfp4_engine_on_wgmma_batches_matches_hf_generate(monkeypatch):
    # 32 sequences with every NVFP4 launch on nvfp4_wgmma (a table of one wgmma entry: this model's
    # shapes take the nearest measured shape's choice, and where dispatch.json's candidates tie a
    # sweep may pick another kind; q/k/v's 64-row segments still take the small kernel), and the GLU
    # epilogue writes down's fp16 operand
    table = dispatch.Table(triton_util.capability(torch.device("cuda")), {"3584x3584": [(256, dispatch.Choice("wgmma"))]})
    monkeypatch.setattr(dispatch, "load_table", lambda path=dispatch.TABLE_PATH: table)
    model = tiny_model(torch.bfloat16, "cuda", quant="nvfp4", layers=2, hidden=256, inter=512, heads=8, kv=2,
                       vocab=512)
    ids, mask = prompts(b=32, p=9, vocab=512, device="cuda")
    eng = FastEngine(model, 32, 64)
    out = eng.generate(ids, mask, 16, temperature=0, eos_id=-1, pad_id=0)
    ly = eng.m.layers[0]
    assert all(lin.plan.takes_x16(32, ids.device) for lin in (ly.o, ly.gate_up, ly.down))
    assert not ly.qkv.plan.takes_x16(32, ids.device)
    assert_greedy_like_hf(model, ids, mask, out.completion_ids, hf_greedy(model, ids, mask, 16), tol=0.08)


if __name__ == "__main__" and "--interp" in sys.argv:
    _interp_main()
