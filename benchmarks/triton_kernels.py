#!/usr/bin/env python
"""The Triton provider's kernels on a GPU against the GPU's own copy bandwidth.

Needs only torch and triton (no vLLM): run it where the kernels run::

    python benchmarks/triton_kernels.py [--json benchmarks/results/triton_<gpu>.json]

It measures device-to-device copy bandwidth first (``torch`` copy of a 1 GiB
buffer: bytes read + written per second), then times each kernel with
``triton.testing.do_bench`` (attention: median, L2 flushed between calls) or from
a CUDA graph cycling through enough weight copies that none is L2-resident (GEMMs:
no host launch overhead, as a server replaying decode graphs sees) and prints time, bytes moved per second, % of the copy bandwidth and the speedup over a
torch reference of the same op on the same GPU:

* paged decode attention, batch 64, context 2048, 32 query / 8 KV heads, head
  128, block 64, bf16 and INT8 KV; reference: gather the pages + SDPA;
* W4A16 (group 128, symmetric) at batch 1, 16, 64 for 4096x4096, 4096->14336,
  14336->4096; reference: dequantize the weight + matmul;
* W8A8 (per-token dynamic) at batch 64 and 512; reference: dequantize + matmul,
  and ``torch._int_mm`` with the same quantization;
* MLA absorbed decode (DeepSeek-V3's 128 heads, latent 512 + rope 64, block 64) at
  batch 1 x context 8192 and batch 64 x 2048; reference: gather the latent rows + the
  same two matmuls and softmax in torch;
* fused MoE experts, Qwen3-30B-A3B's layer (128 experts, top-8, hidden 2048,
  intermediate 768, bf16) at batch 1, 16, 64; reference: the ``torch_fast`` experts
  (tokens sorted by expert, two matmuls per expert, one host sync); also replayed from
  a CUDA graph (the routing's alignment is a dozen small torch ops whose launches
  dominate at batch 1 when run eagerly);
* the same layer with W4A16 experts (4-bit, group 128), against its bf16 experts;
* sliding-window decode (window 1024, batch 16) at contexts 1k, 4k and 16k: the time
  per step should stay at the 1k time; reference: the same kernel over the whole
  context.

Bytes counted are the ones the op must move: the KV cache pages (MLA: latent rows)
read (+ query and output), the packed weight + scales + activations + output, the
weights of the experts a MoE step touches (counted per step and printed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vllm_accel.ops.torch_fast import moe as torch_moe  # noqa: E402
from vllm_accel.ops.triton import int8_gemm, mla, moe, paged_attention, wint_gemm  # noqa: E402

DEV = "cuda"


def copy_bandwidth() -> float:
    """Device-to-device copy: bytes read + written per second."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=10, rep=200)
    return 2 * src.numel() / (ms * 1e-3)


#: bytes of distinct weights a GEMM timing cycles through (H100's L2 is 50 MB)
ROTATE_BYTES = 512 << 20


def stream_time(fns) -> float:
    """ms per call of ``fns`` (each reading its own copy of the data) replayed from a
    CUDA graph: no host launch overhead (a server replays decode steps from graphs),
    and data that cannot be in L2 (the copies together exceed it)."""
    def run_all():
        for fn in fns:
            fn()
    return do_bench_cudagraph(run_all, rep=50) / len(fns)


