"""Inline PTX for the 4-bit decode: what Triton and Gluon cannot say with their own ops.

The E2M1 bytes of the kernel layout (`layout`) are bit-permuted so that each nibble becomes an FP8
E4M3 number with one mask; Hopper's `cvt.rn.f16x2.e4m3x2` then turns two of them into an fp16 pair
in one instruction. `triton_kernels` (NVFP4 chunks of `_splitk_kernel` and the dequantize kernel)
and `nvfp4_mma` (the mma.sync kernel) embed the string with `inline_asm_elementwise`.
"""

from __future__ import annotations


def e2m1x4_asm(code: int, scale: int, scale_word: bool = False) -> str:
    """Inline PTX: four permuted E2M1 bytes (operand $code) -> eight fp16, low elements $0 $1 and
    high ones $2 $3, each times its block scale: fp16 pairs in $scale .. $scale + 3, or with
    `scale_word` one int32 $scale of four E4M3 scales (the layout's scale entry: the low elements'
    scale for $0 and for $1, then the high ones' for $2 and $3). Bit masks, then Hopper's
    e4m3x2 -> f16x2 conversion."""
    if scale_word:
        scales = f"""
    .reg .b32 slo, shi, s0, s1, s2, s3;
    .reg .b16 w0, w1, u0, u1, v0, v1;
    mov.b32 {{w0, w1}}, ${scale};
    cvt.rn.f16x2.e4m3x2 slo, w0;
    cvt.rn.f16x2.e4m3x2 shi, w1;
    mov.b32 {{u0, u1}}, slo;
    mov.b32 {{v0, v1}}, shi;
    mov.b32 s0, {{u0, u0}};
    mov.b32 s1, {{u1, u1}};
    mov.b32 s2, {{v0, v0}};
    mov.b32 s3, {{v1, v1}};"""
        s = ["s0", "s1", "s2", "s3"]
    else:
        scales = ""
        s = [f"${scale + i}" for i in range(4)]
    return f"""
    {{
    .reg .b32 lo, hi, t;
    .reg .b16 l0, l1, h0, h1;
    and.b32 lo, ${code}, 0x9C9C9C9C;
    shl.b32 t, ${code}, 2;
    and.b32 hi, t, 0x8C8C8C8C;
    shr.b32 t, ${code}, 2;
    and.b32 t, t, 0x10101010;
    or.b32 hi, hi, t;
    mov.b32 {{l0, l1}}, lo;
    mov.b32 {{h0, h1}}, hi;{scales}
    cvt.rn.f16x2.e4m3x2 $0, l0;
    cvt.rn.f16x2.e4m3x2 $1, l1;
    cvt.rn.f16x2.e4m3x2 $2, h0;
    cvt.rn.f16x2.e4m3x2 $3, h1;
    mul.rn.f16x2 $0, $0, {s[0]};
    mul.rn.f16x2 $1, $1, {s[1]};
    mul.rn.f16x2 $2, $2, {s[2]};
    mul.rn.f16x2 $3, $3, {s[3]};
    }}
    """
