# temporary: per-SM throughput of the decode's instructions on this GPU (ratios against LOP3)
import torch, triton, triton.language as tl

OPS = {
    "lop3": "lop3.b32 {r}, {r}, 0x5a5a5a5a, 0x33333333, 0x96;",
    "shf": "shf.l.wrap.b32 {r}, {r}, {r}, 3;",
    "hmul2": "mul.rn.f16x2 {r}, {r}, kk;",
    "f2fp_e4m3": "{{ .reg .b16 l, h; mov.b32 {{l, h}}, {r}; cvt.rn.f16x2.e4m3x2 {r}, l; }}",
    "f2fp_pack": "{{ .reg .b16 l, h; mov.b32 {{l, h}}, {r}; cvt.rn.f16x2.f32 {r}, {r}, {r}; }}",
    "prmt": "prmt.b32 {r}, {r}, 0x12345678, {r};",
}


def asm(op, chains=8, unroll=16):
    regs = [f"c{i}" for i in range(chains)]
    s = "{ .reg .b32 kk, " + ", ".join(regs) + ";\nmov.b32 kk, 0x3c013c01;\n"
    for i, r in enumerate(regs):
        s += f"add.u32 {r}, $1, {i * 0x01010101};\n"
    for _ in range(unroll):
        for r in regs:
            s += OPS[op].format(r=r) + "\n"
    s += "mov.b32 $0, c0;\n"
    for r in regs[1:]:
        s += f"xor.b32 $0, $0, {r};\n"
    return s + "}"


@triton.jit
def kern(x_ptr, o_ptr, ITERS: tl.constexpr, A: tl.constexpr):
    off = tl.program_id(0) * 256 + tl.arange(0, 256)
    v = tl.load(x_ptr + off)
    for _ in range(ITERS):
        v = tl.inline_asm_elementwise(A, "=r,r", [v], dtype=tl.int32, is_pure=True, pack=1)
    tl.store(o_ptr + off, v)


def make(op):
    A = asm(op)
    return lambda grid: (lambda *a, **kw: kern[grid](*a, A=A, **kw))


if __name__ == "__main__":
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = sms * 8
    x = torch.randint(0, 2**31 - 1, (grid * 256,), device="cuda", dtype=torch.int32)
    o = torch.empty_like(x)
    ITERS = 200
    res = {}
    for op in OPS:
        k = make(op)
        k((grid,))(x, o, ITERS=ITERS, num_warps=8)
        torch.cuda.synchronize()
        ts = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); k((grid,))(x, o, ITERS=ITERS, num_warps=8); b.record(); torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) * 1e-3)
        n = grid * 256 * ITERS * 8 * 16
        res[op] = n / min(ts) / sms / 1e9
        print(f"{op:10s} {res[op]:8.1f} G thread-ops/s per SM  ({res[op] / res['lop3']:.2f}x lop3)", flush=True)