def copies(nbytes: int) -> int:
    return max(1, min(64, -(-ROTATE_BYTES // nbytes)))


def graph_time(fn):
    """ms per call replayed from a CUDA graph (no host launch gaps), or None where the
    op cannot be captured."""
    try:
        return do_bench_cudagraph(fn, rep=100)
    except Exception as exc:  # noqa: BLE001 -- reported, the eager time stands
        print(f"  (not capturable in a CUDA graph: {type(exc).__name__}: {exc})")
        return None


def with_graph_time(r, fn, nbytes, bandwidth):
    """Add the graph-replayed time (what a server replaying decode graphs sees)."""
    ms = graph_time(fn)
    r["graph_us"] = None if ms is None else round(ms * 1e3, 2)
    if ms is not None:
        r["graph_pct_of_copy_bw"] = round(100 * nbytes / (ms * 1e-3) / bandwidth, 1)
        print(f"  graph-replayed {r['graph_us']:.1f} us, {r['graph_pct_of_copy_bw']}%")
    return r


def row(name, ms, nbytes, bandwidth, ref_ms=None, ref_name=None):
    achieved = nbytes / (ms * 1e-3)
    r = {"kernel": name, "us": round(ms * 1e3, 2), "GB/s": round(achieved / 1e9, 1),
         "pct_of_copy_bw": round(100 * achieved / bandwidth, 1)}
    if ref_ms is not None:
        r.update({"reference": ref_name, "reference_us": round(ref_ms * 1e3, 2),
                  "speedup": round(ref_ms / ms, 2)})
    print(f"{name:48s} {r['us']:9.1f} us {r['GB/s']:8.1f} GB/s {r['pct_of_copy_bw']:6.1f}%"
          + (f"  ref {r['reference_us']:9.1f} us  x{r['speedup']:.2f}" if ref_ms else ""))
    return r


# ---------------------------------------------------------------------------
# Paged decode attention
# ---------------------------------------------------------------------------


def decode_case(batch=64, context=2048, heads=32, kv_heads=8, head=128, bs=64, int8=False):
    g = torch.Generator(device=DEV).manual_seed(0)
    blocks_per_req = context // bs
    num_blocks = batch * blocks_per_req
    width = 2 * head + 8 if int8 else 2 * head
    if int8:
        cache = torch.randint(-127, 128, (kv_heads, num_blocks, bs, width), dtype=torch.int8,
                              device=DEV, generator=g)
        pages = cache.view(kv_heads * num_blocks, bs * width)
        pages[:, 2 * bs * head:].view(torch.float32).uniform_(0.005, 0.02, generator=g)
    else:
        cache = torch.randn(kv_heads, num_blocks, bs, width, dtype=torch.bfloat16, device=DEV,
                            generator=g)
    cache = cache.transpose(0, 1)  # LHBNC: head-major pages
    block_table = torch.randperm(num_blocks, device=DEV, generator=g).to(torch.int32)
    block_table = block_table.view(batch, blocks_per_req)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEV)
    query = torch.randn(batch, heads, head, dtype=torch.bfloat16, device=DEV, generator=g)
    kv_bytes = batch * context * kv_heads * (2 * head + (8 if int8 else 0)) * (1 if int8 else 2)
    return query, cache, block_table, seq_lens, kv_bytes + 2 * query.numel() * 2


def gather_sdpa(query, cache, block_table, seq_lens, scale):
    """Torch reference: gather every request's pages into K/V, then SDPA (GQA)."""
    b, h, d = query.shape
    hkv, bs = cache.shape[1], cache.shape[2]
    pages = cache[block_table.long()]  # [B, nblk, Hkv, BS, W]
    if cache.dtype == torch.int8:
        flat = pages.reshape(*pages.shape[:3], -1)
        k = flat[..., : bs * d].reshape(*pages.shape[:3], bs, d).to(query.dtype)
        v = flat[..., bs * d: 2 * bs * d].reshape(*pages.shape[:3], bs, d).to(query.dtype)
        sc = flat[..., 2 * bs * d:].contiguous().view(torch.float32).reshape(
            *pages.shape[:3], bs, 2).to(query.dtype)
        k, v = k * sc[..., :1], v * sc[..., 1:]
    else:
        k, v = pages.reshape(*pages.shape[:3], 2, bs, d).unbind(3)
    k = k.permute(0, 2, 1, 3, 4).reshape(b, hkv, -1, d)
    v = v.permute(0, 2, 1, 3, 4).reshape(b, hkv, -1, d)
    o = F.scaled_dot_product_attention(query[:, :, None], k, v, scale=scale, enable_gqa=True)
    return o[:, :, 0]


def bench_decode(bandwidth):
    rows = []
    for int8 in (False, True):
        query, cache, bt, seq_lens, nbytes = decode_case(int8=int8)
        scale = 128**-0.5
        out = paged_attention.paged_decode(query, cache, bt, seq_lens, scale)
        ref = gather_sdpa(query, cache, bt, seq_lens, scale)
        err = (out.float() - ref.float()).abs().max().item()
        assert err < 5e-2, f"decode {'int8' if int8 else 'bf16'} mismatch {err}"
        ms = do_bench(lambda: paged_attention.paged_decode(query, cache, bt, seq_lens, scale))
        ref_ms = do_bench(lambda: gather_sdpa(query, cache, bt, seq_lens, scale))
        r = row(f"paged_decode {'int8' if int8 else 'bf16'} KV b64 ctx2048 32q/8kv d128 bs64",
                ms, nbytes, bandwidth, ref_ms, "gather + SDPA")
        r["max_abs_error_vs_reference"] = err
        rows.append(r)
    return rows


def bench_window(bandwidth, window=1024, batch=16, contexts=(1024, 4096, 16384)):
    """Sliding-window decode: the kernel reads only the window's pages, so the time
    per step stays at the 1k time however long the context (the pages before the
    window are in the block table here, as vLLM's null block would be)."""
    rows, first_us = [], None
    scale = 128**-0.5
    for context in contexts:
        query, cache, bt, seq_lens, _ = decode_case(batch=batch, context=context)
        out = paged_attention.paged_decode(query, cache, bt, seq_lens, scale,
                                           sliding_window=window)
        keep = window // cache.shape[2]  # the window is whole blocks here
        ref = gather_sdpa(query, cache, bt[:, -keep:].contiguous(),
                          torch.full_like(seq_lens, window), scale)
        err = (out.float() - ref.float()).abs().max().item()
        assert err < 5e-2, f"window decode ctx {context} mismatch {err}"
        ms = do_bench(lambda: paged_attention.paged_decode(query, cache, bt, seq_lens, scale,
                                                           sliding_window=window))
        full_ms = do_bench(lambda: paged_attention.paged_decode(query, cache, bt, seq_lens,
                                                                scale))
        nbytes = batch * window * 8 * 2 * 128 * 2 + 2 * query.numel() * 2
        r = row(f"window {window} decode b{batch} ctx{context} 32q/8kv d128", ms, nbytes,
                bandwidth, full_ms, "same kernel, whole context")
        with_graph_time(r, lambda: paged_attention.paged_decode(
            query, cache, bt, seq_lens, scale, sliding_window=window), nbytes, bandwidth)
        first_us = first_us or (r["us"], r["graph_us"])
        r["vs_window_context_time"] = round(r["us"] / first_us[0], 2)
        if r["graph_us"] and first_us[1]:
            r["graph_vs_window_context_time"] = round(r["graph_us"] / first_us[1], 2)
        r["max_abs_error_vs_reference"] = err
        rows.append(r)
    return rows


# ---------------------------------------------------------------------------
# MLA decode
# ---------------------------------------------------------------------------


def mla_case(batch, context, heads=128, lora=512, rope=64, bs=64):
    g = torch.Generator(device=DEV).manual_seed(0)
    blocks_per_req = context // bs
    num_blocks = batch * blocks_per_req
    cache = torch.randn(num_blocks, bs, lora + rope, dtype=torch.bfloat16, device=DEV,
                        generator=g)
    block_table = torch.randperm(num_blocks, device=DEV, generator=g).to(torch.int32)
    block_table = block_table.view(batch, blocks_per_req)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=DEV)
    q_nope = torch.randn(batch, heads, lora, dtype=torch.bfloat16, device=DEV, generator=g)
    q_pe = torch.randn(batch, heads, rope, dtype=torch.bfloat16, device=DEV, generator=g)
    nbytes = batch * context * (lora + rope) * 2 + 2 * (2 * q_nope.numel() + q_pe.numel())
    return q_nope, q_pe, cache, block_table, seq_lens, nbytes


def gather_mla(q_nope, q_pe, cache, block_table, seq_lens, scale):
    """Torch reference: gather every request's latent rows, then the absorbed math."""
    lora = q_nope.shape[-1]
    rows = cache[block_table.long()].flatten(1, 2)  # [B, S, L + R]
    c, k_pe = rows[..., :lora], rows[..., lora:]
    scores = (q_nope @ c.transpose(1, 2) + q_pe @ k_pe.transpose(1, 2)).float() * scale
    return (torch.softmax(scores, -1).to(c.dtype) @ c)


def bench_mla(bandwidth):
    rows = []
    for batch, context in ((1, 8192), (64, 2048)):
        q_nope, q_pe, cache, bt, seq_lens, nbytes = mla_case(batch, context)
        scale = 576**-0.5
        out = mla.mla_decode(q_nope, q_pe, cache, bt, seq_lens, scale)
        ref = gather_mla(q_nope, q_pe, cache, bt, seq_lens, scale)
        err = (out.float() - ref.float()).abs().max().item()
        assert err < 5e-2, f"mla decode mismatch {err}"
        ms = do_bench(lambda: mla.mla_decode(q_nope, q_pe, cache, bt, seq_lens, scale))
        ref_ms = do_bench(lambda: gather_mla(q_nope, q_pe, cache, bt, seq_lens, scale))
        r = row(f"mla_decode bf16 b{batch} ctx{context} 128 heads 512+64 bs64", ms, nbytes,
                bandwidth, ref_ms, "gather + matmuls")
        r["max_abs_error_vs_reference"] = err
        rows.append(r)
    return rows


# ---------------------------------------------------------------------------
# Fused MoE experts
# ---------------------------------------------------------------------------


def routed_batch(batch, hidden, experts, top_k, g):
    """Activations and a softmax top-k routing (renormalized) of random logits."""
    x = torch.randn(batch, hidden, dtype=torch.bfloat16, device=DEV, generator=g)
    logits = torch.randn(batch, experts, device=DEV, generator=g)
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return x, weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)


