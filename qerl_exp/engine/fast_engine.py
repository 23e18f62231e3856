"""`FastEngine`: owns the static KV cache, the per-batch buffers and the captured CUDA graphs of the
decode step (`qerl_exp.engine.decode` holds the free functions it runs), and `generate`.

Sized by its constructor and grown by a larger call; `release()` gives the cache and graph memory
back between rollouts (the learner reuses it) and the next `generate` makes them again.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from qerl_exp.decoders import blocks
from qerl_exp.engine.decode import (MAX_EOS, PREFILL_GRAPHS, GenerateOutput, Cache, State, build_model, decode_n_tokens,
                                    decode_one_token, frozen, refresh, same_layout, sample_next, setup_caches)
from qerl_exp.engine.linear import SPLIT_MAX, make_plan
from qerl_exp.engine.prefill import prefill, share_prompts
from qerl_exp.engine.sampling import Filters
from qerl_exp.engine.triton_util import pow2, require_device
from qerl_exp.quant.layout import KernelWeight

# dense_gemm="auto": cuBLAS computes dense base products from this many rows, where its one GEMM
# over a group's stacked weights (`blocks.stack_dense`) overtakes the Triton split-K kernel in a 7B
# rollout (`python -m bench.rollout`; the measured crossover is in docs/engine.md).
DENSE_CUBLAS_MIN_BATCH = 32


class FastEngine:
    """Rollout engine over an HF causal LM of a declared architecture (`qerl_exp.decoders.blocks`: Llama,
    Qwen2, Qwen3; dense, NVFP4/MXFP4 `FP4Linear` or NF4 bases, optionally peft LoRA), with the
    decode step in a CUDA graph. Its kernels run on CUDA, and on
    CPU only under the Triton interpreter (the tests).

    Args:
        model: the HF causal LM (or a peft model around it). Its frozen tensors are referenced, not
            copied; LoRA and norm scales are copied at every `generate` (`decode.refresh`).
        max_batch_size: most sequences per `generate` call (the KV cache is sized for it).
        max_seq_len: most prompt + new tokens per sequence.
        cuda_graph: capture the decode step (CUDA only).
        dense_gemm: dense (bf16) weights: "triton" (split-K Triton kernel), "cublas" (cuBLAS into a
            buffer; both finish with the Triton epilogue: bias, LoRA, residual, GLU), or "auto":
            cuBLAS from `DENSE_CUBLAS_MIN_BATCH` rows of `max_batch_size`, Triton below.

    Example:
        >>> engine = FastEngine(model, max_batch_size=64, max_seq_len=512)
        >>> out = engine.generate(ids, mask, 256, temperature=1.0, eos_id=tok.eos_token_id,
        ...                       pad_id=tok.pad_token_id)
        >>> out.completion_ids.shape  # [64, T], T <= 256
    """

    def __init__(self, model: nn.Module, max_batch_size: int, max_seq_len: int, *, cuda_graph: bool = True,
                 dense_gemm: str = "auto"):
        self.model = model
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.seq_cap = -(-max_seq_len // 64) * 64  # cache length, aligned for the attention kernels
        dev = next(model.parameters()).device
        self.use_graph = cuda_graph and dev.type == "cuda"
        if dense_gemm not in ("auto", "cublas", "triton"):
            raise ValueError(f"dense_gemm={dense_gemm!r} is not valid; choose one of: auto, cublas, triton")
        if dense_gemm == "auto":
            dense_gemm = "cublas" if max_batch_size >= DENSE_CUBLAS_MIN_BATCH else "triton"
        self.dense_gemm = dense_gemm
        self.cache: Cache | None = None
        self.build_s = 0.0
        self.capture_s = 0.0
        self._build()

    def _build(self) -> None:
        t0 = time.perf_counter()
        with torch.no_grad():
            self.m = build_model(blocks.read(self.model), self.seq_cap)
            dev = self.m.embed.device
            widest = max(sum(w.n if isinstance(w, KernelWeight) else w.shape[0] for w in lin.weights)
                         for ly in self.m.layers for lin in (ly.qkv, ly.o, ly.gate_up, ly.down))
            ws = torch.zeros(SPLIT_MAX, self.max_batch_size, widest, dtype=torch.float32, device=dev)
            raw: dict = {}  # cuBLAS output buffers, shared by all layers: [B_max, n] per (group, n)
            for ly in self.m.layers:
                for kind, lin in enumerate((ly.qkv, ly.o, ly.gate_up, ly.down)):
                    cublas = None
                    if lin.fmt == "dense" and self.dense_gemm == "cublas":
                        w = lin.stacked
                        cublas = (w, raw.setdefault((kind, w.shape[0]), torch.empty(
                            self.max_batch_size, w.shape[0], dtype=w.dtype, device=dev)))
                    lin.plan = make_plan(lin.fmt, lin.weights, lin.biases, lin.lora_b, lin.scale,
                                         lin.r, lin.glu, dev, cublas=cublas, workspace=ws)
                    if lin.lora_a is not None:
                        lin.a_tab = torch.tensor([a.data_ptr() for a in lin.lora_a], dtype=torch.int64, device=dev)
            self.cache = setup_caches(self.m, self.max_batch_size, self.seq_cap, self.cache)
            nvfp4 = [w for ly in self.m.layers for lin in (ly.qkv, ly.o, ly.gate_up, ly.down) for w in lin.weights
                      if isinstance(w, KernelWeight) and w.fmt == "nvfp4" and dev.type == "cuda"]
            self.scratch = torch.empty(max(w.n * w.k for w in nvfp4), dtype=self.m.embed.dtype, device=dev) \
                if nvfp4 else None
        self._refs = [(t, t.data_ptr()) for t in frozen(self.m)]
        self._states: dict[int, State] = {}
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._prefills: dict[tuple, tuple] = {}  # (B, P) -> (graph, its ids, mask and logits buffers)
        self._prefill_seen: set = set()
        self._pool = None
        if dev.type == "cuda":
            torch.cuda.synchronize()
        self.build_s = time.perf_counter() - t0

    @property
    def nbytes(self) -> int:
        """Device bytes the engine holds beyond the model's own tensors: the KV cache, per-batch
        buffers, workspaces, and the NF4 weights it laid out again."""
        tensors = ([self.cache.k, self.cache.v] if self.cache is not None else []) + \
            ([self.scratch] if self.scratch is not None else [])
        for ly in self.m.layers:
            for lin in (ly.qkv, ly.o, ly.gate_up, ly.down):
                tensors += [w for w in lin.weights if isinstance(w, KernelWeight) and w.fmt == "nf4"]
                if lin.plan is not None and lin.plan.workspace is not None:
                    tensors.append(lin.plan.workspace)
        for st in self._states.values():
            tensors += [v for v in vars(st).values() if isinstance(v, Tensor)]
        seen, total = set(), 0
        for t in tensors:
            key = (t.codes.data_ptr(), t.scales.data_ptr()) if isinstance(t, KernelWeight) else t.data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.nbytes if isinstance(t, KernelWeight) else t.numel() * t.element_size()
        return total

    def _rt(self) -> int:
        rt = 16
        for ly in self.m.layers:
            for lin, nseg in ((ly.qkv, 3), (ly.o, 1), (ly.gate_up, 2), (ly.down, 1)):
                rt = max(rt, pow2(nseg * pow2(lin.r)))
        return rt

    def _state(self, b: int) -> State:
        if b not in self._states:
            self._states[b] = State(self.m, b, self.seq_cap, self._rt())
        return self._states[b]

    def _step_fn(self, st: State, greedy: bool, filters: Filters):
        return lambda: decode_one_token(self.m, self.cache, st, greedy, filters)

    def _capture(self, fn, reset, warmups: int):
        """(CUDA graph of `fn()` in the engine's memory pool, what the captured call returned), after
        `warmups` runs on a side stream (Triton compilation, cuBLAS workspaces); `reset()` runs before
        each of them and before the capture, outside the graph."""
        t0 = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmups):
                reset()
                fn()
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        reset()
        with torch.cuda.graph(g, pool=self._pool):
            out = fn()
        torch.cuda.synchronize()
        self.capture_s += time.perf_counter() - t0
        return g, out

    def _graph(self, st: State, greedy: bool, filters: Filters):
        key = (st.b, greedy, filters)
        if key not in self._graphs:
            def reset():
                st.slot.zero_()
                st.step.zero_()

            self._graphs[key], _ = self._capture(self._step_fn(st, greedy, filters), reset, warmups=2)
        return self._graphs[key]

    def _prefill(self, ids: Tensor, mask: Tensor, group: int) -> Tensor:
        """`prefill()` of one row a group (`share_prompts` gives its cache slots to the group's other
        rows), replayed from a CUDA graph when a (batch, prompt length, group) comes back: run
        eagerly it is bound by launching ~90 small ops a layer. A shape is captured on its second
        call (one seen once costs no capture), at most `PREFILL_GRAPHS` of them; the others run
        eagerly."""
        key = (*ids.shape, group)

        def run(ids, mask):
            logits = prefill(self.m, self.cache, ids[::group], mask[::group], self.scratch)
            if group == 1:
                return logits
            share_prompts(self.cache, ids.shape[0] // group, group, ids.shape[1])
            return logits.repeat_interleave(group, 0)

        if not self.use_graph:
            return run(ids, mask)
        if key not in self._prefills:
            if key not in self._prefill_seen or len(self._prefills) >= PREFILL_GRAPHS:
                self._prefill_seen.add(key)
                return run(ids, mask)
            bufs = ids.clone(), mask.clone()
            g, logits = self._capture(lambda: run(*bufs), lambda: None, warmups=1)
            self._prefills[key] = (g, *bufs, logits)
        g, ids_buf, mask_buf, logits = self._prefills[key]
        ids_buf.copy_(ids)
        mask_buf.copy_(mask)
        g.replay()
        return logits

    def release(self) -> None:
        """Free the KV cache, the per-batch buffers and the captured graphs (their memory goes back
        to torch's allocator, e.g. for the learner); the next `generate` makes them again."""
        self.cache = None
        self._states.clear()
        self._graphs.clear()
        self._prefills.clear()
        self._prefill_seen.clear()
        self._pool = None

    def _check_refs(self, dec: blocks.Decoder) -> None:
        """Rebuild when a frozen tensor the engine reads was re-allocated, a projection replaced or
        its adapters changed shape in `dec` (the model read now); re-read the tensor scales of FP4
        layers re-quantized in place (`FP4Linear.requantize_`)."""
        if any(t.data_ptr() != p for t, p in self._refs) or not same_layout(self.m, dec):
            warnings.warn("FastEngine: a model tensor was re-allocated or a layer replaced (not updated in "
                          "place); rebuilding the engine and its CUDA graphs", stacklevel=3)
            self._build()
            return
        rescaled = False
        for lin in (lin for ly in self.m.layers for lin in (ly.qkv, ly.o, ly.gate_up, ly.down)):
            for s, src in enumerate(lin.bases):
                if lin.updates[s] is None or src.updates == lin.updates[s]:
                    continue
                pw = src.runtime_weight()
                if pw.codes is not lin.weights[s].codes:  # the engine holds a converted copy (CPU)
                    self._build()
                    return
                lin.weights[s], lin.updates[s] = pw, src.updates
                lin.plan.set_out_scale(s, pw.out_scale)
                rescaled = True
        if rescaled:  # the prefill's graphs baked the tensor scale into its dequantize launches:
            self._prefills.clear()  # captured again on next use

    @torch.no_grad()
    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, eos_id: int | Sequence[int], pad_id: int,
                 generator: torch.Generator | None = None, group: int = 1) -> GenerateOutput:
        """Sample completions for left-padded prompts.

        Args:
            prompt_ids: long [B, P], left-padded. prompt_mask: [B, P], 1 on real tokens.
            max_new_tokens: most tokens sampled per sequence.
            temperature: softmax temperature; 0 means greedy.
            top_p: nucleus filter (HF semantics); 1 disables it.
            top_k: sample among the k most likely tokens (HF semantics); 0 disables it.
            min_p: drop tokens less likely than min_p times the most likely (HF semantics); 0 disables it.
            eos_id: a sequence stops after emitting it, or any of several (at most `MAX_EOS`; EOS
                kept in the completion); -1 or none: no token stops one.
            pad_id: fills completions after their EOS.
            generator: makes sampling reproducible: `fused_sample`'s seed is drawn from it, and on
                CUDA it seeds the graph's RNG for the call (the torch sampler's, under top-p) and
                restores the global CUDA RNG state afterwards.
            group: the rows come in groups of `group` adjacent rows with one prompt (GRPO's
                completions of a prompt): the prefill runs once a group. Rows of a group that
                differ stop the call with a ValueError.

        Returns:
            `GenerateOutput` with T = the longest completion (at most max_new_tokens).
        """
        require_device(self.m.embed.device)
        b, p = prompt_ids.shape
        self._fit(b, p, max_new_tokens, group)
        dec = blocks.read(self.model)
        self._check_refs(dec)
        refresh(self.m, dec)
        if self.cache is None:  # after release()
            self.cache = setup_caches(self.m, self.max_batch_size, self.seq_cap)
        dev = self.m.embed.device
        ids, mask = prompt_ids.to(dev), prompt_mask.to(dev)
        if group > 1 and not bool(((ids.view(b // group, group, p) == ids[::group, None])  # one host sync
                                   & (mask.view(b // group, group, p) == mask[::group, None])).all()):
            raise ValueError(f"generate(group={group}): the rows of a group must share one prompt (ids and mask)")
        eos = [eos_id] if isinstance(eos_id, int) else list(eos_id)
        if len(eos) > MAX_EOS:
            raise ValueError(f"generate takes at most {MAX_EOS} EOS ids, got {len(eos)}")
        greedy = temperature <= 0
        filters = Filters() if greedy else Filters(top_p=top_p < 1.0, top_k=top_k, min_p=min_p > 0)
        st = self._state(b)
        graph = self._graph(st, greedy, filters) if self.use_graph else None
        rng = self._seed(st, generator, dev)
        try:
            st.temperature.fill_(temperature if not greedy else 1.0)
            st.top_p.fill_(top_p)
            st.min_p.fill_(min_p)
            st.eos.copy_(torch.tensor(eos + [-1] * (MAX_EOS - len(eos)), device=dev))
            st.pad_id.fill_(pad_id)
            st.done.zero_()
            st.step.zero_()
            logits = self._prefill(ids, mask, group)
            st.pad.copy_(p - mask.long().sum(1))
            st.slot.fill_(p - 1)  # _advance moves both to the first sampled token's slot / position
            st.pos.copy_(p - 1 - st.pad)
            sample_next(st, logits, greedy, filters)
            step = graph.replay if graph is not None else self._step_fn(st, greedy, filters)
            n = 1 + decode_n_tokens(step, st, max_new_tokens - 1)
        finally:
            if rng is not None:
                torch.cuda.set_rng_state(rng, dev)
        t = max(1, int(st.out_mask[:, :n].sum(1).max()))
        return GenerateOutput(
            completion_ids=st.out_tok[:, :t].clone(),
            completion_mask=st.out_mask[:, :t].clone(),
            logprobs=st.out_lp[:, :t].clone(),
            entropy=st.out_ent[:, :t].clone(),
        )

    def _fit(self, b: int, p: int, max_new_tokens: int, group: int) -> None:
        """Check `generate`'s batch of `b` rows of `p` prompt tokens against `group`, and grow the
        engine to what the call needs (KV cache, buffers and graphs are made anew)."""
        if group < 1 or b % group:
            raise ValueError(f"generate(group={group}) needs a positive group that divides the batch of {b} rows")
        if b > self.max_batch_size or p + max_new_tokens > self.max_seq_len:
            self.max_batch_size = max(b, self.max_batch_size)
            self.max_seq_len = max(p + max_new_tokens, self.max_seq_len)
            self.seq_cap = -(-self.max_seq_len // 64) * 64
            self.cache = None
            self._build()

    @staticmethod
    def _seed(st, generator: torch.Generator | None, dev: torch.device) -> Tensor | None:
        """Seed the call's sampling: `fused_sample`'s key, and on CUDA the graph's RNG, from
        `generator` (else the key from the device's RNG, no host sync). Returns the global CUDA RNG
        state to restore after the call, or None."""
        rng = None
        if generator is not None:
            seed = int(torch.randint(0, 2**62, (1,), generator=generator))
            st.seed.fill_(seed)
            if dev.type == "cuda":
                rng = torch.cuda.get_rng_state(dev)
                torch.cuda.manual_seed(seed)
        else:
            st.seed.random_(0, 2**62)
        st.generator = generator if dev.type != "cuda" else None
        return rng
