"""Inline PTX for the 4-bit decode: what Triton and Gluon cannot say with their own ops.

The E2M1 bytes of the kernel layout (`layout`) are bit-permuted so that each nibble becomes an FP8
E4M3 number with one mask; Hopper's `cvt.rn.f16x2.e4m3x2` then turns two of them into an fp16 pair
in one instruction. `fp4_decode` (NVFP4 chunks of the engine's `_splitk_kernel` and the dequantize kernel),
`nvfp4_mma` (the mma.sync kernel) and `nvfp4_wgmma` (one half of a chunk at a time) embed the
strings with `inline_asm_elementwise`.
"""

from __future__ import annotations


# the E4M3 bits of a byte's low (lo) and high (hi) E2M1 element, from the permuted byte in $code
_BITS = {
    "lo": ["and.b32 lo, $code, 0x9C9C9C9C;"],
    "hi": ["shl.b32 t, $code, 2;", "and.b32 hi, t, 0x8C8C8C8C;", "shr.b32 t, $code, 2;", "and.b32 t, t, 0x10101010;",
           "or.b32 hi, hi, t;"],
}


def _decode(halves: list[str], code: int, scales: list[str], prologue: str = "") -> str:
    # half h of the list -> fp16 pairs $(2 h) and $(2 h + 1), times the fp16 pairs scales[2 h], [2 h + 1]
    lines = [ln for h in halves for ln in _BITS[h]]
    for h in halves:
        lines.append(f"mov.b32 {{{h}0, {h}1}}, {h};")
    for i, (h, j) in enumerate((h, j) for h in halves for j in (0, 1)):
        lines.append(f"cvt.rn.f16x2.e4m3x2 ${i}, {h}{j};")
    for i in range(2 * len(halves)):
        lines.append(f"mul.rn.f16x2 ${i}, ${i}, {scales[i]};")
    body = "\n    ".join(ln.replace("$code", f"${code}") for ln in lines)
    return f"""
    {{
    .reg .b32 lo, hi, t;
    .reg .b16 lo0, lo1, hi0, hi1;{prologue}
    {body}
    }}
    """


def _scale_word(word: int, halves: list[str]) -> tuple[str, list[str]]:
    # one int32 of four E4M3 scales (the low elements' two, then the high ones') -> fp16 pairs
    # (each scale twice), for the halves decoded
    pro = f"""
    .reg .b32 sc, f0, f1, f2, f3;
    .reg .b16 w0, w1, u0, u1;
    mov.b32 {{w0, w1}}, ${word};"""
    names = []
    for h in halves:
        w = "w0" if h == "lo" else "w1"
        a, b = f"f{len(names)}", f"f{len(names) + 1}"
        pro += f"""
    cvt.rn.f16x2.e4m3x2 sc, {w};
    mov.b32 {{u0, u1}}, sc;
    mov.b32 {a}, {{u0, u0}};
    mov.b32 {b}, {{u1, u1}};"""
        names += [a, b]
    return pro, names


def e2m1x4_asm(code: int, scale: int, scale_word: bool = False) -> str:
    """Inline PTX: four permuted E2M1 bytes (operand $code) -> eight fp16, low elements $0 $1 and
    high ones $2 $3, each times its block scale: fp16 pairs in $scale .. $scale + 3, or with
    `scale_word` one int32 $scale of four E4M3 scales (the layout's scale entry: the low elements'
    scale for $0 and for $1, then the high ones' for $2 and $3). Bit masks, then Hopper's
    e4m3x2 -> f16x2 conversion."""
    halves = ["lo", "hi"]
    if scale_word:
        pro, names = _scale_word(scale, halves)
        return _decode(halves, code, names, pro)
    return _decode(halves, code, [f"${scale + i}" for i in range(4)])


def e2m1x2_asm(half: str, code: int, word: int) -> str:
    """Inline PTX: one half of `e2m1x4_asm(code, word, scale_word=True)`, the low ("lo") or high
    ("hi") element of each of four permuted E2M1 bytes -> four fp16 in $0 $1. The wgmma kernel
    decodes a chunk's halves one at a time, so each half's registers can be reused as soon as the
    wgmma that reads them retires."""
    pro, names = _scale_word(word, [half])
    return _decode([half], code, names, pro)