def bench_moe(bandwidth, experts=128, top_k=8, hidden=2048, inter=768, batches=(1, 16, 64)):
    g = torch.Generator(device=DEV).manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, dtype=torch.bfloat16, device=DEV,
                      generator=g) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, dtype=torch.bfloat16, device=DEV,
                     generator=g) * inter ** -0.5
    rows = []
    for batch in batches:
        x, weights, ids = routed_batch(batch, hidden, experts, top_k, g)
        out = moe.moe_experts(x, w13, w2, weights, ids)
        ref = torch_moe.moe_experts(x, w13, w2, weights, ids)
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        assert err < 2e-2, f"moe experts mismatch {err}"
        touched = int(torch.unique(ids).numel())
        nbytes = touched * 3 * hidden * inter * 2 + 2 * x.numel() * 2
        ms = do_bench(lambda: moe.moe_experts(x, w13, w2, weights, ids))
        ref_ms = do_bench(lambda: torch_moe.moe_experts(x, w13, w2, weights, ids))
        r = row(f"moe_experts bf16 batch {batch}: {touched} of {experts} experts touched, "
                f"top-{top_k}, {hidden}x{inter}", ms, nbytes, bandwidth, ref_ms,
                "torch_fast grouped matmuls")
        with_graph_time(r, lambda: moe.moe_experts(x, w13, w2, weights, ids), nbytes, bandwidth)
        r["experts_touched"] = touched
        r["max_rel_error_vs_reference"] = err
        rows.append(r)
    return rows


class PackedExperts(torch.nn.Module):
    """One expert projection in the quant layer's generic weight-only layout (4-bit
    codes two per byte, or 8-bit codes; symmetric, fp16 scales per group of 128
    inputs)."""

    def __init__(self, n, k, g, group_size=128, bits=4):
        super().__init__()
        self.provider, self.bits, self.group_size, self.out_features = None, bits, group_size, n
        self.perm = self.g_idx = self.zeros = None
        self.qweight = torch.nn.Parameter(
            torch.randint(0, 256, (n, k * bits // 8), dtype=torch.uint8, device=DEV,
                          generator=g), requires_grad=False)
        self.scales = torch.nn.Parameter(
            (torch.rand(n, k // group_size, device=DEV, generator=g) * 0.02 + 0.005).half(),
            requires_grad=False)

    def dense(self):
        if self.bits == 8:
            codes = self.qweight.float() - 128
        else:
            lo, hi = self.qweight & 15, self.qweight >> 4
            codes = torch.stack([lo, hi], -1).flatten(-2).float() - 8
        return (codes * self.scales.float().repeat_interleave(self.group_size, 1)).bfloat16()


def bench_moe_w4a16(bandwidth, experts=128, top_k=8, hidden=2048, inter=768,
                    batches=(1, 16, 64)):
    """W4A16 experts (4-bit, group 128) fused, vs the same layer's bf16 experts."""
    g = torch.Generator(device=DEV).manual_seed(1)
    w13 = torch.nn.ModuleList(PackedExperts(2 * inter, hidden, g) for _ in range(experts))
    w2 = torch.nn.ModuleList(PackedExperts(hidden, inter, g) for _ in range(experts))
    d13 = torch.stack([m.dense() for m in w13])
    d2 = torch.stack([m.dense() for m in w2])
    rows = []
    for batch in batches:
        x, weights, ids = routed_batch(batch, hidden, experts, top_k, g)
        out = moe.moe_quant_experts(x, w13, w2, weights, ids)
        ref = moe.moe_experts(x, d13, d2, weights, ids)
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        assert err < 2e-2, f"moe w4a16 experts mismatch {err}"
        touched = int(torch.unique(ids).numel())
        per_expert = 3 * hidden * inter // 2 + 3 * hidden * inter // 128 * 2
        nbytes = touched * per_expert + 2 * x.numel() * 2
        ms = do_bench(lambda: moe.moe_quant_experts(x, w13, w2, weights, ids))
        ref_ms = do_bench(lambda: moe.moe_experts(x, d13, d2, weights, ids))
        r = row(f"moe_experts W4A16 g128 batch {batch}: {touched} of {experts} experts, "
                f"top-{top_k}, {hidden}x{inter}", ms, nbytes, bandwidth, ref_ms,
                "the fused bf16 experts")
        with_graph_time(r, lambda: moe.moe_quant_experts(x, w13, w2, weights, ids), nbytes,
                        bandwidth)
        r["bf16_graph_us"] = graph_time(lambda: moe.moe_experts(x, d13, d2, weights, ids))
        r["bf16_graph_us"] = r["bf16_graph_us"] and round(r["bf16_graph_us"] * 1e3, 2)
        r["experts_touched"] = touched
        r["max_rel_error_vs_reference"] = err
        rows.append(r)
    return rows


# ---------------------------------------------------------------------------
# Quantized GEMMs
# ---------------------------------------------------------------------------

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]  # (in, out)


def w4_case(k, n, group=128):
    g = torch.Generator(device=DEV).manual_seed(k + n)
    qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=DEV, generator=g)
    scales = (torch.rand(n, k // group, device=DEV, generator=g) * 0.01 + 1e-3).half()
    return qweight, scales


def dequant_w4(qweight, scales, group=128):
    lo, hi = (qweight & 0xF), (qweight >> 4)
    codes = torch.stack((lo, hi), -1).reshape(qweight.shape[0], -1).to(torch.bfloat16)
    s = scales.to(torch.bfloat16).repeat_interleave(group, 1)
    return (codes - 8) * s


def bench_w4a16(bandwidth):
    rows = []
    for k, n in SHAPES:
        weights = [w4_case(k, n) for _ in range(copies(n * k // 2))]
        for m in (1, 16, 64):
            x = torch.randn(m, k, dtype=torch.bfloat16, device=DEV)
            fns = [lambda q=q, s=s: wint_gemm.wint_linear(x, q, s, None, bits=4, group_size=128)
                   for q, s in weights]
            refs = [lambda q=q, s=s: x @ dequant_w4(q, s).T for q, s in weights]
            y, want = fns[0](), refs[0]()
            err = ((y.float() - want.float()).abs().max() / want.float().abs().max()).item()
            assert err < 2e-2, f"W4A16 {k}x{n} m{m} mismatch {err}"
            qweight, scales = weights[0]
            nbytes = qweight.numel() + scales.numel() * 2 + (x.numel() + m * n) * 2
            r = row(f"W4A16 g128 {k}->{n} batch {m}", stream_time(fns), nbytes, bandwidth,
                    stream_time(refs), "dequantize + matmul")
            dense = [dequant_w4(q, s) for q, s in weights[:copies(2 * n * k)]]
            r["bf16_dense_us"] = round(stream_time([lambda w=w: x @ w.T for w in dense]) * 1e3, 2)
            r["weight_bytes_vs_bf16"] = round(nbytes / (2 * n * k + (x.numel() + m * n) * 2), 3)
            rows.append(r)
            del dense
    return rows


def bench_w8a8(bandwidth):
    rows = []
    for k, n in SHAPES[:2]:
        g = torch.Generator(device=DEV).manual_seed(n)
        weights = [(torch.randint(-127, 128, (n, k), dtype=torch.int8, device=DEV, generator=g),
                    torch.rand(n, device=DEV, generator=g) * 0.01)
                   for _ in range(copies(n * k))]
        for m in (64, 512):
            x = torch.randn(m, k, dtype=torch.bfloat16, device=DEV)
            fns = [lambda w=w, ws=ws: int8_gemm.int8_linear(x, w, ws) for w, ws in weights]
            refs = [lambda w=w, ws=ws: x @ (w.to(torch.bfloat16) * ws[:, None].to(
                torch.bfloat16)).T for w, ws in weights]

            def int_mm(w, w_scale):
                s = x.abs().amax(1, keepdim=True).float() / 127
                q = torch.round(x.float() / s).clamp(-127, 127).to(torch.int8)
                return (torch._int_mm(q, w.t()).float() * s * w_scale).to(x.dtype)

            y, want = fns[0](), int_mm(*weights[0])
            err = ((y.float() - want.float()).abs().max() / want.float().abs().max()).item()
            assert err < 2e-2, f"W8A8 {k}x{n} m{m} mismatch {err}"
            nbytes = n * k + (x.numel() + m * n) * 2
            r = row(f"W8A8 {k}->{n} batch {m}", stream_time(fns), nbytes, bandwidth,
                    stream_time(refs), "dequantize + matmul")
            r["torch_int_mm_us"] = round(stream_time(
                [lambda w=w, ws=ws: int_mm(w, ws) for w, ws in weights]) * 1e3, 2)
            rows.append(r)
    return rows


BENCHES = {"paged_decode": bench_decode, "w4a16": bench_w4a16, "w8a8": bench_w8a8,
           "mla_decode": bench_mla, "moe_experts": bench_moe, "moe_w4a16": bench_moe_w4a16,
           "window_decode": bench_window}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--kernels", default=",".join(BENCHES),
                        help=f"comma-separated subset of {','.join(BENCHES)} (default: all)")
    args = parser.parse_args()
    unknown = set(args.kernels.split(",")) - set(BENCHES)
    if unknown:
        parser.error(f"unknown kernels {sorted(unknown)}; known: {','.join(BENCHES)}")
    props = torch.cuda.get_device_properties(0)
    bandwidth = copy_bandwidth()
    print(f"GPU: {props.name} ({props.multi_processor_count} SMs); torch {torch.__version__}, "
          f"triton {triton.__version__}")
    print(f"device-to-device copy bandwidth: {bandwidth / 1e9:.1f} GB/s (read + write)")
    results = {"gpu": props.name, "torch": torch.__version__, "triton": triton.__version__,
               "copy_bandwidth_GBps": round(bandwidth / 1e9, 1)}
    for name in args.kernels.split(","):
        results[name] = BENCHES[name](bandwidth)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
