"""Real-card paths in fresh interpreters where the fakes really rename PrivateUse1:
platform identity without vendor imports, device selection, distributed init over
the fake eccl/sccl (gloo inside, two ranks), and vendor-kernel dispatch with
fallback, checked against float64 oracles."""

import socket
import subprocess
import sys
import textwrap

from vendor_fakes import run_faithful, paths


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout


def test_platform_identity_comes_from_the_backend_without_vendor_imports(tmp_path):
    out = _ok(run_faithful(textwrap.dedent("""
        import sys
        from vllm.platforms import current_platform as p
        print("ID", p.device_name, p.device_type, p.dispatch_key, p.dist_backend,
              p.device_control_env_var, p.uses_host_device_handling())
        print("VENDOR", [m for m in ("torch_gcu", "torch_tpu", "vllm_gcu") if m in sys.modules])
    """), "sophgo", tmp_path, env={"ACCEL_BACKEND": "auto"}))
    # device_name is the torch device type on a card: vLLM builds "tpu:<i>" and
    # "tpu:sccl" from it (the virtual SG2260 found "sophtpu:0" failing there).
    assert "ID tpu tpu PrivateUse1 sccl CHIP_MAP True" in out
    assert "VENDOR []" in out


def test_device_flag_must_match_the_backend(tmp_path):
    code = textwrap.dedent("""
        import sys
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        parser = make_arg_parser(FlexibleArgumentParser())
        print("DEV", parser.parse_args(["--model", "m", "--device", sys.argv[1]]).device)
    """)
    ok = run_faithful(code.replace("sys.argv[1]", "'sophtpu'"), "sophgo", tmp_path)
    assert "DEV sophtpu" in _ok(ok)
    bad = run_faithful(code.replace("sys.argv[1]", "'gcu'"), "sophgo", tmp_path)
    assert bad.returncode == 2
    assert "'gcu' disagrees with the active vllm_accel backend 'sophtpu'" in bad.stderr


GCU_DISPATCH = textwrap.dedent("""
    import sys, torch
    # vLLM's CPU ops are loaded first on a real box too, as vLLM picks them for this
    # CPU (vllm._C needs AVX512-BF16; _C_AVX512 or _C_AVX2 otherwise: loading two aborts)
    from vllm.platforms.cpu import CpuPlatform
    CpuPlatform.import_kernels()
    from vllm_accel.backends import get_backend
    b = get_backend()
    assert b.name == "gcu" and "torch_gcu" not in sys.modules
    b.load()
    assert torch._C._get_privateuse1_backend_name() == "gcu"
    assert b.torch_device(1) == torch.device("gcu", 1) and hasattr(torch.Tensor, "is_gcu")
    assert "torch_gcu.transfer_to_gcu" not in sys.modules
    assert "vllm_gcu" not in sys.modules  # only its _C ops were loaded
    import vllm_accel.ops.custom_ops  # reference kernels
    from vllm_accel.ops import registry
    from vllm_accel.ops.vendor.kernels import install_vendor_kernels
    report = install_vendor_kernels(b)
    registry.set_preferred_providers(b.kernel_providers)
    print("REPORT", report)
    calls = sys.modules["vllm_gcu._C"].CALLS if "vllm_gcu._C" in sys.modules else {}
    torch.manual_seed(0)
    x, res, w = torch.randn(5, 64), torch.randn(5, 64), torch.rand(64) + 0.5
    def ref_norm(h):
        h = h.double()
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    k = registry.get_kernel("rms_norm")
    assert torch.allclose(k(x, w, 1e-6).double(), ref_norm(x), atol=1e-5)
    out, new_res = k(x, w, 1e-6, res)
    assert torch.allclose(out.double(), ref_norm(x.double() + res.double()), atol=1e-5)
    assert torch.allclose(new_res, x + res)
    k(x, w, 1e-6, None, 32)  # variance_size: vendor op cannot, falls back
    g = torch.randn(3, 2 * 16)
    silu = registry.get_kernel("silu_and_mul")(g).double()
    gd = g.double()
    assert torch.allclose(silu, gd[:, :16] * torch.sigmoid(gd[:, :16]) * gd[:, 16:], atol=1e-6)
    # rope: neox, 2 query heads, 1 kv head, head 8, rotary_dim 8
    pos = torch.tensor([0, 3, 5])
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    ang = torch.arange(16, dtype=torch.float64)[:, None] * inv
    cache = torch.cat((ang.cos(), ang.sin()), -1).float()
    q, kk = torch.randn(3, 16), torch.randn(3, 8)
    def ref_rope(t):
        t = t.double().view(3, -1, 8)
        c, s = ang[pos].cos()[:, None], ang[pos].sin()[:, None]
        a, bb = t[..., :4], t[..., 4:]
        return torch.cat((a * c - bb * s, bb * c + a * s), -1).view(3, -1)
    # MoE routing: softmax top-2 of 8, renormalised and not (topk_softmax has no
    # renormalize argument: the adapter does it); DeepSeek's rules through
    # fused_grouped_topk (V2: softmax, 4 groups choose 2; V3: sigmoid + correction
    # bias), the routed scaling applied by the adapter
    from vllm_accel.ops.reference import moe as moe_ref
    logits = torch.randn(6, 8) * 2
    rules = [dict(renormalize=True), dict(renormalize=False),
             dict(renormalize=False, num_expert_group=4, topk_group=2),
             dict(renormalize=True, scoring_func="sigmoid", num_expert_group=4, topk_group=2,
                  e_score_correction_bias=torch.rand(8) * 0.5)]
    for rule in rules:
        w, ids = registry.get_kernel("moe_route")(logits, 2, routed_scaling_factor=2.0, **rule)
        rw, rids = moe_ref.moe_route(logits, 2, routed_scaling_factor=2.0, **rule)
        assert torch.equal(ids.sort(1).values, rids.sort(1).values), rule
        assert torch.allclose(w.sort(1).values, rw.sort(1).values, atol=1e-6), rule
    rq, rk = registry.get_kernel("rotary_embedding")(pos, q, kk, cache, 8, 8, True)
    assert torch.allclose(rq.double(), ref_rope(q), atol=1e-5)
    assert torch.allclose(rk.double(), ref_rope(kk), atol=1e-5)
    rq2, none = registry.get_kernel("rotary_embedding")(pos, q, None, cache, 8, 8, True)
    assert none is None and torch.allclose(rq2.double(), ref_rope(q), atol=1e-5)
    # MLA (DeepSeek's 512 + 64 latent, pages of 64): the cache write through
    # concat_and_cache_mla, decode through FlashMLA's op, against the float64 oracle;
    # a request with nothing cached (batch padding) gives zeros; float32 and pages of
    # 16 are outside FlashMLA's contract: its decode falls back
    from vllm_accel.ops.reference import mla as mla_ref
    import vllm_accel.ops.torch_fast.mla  # noqa: F401
    for dtype, page, writes, decodes in ((torch.bfloat16, 64, 1, 1), (torch.float32, 64, 1, 0),
                                         (torch.bfloat16, 16, 1, 0)):
        before = dict(calls)
        lens = torch.tensor([70, 0, 5], dtype=torch.int32)
        table = torch.tensor([[3, 0, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1],
                              [5, 4, 2, 0, 0, 0, 0, 0, 0]], dtype=torch.int32)[:, :1 + 128 // page]
        table = table if page == 64 else torch.arange(3 * table.shape[1]).view(3, -1).int() + 1
        cache = torch.zeros(64 * 6 // page * (4 if page == 16 else 1) + 1, page, 576, dtype=dtype)
        slots = torch.cat([mla_ref.request_slots(table[i], page, n)
                           for i, n in enumerate(lens.tolist())])
        slots = torch.cat((slots, torch.tensor([-1])))  # a padding row
        c, pe = torch.randn(slots.numel(), 512, dtype=dtype), torch.randn(slots.numel(), 64, dtype=dtype)
        registry.get_kernel("mla_cache_write")(c, pe, cache, slots)
        rows = cache.view(-1, 576)
        assert torch.equal(rows[slots[:-1]], torch.cat((c, pe), -1)[:-1])
        q_nope, q_pe = torch.randn(3, 4, 512, dtype=dtype), torch.randn(3, 4, 64, dtype=dtype)
        got = registry.get_kernel("mla_decode")(q_nope, q_pe, cache, table, lens, 0.05)
        want = mla_ref.mla_decode(q_nope.double(), q_pe.double(), cache.double(), table, lens, 0.05)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        assert got.dtype == dtype and torch.allclose(got.double(), want, atol=tol), dtype
        assert not got[1].any()
        vendor = "vllm_gcu._C" in sys.modules
        for op, n in (("concat_and_cache_mla", writes), ("fwd_kvcache_mla", decodes)):
            assert calls.get(op, 0) - before.get(op, 0) == (n if vendor else 0), (op, dtype, page)
    # decode attention through paged_attention_v1 over vLLM's layout, gathered from
    # ours (block-major bf16 with GQA; head-major float32 with ALiBi; a request with
    # nothing cached gives zeros), against the float64 oracle; a window and a head
    # size outside vLLM's list fall back
    from vllm_accel.ops.reference import attention as attn_ref
    lens = torch.tensor([37, 0, 5, 16])
    table = torch.tensor([[6, 2, 9], [0, 0, 0], [4, 0, 0], [1, 7, 0]], dtype=torch.int32)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    # (the first call per dtype also checks which memory order the op reads: 2 calls)
    cases = ((torch.bfloat16, 64, False, {}, 2),
             (torch.float32, 64, True, {"alibi_slopes": slopes}, 2),
             (torch.float32, 64, False, {"sliding_window": 8}, 0),
             (torch.float32, 40, False, {}, 0))
    for dtype, d, head_major, features, n in cases:
        before = calls.get("paged_attention_v1", 0)
        shape = (2, 10, 16, 2 * d) if head_major else (10, 2, 16, 2 * d)
        cache = torch.randn(shape).to(dtype)
        cache = cache.transpose(0, 1) if head_major else cache
        q = torch.randn(4, 4, d).to(dtype)
        got = registry.get_kernel("paged_decode")(q, cache, table, lens, 0.3, **features)
        want = attn_ref.paged_decode(q.double(), cache.double(), table, lens, 0.3, **features)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        assert got.dtype == dtype, dtype
        assert torch.allclose(got.double(), want, atol=tol), (dtype, features)
        assert not got[1].any()
        vendor = "vllm_gcu._C" in sys.modules
        new_calls = calls.get("paged_attention_v1", 0) - before
        assert new_calls == (n if vendor else 0), (dtype, features)
        if n:  # used, not refused by its probe (which also calls it twice): once more
            registry.get_kernel("paged_decode")(q, cache, table, lens, 0.3, **features)
            assert calls.get("paged_attention_v1", 0) - before == (n + 1 if vendor else 0)
    # prefill after cached context through context_attention_forward over the same
    # gathered tensors (a fresh prompt, a padding request, prompts after context; plain,
    # ALiBi, a window with a block before it freed), against the float64 oracle; the
    # first call per feature also finds the memory order (2 calls); another scale or a
    # soft-cap falls back
    seq_lens = torch.tensor([37, 0, 5, 16])
    cases = ((torch.bfloat16, 64, False, [3, 0, 5, 10], {}, None, 2),
             (torch.bfloat16, 64, True, [37, 0, 5, 16], {}, None, 1),
             (torch.float32, 128, True, [3, 0, 5, 10], {"alibi_slopes": slopes}, None, 2),
             (torch.float32, 64, False, [3, 0, 2, 16], {"sliding_window": 8}, None, 2),
             (torch.float32, 64, False, [3, 0, 5, 10], {}, 0.3, 0),
             (torch.float32, 64, False, [3, 0, 5, 10], {"logits_soft_cap": 5.0}, None, 0))
    for dtype, d, head_major, q_lens, features, scale, n in cases:
        before = calls.get("context_attention_forward", 0)
        shape = (2, 10, 16, 2 * d) if head_major else (10, 2, 16, 2 * d)
        cache = torch.randn(shape).to(dtype)
        cache = cache.transpose(0, 1) if head_major else cache
        if "sliding_window" in features:  # before the first query's window: freed, unread
            cache[6] = float("nan")
        qsl = torch.tensor([0] + q_lens).cumsum(0)
        q = torch.randn(int(qsl[-1]), 4, d).to(dtype)
        scale = d ** -0.5 if scale is None else scale
        got = registry.get_kernel("paged_prefill")(q, cache, table, qsl, seq_lens, scale,
                                                   **features)
        want = attn_ref.paged_attention(q.double(), cache.double(), table, qsl, seq_lens,
                                        scale, **features)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        assert got.dtype == dtype, dtype
        assert torch.allclose(got.double(), want, atol=tol), (dtype, q_lens, features)
        new_calls = calls.get("context_attention_forward", 0) - before
        assert new_calls == (n if vendor else 0), (dtype, q_lens, features)
        if n:  # used, not refused by its probe (which also calls it twice): once more
            registry.get_kernel("paged_prefill")(q, cache, table, qsl, seq_lens, scale,
                                                 **features)
            assert calls.get("context_attention_forward", 0) - before == (n + 1 if vendor else 0)
    # MoE experts through moe_align_block_size + fused_moe_kernel (8 experts, top-2, 70
    # tokens), against the float64 oracle; an expert map (expert parallel) falls back
    for dtype, act, emap, n in ((torch.bfloat16, "silu", None, 1),
                                (torch.float32, "gelu", None, 1),
                                (torch.float32, "silu", torch.tensor([0, 1, 2, 3, -1, -1, -1, -1]), 0)):
        before = calls.get("fused_moe_kernel", 0)
        x = torch.randn(70, 32).to(dtype)
        w13, w2 = torch.randn(8, 2 * 48, 32).to(dtype) / 6, torch.randn(8, 32, 48).to(dtype) / 7
        # expert 3 favoured: its run of ~70 pairs spans two blocks of 64
        rw, rids = moe_ref.moe_route(torch.randn(70, 8) + 4 * (torch.arange(8) == 3), 2,
                                     renormalize=True)
        got = registry.get_kernel("moe_experts")(x, w13, w2, rw, rids, activation=act,
                                                 expert_map=emap)
        want = moe_ref.moe_experts(x, w13, w2, rw, rids, activation=act, expert_map=emap)
        tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
        assert got.dtype == dtype and torch.allclose(got.double(), want.double(), atol=tol), act
        vendor = "vllm_gcu._C" in sys.modules
        assert calls.get("fused_moe_kernel", 0) - before == (2 * n if vendor else 0), (dtype, act)
    # Quantized experts through fused_moe_quant_kernel in vllm-gcu's layouts, converted at
    # load (prepare_experts) from the generic resident layout, against the float64 oracle
    # on the dequantized weights; layers its kernel does not take are declined
    import vllm_accel.quant
    from vllm_accel.quant.moe import PreparedExperts
    from vllm_accel.quant.packed import InstalledWInt, resident_from_codes
    def experts(e, n, k, bits, gs, asym, g):
        groups = k // gs if gs > 0 else 1
        res = [resident_from_codes(
            torch.randint(0, 2 ** bits, (n, k), generator=g),
            (torch.rand(n, groups, generator=g) + 0.5) * 2.0 ** -bits / k ** 0.5,
            torch.randint(0, 2 ** bits, (n, groups), generator=g) if asym else None,
            bits=bits, group_size=gs) for _ in range(e)]
        return [InstalledWInt(r) for r in res], torch.stack([r.dequantize() for r in res])
    kernel = registry.get_kernel("moe_quant_experts")
    prepare = getattr(kernel, "prepare_experts", None)
    assert (prepare is not None) == ("vllm_gcu._C" in sys.modules)
    plain = dict(expert_map=None, apply_router_weight_on_input=False, biased=False)
    # (224 experts: aligned by sgl_moe_align_block_size, as vllm-gcu does from 224)
    for e, bits, gs, asym, dtype in ((8, 8, -1, False, torch.bfloat16),
                                     (8, 8, 64, False, torch.float16),
                                     (8, 4, 32, True, torch.bfloat16),
                                     (8, 4, 64, False, torch.float16),
                                     (224, 8, -1, False, torch.bfloat16)):
        g = torch.Generator().manual_seed(bits * 100 + gs + e)
        m13, d13 = experts(e, 2 * 256, 128, bits, gs, asym, g)
        m2, d2 = experts(e, 128, 256, bits, gs, asym, g)
        x = torch.randn(70, 128, generator=g).to(dtype)
        rw, rids = moe_ref.moe_route(torch.randn(70, e, generator=g) + 4 * (torch.arange(e) == 3),
                                     2, renormalize=True)
        want = moe_ref.moe_experts(x.double(), d13, d2, rw, rids)
        scale = want.abs().amax(dim=1, keepdim=True)
        # per-expert modules: the next provider (float32 dequantization), no vendor call
        before = calls.get("fused_moe_quant_kernel", 0)
        got = kernel(x, m13, m2, rw, rids)
        assert ((got.double() - want).abs() <= 2 ** -6 * scale).all(), (bits, gs, "modules")
        assert calls.get("fused_moe_quant_kernel", 0) == before
        if prepare is None:
            continue
        p13, p2 = prepare(m13, m2, act_dtype=dtype, **plain)
        p13, p2 = PreparedExperts("gcu_vendor", p13), PreparedExperts("gcu_vendor", p2)
        got = kernel(x, p13, p2, rw, rids)
        # bf16/fp16 roundings: the scales (and zero terms), the gate/up products, the
        # activation, the output: a few units of the format's 2**-8 / 2**-11
        unit = 2 ** -8 if dtype == torch.bfloat16 else 2 ** -11
        err = float(((got.double() - want).abs() / scale).max())
        assert got.dtype == dtype and err <= 8 * unit, (bits, gs, asym, err)
        assert calls.get("fused_moe_quant_kernel", 0) - before == 2
        print("QUANT", e, bits, gs, asym, str(dtype), "relative error", round(err / unit, 2), "units")
    # W8A8 experts (dynamic per-token int8 activations before each GEMM), vs float64
    # with the same per-token quantization of the inputs of both GEMMs
    from vllm_accel.quant.w8a8 import InstalledW8A8, resolve_mm_method, w8a8_to_resident
    g = torch.Generator().manual_seed(88)
    def w8a8_experts(n, k):
        layers = [(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
                   torch.rand(n, generator=g) * 0.02 / k ** 0.5 + 0.01 / k ** 0.5)
                  for _ in range(8)]
        return ([InstalledW8A8(w8a8_to_resident(c, sc, [n], strategy="channel"), True,
                               resolve_mm_method(torch.device("cpu"))) for c, sc in layers],
                [c.double() * sc.double()[:, None] for c, sc in layers])
    (m13, d13), (m2, d2) = w8a8_experts(2 * 256, 128), w8a8_experts(128, 256)
    x = torch.randn(70, 128, generator=g).to(torch.bfloat16)
    rw, rids = moe_ref.moe_route(torch.randn(70, 8, generator=g), 2, renormalize=True)
    fake_quant = registry.get_kernel("int8_quant_act", "reference")
    def dq(t):
        q, sc, _ = fake_quant(t)
        return q.double() * sc.double()
    want = torch.zeros(70, 128, dtype=torch.float64)
    for t, c in ((t, c) for t in range(70) for c in range(2)):
        e = int(rids[t, c])
        h = dq(x[t:t + 1]) @ d13[e].T
        act = torch.nn.functional.silu(h[:, :256]) * h[:, 256:]
        want[t] += float(rw[t, c]) * (dq(act) @ d2[e].T)[0]
    if prepare is not None:
        before = calls.get("fused_moe_quant_kernel", 0)
        p13, p2 = prepare(m13, m2, act_dtype=torch.bfloat16, **plain)
        got = kernel(x, PreparedExperts("gcu_vendor", p13), PreparedExperts("gcu_vendor", p2),
                     rw, rids)
        # bf16 roundings of the gate/up products and the activation before their
        # per-token quantization, and of the output: a few units of 2**-8
        err = float(((got.double() - want).abs() / want.abs().amax(dim=1, keepdim=True)).max())
        assert got.dtype == torch.bfloat16 and err <= 8 * 2 ** -8, err
        assert calls.get("fused_moe_quant_kernel", 0) - before == 2
        print("QUANT W8A8 dynamic bf16 relative error", round(err / 2 ** -8, 2), "units")
    if prepare is not None:
        m13, _ = experts(2, 2 * 64, 128, 8, -1, True, g)  # 8-bit with zero points
        m2, _ = experts(2, 128, 64, 8, -1, False, g)
        assert prepare(m13, m2, act_dtype=torch.bfloat16, **plain) is None
        m13, _ = experts(2, 2 * 64, 128, 4, 32, False, g)
        m2, _ = experts(2, 128, 64, 4, 32, False, g)  # 4-bit down proj of 64 inputs
        assert prepare(m13, m2, act_dtype=torch.bfloat16, **plain) is None
        m13, _ = experts(2, 2 * 128, 128, 8, 32, False, g)  # 8-bit groups of 32
        m2, _ = experts(2, 128, 128, 8, -1, False, g)
        assert prepare(m13, m2, act_dtype=torch.bfloat16, **plain) is None
        m13, _ = experts(2, 2 * 128, 128, 4, -1, False, g)  # 4-bit per channel
        assert prepare(m13, m2, act_dtype=torch.bfloat16, **plain) is None
        m13, _ = experts(2, 2 * 128, 128, 8, -1, False, g)
        assert prepare(m13, m2, act_dtype=torch.bfloat16, **plain) is not None
        assert prepare(m13, m2, act_dtype=torch.float32, **plain) is None
        for feature in ({"expert_map": torch.tensor([0, -1])},
                        {"apply_router_weight_on_input": True}, {"biased": True}):
            assert prepare(m13, m2, act_dtype=torch.bfloat16, **{**plain, **feature}) is None
    # Dense weight-only linears through gptq_gemm_gcu (4-bit) and weight_only_quant
    # (8-bit) in vllm-gcu's layouts, made at load (wint_prepare under the model's
    # dtype), vs float64 on the dequantized weight
    from vllm_accel.quant.packed import installed
    vendor = "vllm_gcu._C" in sys.modules
    def dense(bits, gs, asym, act_order, k, g):
        groups = k // gs if gs > 0 else 1
        return resident_from_codes(
            torch.randint(0, 2 ** bits, (96, k), generator=g),
            (torch.rand(96, groups, generator=g) + 0.5) * 2.0 ** -bits / k ** 0.5,
            torch.randint(0, 2 ** bits, (96, groups), generator=g) if asym else None,
            bits=bits, group_size=gs, perm=torch.randperm(k, generator=g) if act_order else None)
    for bits, gs, asym, act_order, dtype in ((4, 32, True, False, torch.bfloat16),
                                             (4, 128, False, False, torch.float16),
                                             (4, 64, True, True, torch.bfloat16),
                                             (8, -1, False, False, torch.bfloat16),
                                             (8, 64, False, True, torch.float16)):
        g = torch.Generator().manual_seed(bits * 10 + gs)
        res = dense(bits, gs, asym, act_order, 256, g)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            module = installed(res)
        finally:
            torch.set_default_dtype(previous)
        assert (module.provider == "gcu_vendor") == vendor, module.provider
        x, bias = torch.randn(3, 5, 256, generator=g).to(dtype), torch.randn(96).to(dtype)
        want = x.double() @ res.dequantize().T + bias.double()
        op = "gptq_gemm_gcu" if bits == 4 else "weight_only_quant"
        before = calls.get(op, 0)
        got = module(x, bias)
        # what torch.compile traces with: the op's fake gives the output's shape
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode(allow_non_fake_inputs=True):
            traced = module(torch.empty(7, 256, dtype=dtype), bias)
        assert traced.shape == (7, 96) and traced.dtype == dtype
        assert module(x[:, :0], bias).shape == (3, 0, 96)  # no GEMM for no rows
        unit = 2 ** -8 if dtype == torch.bfloat16 else 2 ** -11
        err = float(((got.double() - want).abs() / want.abs().amax()).max())
        assert got.shape == (3, 5, 96) and got.dtype == dtype and err <= 8 * unit, (bits, gs, err)
        assert calls.get(op, 0) - before == (1 if vendor else 0)
        print("DENSE", bits, gs, asym, act_order, str(dtype), "error", round(err / unit, 2), "units")
    if vendor:
        prepare = registry.get_kernel("wint_prepare", "gcu_vendor")
        g = torch.Generator().manual_seed(0)
        assert prepare(dense(4, 32, True, False, 256, g), torch.float32) is None
        assert prepare(dense(8, -1, True, False, 256, g), torch.bfloat16) is None  # zero points
        assert prepare(dense(4, 32, True, False, 64, g), torch.bfloat16) is None  # 64 inputs
        assert prepare(dense(4, -1, True, False, 256, g), torch.bfloat16) is None  # per channel
        scattered = dense(4, 32, True, False, 256, g)
        scattered.g_idx = torch.arange(256, dtype=torch.int32) % 8
        assert prepare(scattered, torch.bfloat16) is None
    # W8A8 linears: the GEMM and its epilogue in cutlass_scaled_mm (the weight read as
    # its column-major transpose), vs float64 on the same int8 activations
    from vllm_accel.quant.w8a8 import InstalledW8A8, resolve_mm_method, w8a8_to_resident
    for dtype, static, n, k, used in ((torch.bfloat16, False, 96, 256, True),
                                      (torch.float16, True, 96, 256, True),
                                      (torch.bfloat16, False, 40, 256, False),  # N % 16
                                      (torch.float32, False, 96, 256, False)):
        g = torch.Generator().manual_seed(n + k)
        codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        w_scale = torch.rand(n, generator=g) * 0.01 + 0.001
        s_in = torch.tensor(0.02) if static else None
        res = w8a8_to_resident(codes, w_scale, [n], strategy="channel", input_scale=s_in)
        module = InstalledW8A8(res, True, resolve_mm_method(torch.device("cpu")))
        x, bias = torch.randn(3, 4, k, generator=g).to(dtype), torch.randn(n).to(dtype)
        q, xs, _ = registry.get_kernel("int8_quant_act", "reference")(x.reshape(-1, k), s_in)
        want = ((q.double() @ codes.double().T) * xs.double() * w_scale.double()
                + bias.double()).reshape(3, 4, n)
        before = calls.get("cutlass_scaled_mm", 0)
        got = module(x, bias)
        unit = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 2 ** -23}[dtype]
        err = float(((got.double() - want).abs() / want.abs().amax()).max())
        assert got.shape == (3, 4, n) and got.dtype == dtype and err <= 4 * unit, (dtype, err)
        assert calls.get("cutlass_scaled_mm", 0) - before == (1 if vendor and used else 0)
        with FakeTensorMode(allow_non_fake_inputs=True):  # the opaque op's fake
            assert module(torch.empty(5, k, dtype=dtype), bias).shape == (5, n)
        print("W8A8", str(dtype), "static" if static else "dynamic", n, "error",
              round(err / unit, 2), "units")
    print("CALLS", dict(calls))
""")


def test_gcu_vendor_ops_are_used_when_registered(tmp_path):
    out = _ok(run_faithful(GCU_DISPATCH, "gcu+ops", tmp_path))
    assert "'gcu_vendor:rms_norm': 'registered" in out
    assert "xformers not usable on gcu" in out  # no xformers with GCU kernels here
    assert ("'flash_attn:paged_prefill,paged_decode': \"flash_attn.vllm_flash_attn not usable "
            "on gcu: not importable (ModuleNotFoundError") in out  # no Enflame build here
    # one plain + one fused norm (the variance_size call fell back), eight silu (one from
    # the silu MoE experts, six from the quantized ones), one rope (the key=None call
    # fell back), two plain and two grouped routings
    assert ("CALLS {'rms_norm': 1, 'fused_add_rms_norm': 1, 'silu_and_mul': 8, "
            "'topk_softmax': 2, 'fused_grouped_topk': 2, 'rotary_embedding': 1, "
            "'concat_and_cache_mla': 3, 'fwd_kvcache_mla': 1, "
            "'paged_attention_v1': 6, 'context_attention_forward': 11, "
            "'moe_align_block_size': 7, 'fused_moe_kernel': 4, "
            "'fused_moe_quant_kernel': 12, 'sgl_moe_align_block_size': 1, 'gptq_gemm_gcu': 3, "
            "'weight_only_quant': 2, 'cutlass_scaled_mm': 2}") in out
    assert ("'gcu_vendor:moe_experts': 'registered (_C::fused_moe_kernel, "
            "_moe_C::moe_align_block_size, _moe_C::sgl_moe_align_block_size)'") in out
    assert ("'gcu_vendor:moe_quant_experts': 'registered (_C::fused_moe_quant_kernel, "
            "_moe_C::moe_align_block_size, _moe_C::sgl_moe_align_block_size)'") in out
    assert out.count("QUANT ") == 6 and out.count("DENSE ") == 5 and out.count("\nW8A8 ") == 4
    assert "'gcu_vendor:int8_linear': 'registered (_C::cutlass_scaled_mm)'" in out
    assert ("'gcu_vendor:wint_prepare': 'registered (_C::gptq_gemm_gcu, "
            "_C::weight_only_quant)'") in out
    assert "'gcu_vendor:paged_decode': 'registered (_C::paged_attention_v1)'" in out
    assert "'gcu_vendor:paged_prefill': 'registered (_C::context_attention_forward)'" in out
    # Enflame's library has no metadata op (vllm-gcu passes None for it)
    assert "'gcu_vendor:mla_decode': 'registered (_flashmla_C::fwd_kvcache_mla)'" in out
    assert ("'gcu_vendor:moe_route': 'registered (_C::fused_grouped_topk, "
            "_moe_C::topk_softmax)'") in out


def test_gcu_without_vendor_ops_falls_back_to_our_kernels(tmp_path):
    out = _ok(run_faithful(GCU_DISPATCH, "gcu", tmp_path))
    assert "'gcu_vendor:rms_norm': 'not registered by the vendor library: _C::fused_add_rms_norm, _C::rms_norm'" in out
    assert "CALLS {}" in out


def test_sophgo_rmsnorm_vendor_op(tmp_path):
    out = _ok(run_faithful(textwrap.dedent("""
        import torch
        from vllm_accel.backends import get_backend
        import vllm_accel.ops.custom_ops
        from vllm_accel.ops import registry
        from vllm_accel.ops.vendor.kernels import install_vendor_kernels
        b = get_backend(); b.load()
        print("REPORT", install_vendor_kernels(b))
        registry.set_preferred_providers(b.kernel_providers)
        x, w = torch.randn(4, 32), torch.rand(32) + 0.5
        ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
        assert torch.allclose(registry.get_kernel("rms_norm")(x, w, 1e-5).double(), ref, atol=1e-5)
        registry.get_kernel("rms_norm")(x, w, 1e-5, x)  # fused residual: our kernel
        from torch_tpu import ops
        print("CALLS", dict(ops.CALLS))
    """), "sophgo", tmp_path))
    assert "'sophgo_vendor:rms_norm': 'registered (my_ops::rmsnorm_forward)'" in out
    assert "CALLS {'rmsnorm_forward': 1}" in out


def test_sophgo_fused_moe_experts_vendor_op(tmp_path):
    """``my_ops::fused_moe_fused_experts`` serves SiLU bf16 experts once the layer's
    ``w2`` is stored transposed at load (no copy per call; the fake refuses another
    layout), within the bf16 bound of the float64 oracle; biases, an expert map and
    float32 go to the next provider (the op is not called)."""
    out = _ok(run_faithful(textwrap.dedent("""
        import types, torch
        from vllm_accel.backends import get_backend
        import vllm_accel.ops.moe
        from vllm_accel.ops import registry
        from vllm_accel.ops.reference import moe as moe_ref
        from vllm_accel.ops.vendor.kernels import install_vendor_kernels
        b = get_backend(); b.load()
        print("REPORT", install_vendor_kernels(b))
        registry.set_preferred_providers(b.kernel_providers)
        from torch_tpu import ops
        g = torch.Generator().manual_seed(0)
        e, h, i, m = 8, 64, 32, 5
        w13 = (torch.randn(e, 2 * i, h, generator=g) * h ** -0.5).bfloat16()
        w2 = torch.nn.Parameter((torch.randn(e, h, i, generator=g) * i ** -0.5).bfloat16(),
                                requires_grad=False)
        x = torch.randn(m, h, generator=g).bfloat16()
        weights, ids = moe_ref.moe_route(torch.randn(m, e, generator=g), 2, renormalize=True)
        want = moe_ref.moe_experts(x, w13, w2, weights, ids).double()
        kernel = registry.get_kernel("moe_experts")
        layer = types.SimpleNamespace(w2_weight=w2, w13_bias=None, expert_map=None,
                                      activation=types.SimpleNamespace(value="silu"),
                                      apply_router_weight_on_input=False)
        kernel.prepare_layer(layer)
        assert w2.shape == (e, h, i) and w2.transpose(1, 2).is_contiguous()
        got = kernel(x, w13, w2, weights, ids)
        assert got.dtype == torch.bfloat16 and got.shape == (m, h)
        err = ((got.double() - want).abs() / want.abs().amax(1, keepdim=True)).max().item()
        assert err < 15 * 2 ** -8, err
        before = dict(ops.CALLS)
        kernel(x, w13, w2, weights, ids, w13_bias=torch.zeros(e, 2 * i).bfloat16())
        kernel(x, w13, w2, weights, ids, expert_map=torch.arange(e, dtype=torch.int32))
        kernel(x.float(), w13.float(), w2.float(), weights, ids)
        assert dict(ops.CALLS) == before
        print("CALLS", dict(ops.CALLS), "ERR", err)
    """), "sophgo", tmp_path))
    assert ("'sophgo_vendor:moe_experts': 'registered (my_ops::fused_moe_fused_experts)'"
            in out)
    assert "CALLS {'fused_moe_fused_experts': 1}" in out


def test_sophgo_paged_attention_v3(tmp_path):
    """``my_ops::paged_attention_v3`` serves decode and prefill (fresh prompts and after
    cached context) from our cache, gathered per call into Sophgo's contiguous
    ``[nb, bs, Hkv, D]`` K/V with the new tokens' slots in that copy, against the float64
    oracle (bf16 and float32, GQA, block- and head-major pages, a padding request); the
    first call per shape also runs the op once as its probe. Features the op lacks go
    to the next provider uncalled, and a build that reads another cache order fails
    its probe: the next provider serves, still right."""
    out = _ok(run_faithful(textwrap.dedent("""
        import os, torch
        from vllm_accel.backends import get_backend
        import vllm_accel.ops.attention
        from vllm_accel.ops import registry
        from vllm_accel.ops.reference import attention as attn_ref
        from vllm_accel.ops.vendor.kernels import install_vendor_kernels
        b = get_backend(); b.load()
        print("REPORT", install_vendor_kernels(b))
        registry.set_preferred_providers(b.kernel_providers)
        from torch_tpu import ops
        decode, prefill = registry.get_kernel("paged_decode"), registry.get_kernel("paged_prefill")
        g = torch.Generator().manual_seed(0)
        table = torch.tensor([[6, 2, 9], [0, 0, 0], [4, 0, 0], [1, 7, 0]], dtype=torch.int32)

        def cache_of(dtype, d, head_major):
            shape = (2, 10, 16, 2 * d) if head_major else (10, 2, 16, 2 * d)
            cache = torch.randn(shape, generator=g).to(dtype)
            return cache.transpose(0, 1) if head_major else cache

        def check(got, want, dtype, what):
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
            assert got.dtype == dtype and torch.allclose(got.double(), want, atol=tol), what

        def calls():
            return ops.CALLS["paged_attention_v3"]

        lens = torch.tensor([37, 0, 5, 16])
        for dtype, d, head_major, features, n in (
                (torch.bfloat16, 64, False, {}, 2), (torch.bfloat16, 64, True, {}, 1),
                (torch.float32, 128, False, {}, 2),
                (torch.float32, 128, False, {"sliding_window": 8}, 0),
                (torch.float32, 128, False, {"logits_soft_cap": 5.0}, 0)):
            before, cache = calls(), cache_of(dtype, d, head_major)
            q = torch.randn(4, 4, d, generator=g).to(dtype)
            got = decode(q, cache, table, lens, 0.3, **features)
            want = attn_ref.paged_decode(q.double(), cache.double(), table, lens, 0.3, **features)
            check(got, want, dtype, ("decode", dtype, features))
            assert not got[1].any()
            assert calls() - before == n, ("decode", dtype, features)
        # prefill: fresh prompts (a request with nothing scheduled between them), then
        # prompts after cached context (chunked prefill / prefix caching)
        for q_lens, seq_lens, n in (([37, 0, 5, 16], [37, 0, 5, 16], 2),
                                    ([3, 0, 5, 10], [37, 0, 5, 16], 2),
                                    ([20, 0, 1, 16], [37, 0, 5, 16], 1)):
            for dtype in (torch.bfloat16, torch.float32):
                before, cache = calls(), cache_of(dtype, 64, False)
                qsl = torch.tensor([0] + q_lens).cumsum(0)
                q = torch.randn(int(qsl[-1]), 4, 64, generator=g).to(dtype)
                got = prefill(q, cache, table, qsl, torch.tensor(seq_lens), 0.3)
                want = attn_ref.paged_attention(q.double(), cache.double(), table, qsl,
                                                torch.tensor(seq_lens), 0.3)
                check(got, want, dtype, ("prefill", q_lens, dtype))
                assert calls() - before == n, ("prefill", q_lens, dtype)
        # one new token each: torch_tpu's decode path, so the decode check decides (done)
        before, cache = calls(), cache_of(torch.bfloat16, 64, False)
        qsl, seq_lens = torch.tensor([0, 1, 1, 2, 3]), torch.tensor([37, 0, 5, 16])
        q = torch.randn(3, 4, 64, generator=g).bfloat16()
        check(prefill(q, cache, table, qsl, seq_lens, 0.3),
              attn_ref.paged_attention(q.double(), cache.double(), table, qsl, seq_lens, 0.3),
              torch.bfloat16, "one new token each")
        assert calls() - before == 1
        # a build reading another cache order: the probe (one call) refuses it
        os.environ["FAKE_SOPHGO_CACHE_ORDER"] = "heads"
        for _ in range(2):
            before, cache = calls(), cache_of(torch.float32, 32, False)
            q = torch.randn(4, 4, 32, generator=g)
            got = decode(q, cache, table, lens, 0.3)
            check(got, attn_ref.paged_decode(q.double(), cache.double(), table, lens, 0.3),
                  torch.float32, "refused build")
            refused = calls() - before
            print("REFUSED", refused)
    """), "sophgo", tmp_path))
    for kernel in ("paged_decode", "paged_prefill"):
        assert f"'sophgo_vendor:{kernel}': 'registered (my_ops::paged_attention_v3)'" in out
    assert "REFUSED 1\nREFUSED 0" in out


def test_sophgo_paged_latent_attention(tmp_path):
    """``my_ops::paged_latent_attention`` serves ``mla_latent_attention`` (a whole MLA
    layer's attention from its latents) against the float64 oracle: decode, fresh
    prefill, prefill after cached context and a mixed batch, bf16 and float32, our
    latent cache gathered into the op's two caches (rope part de-interleaved) and the
    new tokens written into ours as the oracle writes them; the first call per case
    runs the op once more as its check, and ``serves`` answers for a layer's shapes,
    also under a model build's default device and dtype. A build whose decode stage
    ignores the context serves decode through its prefill stage; one that rotates other
    dims fails its check: the next provider serves, right."""
    out = _ok(run_faithful(textwrap.dedent("""
        import os, torch
        from vllm_accel.backends import get_backend
        import vllm_accel.ops.mla_layer
        from vllm_accel.ops import registry
        from vllm_accel.ops.vendor.kernels import install_vendor_kernels
        b = get_backend(); b.load()
        print("REPORT", install_vendor_kernels(b))
        registry.set_preferred_providers(b.kernel_providers)
        from torch_tpu import ops
        kernel = registry.get_kernel("mla_latent_attention")
        oracle = registry.get_kernel("mla_latent_attention", "reference")
        g = torch.Generator().manual_seed(0)
        heads, nope, rope, v_dim, q_lora, lora, bs = 4, 16, 8, 16, 24, 32, 16
        table = torch.tensor([[6, 2, 9], [4, 3, 0], [1, 7, 5]], dtype=torch.int32)

        def calls():
            return ops.CALLS["paged_latent_attention"]

        def case(dtype, q_lens, seq_lens, q_lora=q_lora):
            t = sum(q_lens)
            rand = lambda *s, std=1.0: (torch.randn(*s, generator=g) * std).to(dtype)
            w_uq = rand(heads * (nope + rope), q_lora, std=q_lora ** -0.5)
            w_ukv = rand(heads * (nope + v_dim), lora, std=lora ** -0.5)
            angles = torch.rand(t, rope // 2, generator=g) * 6.3
            qsl = torch.tensor([0] + q_lens).cumsum(0)
            slots = torch.cat([table[i].long()[torch.arange(s - q, s) // bs] * bs
                               + torch.arange(s - q, s) % bs
                               for i, (q, s) in enumerate(zip(q_lens, seq_lens))])
            return (rand(t, q_lora), rand(t, lora), rand(t, rope), angles.cos().to(dtype),
                    angles.sin().to(dtype), w_uq, w_ukv), rand(10, bs, lora + rope), (
                    table, qsl, torch.tensor(seq_lens), slots, heads, nope, v_dim, 0.3)

        for dtype in (torch.bfloat16, torch.float32):
            tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
            for q_lens, seq_lens, n in (([1, 1, 1], [37, 5, 16], 2),
                                        ([37, 5, 16], [37, 5, 16], 2),
                                        ([3, 5, 10], [37, 5, 16], 2),
                                        ([1, 5, 10], [20, 5, 16], 1),
                                        ([1, 1, 1], [3, 17, 33], 1)):
                inputs, cache, rest = case(dtype, q_lens, seq_lens)
                before, mine = calls(), cache.clone()
                got = kernel(*inputs, mine, *rest)
                want_cache = cache.clone()
                want = oracle(*inputs, want_cache, *rest)
                what = (dtype, q_lens, seq_lens)
                assert got.dtype == dtype and got.shape == (sum(q_lens), heads, v_dim), what
                err = float((got.double() - want.double()).abs().max())
                assert err <= tol * max(1.0, float(want.abs().max())), (what, err)
                assert torch.allclose(mine.double(), want_cache.double(), atol=tol), what
                assert calls() - before == n, (what, calls() - before)
        print("SERVES", kernel.serves(torch.bfloat16, torch.device("cpu"), heads, nope,
                                      rope, v_dim, q_lora, lora, bs))
        # as a model is built: under another default device and dtype (new shapes)
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("meta"):
            print("SERVES AT BUILD", kernel.serves(torch.bfloat16, torch.device("cpu"),
                                                   heads, nope, rope, v_dim, q_lora, 48, bs))
        torch.set_default_dtype(torch.float32)

        def two_decodes(what, q_lora):
            # two fp32 decodes at a query width not checked before, right either way;
            # the op's calls for each
            for _ in range(2):
                inputs, cache, rest = case(torch.float32, [1, 1, 1], [37, 5, 16], q_lora)
                before, mine, theirs = calls(), cache.clone(), cache.clone()
                got = kernel(*inputs, mine, *rest)
                assert torch.allclose(got.double(), oracle(*inputs, theirs, *rest).double(),
                                      atol=1e-4)
                print(what, calls() - before)

        # a build whose decode stage ignores the context: decode runs in stage 2
        os.environ["FAKE_SOPHGO_MLA_DECODE"] = "no_context"
        two_decodes("DECODE IN STAGE 2", 28)
        del os.environ["FAKE_SOPHGO_MLA_DECODE"]
        # caches in another dtype than the weights: the next provider, uncalled
        inputs, cache, rest = case(torch.bfloat16, [2, 1, 1], [9, 5, 16])
        before = calls()
        got = kernel(*inputs, cache.half(), *rest)
        assert calls() == before and got.dtype == torch.bfloat16
        # a build rotating the pairs' halves without de-interleaving: refused by its check
        os.environ["FAKE_SOPHGO_MLA_ROPE"] = "halves"
        two_decodes("REFUSED", 20)
    """), "sophgo", tmp_path))
    assert ("'sophgo_vendor:mla_latent_attention': 'registered "
            "(my_ops::paged_latent_attention)'") in out
    assert "SERVES True" in out and "SERVES AT BUILD True" in out
    assert "DECODE IN STAGE 2 3\nDECODE IN STAGE 2 1" in out  # stages 3 and 2 checked
    assert "REFUSED 2\nREFUSED 0" in out  # both stages checked, neither used


DIST = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from vllm_accel.backends import get_backend
    rank, world, init = int(sys.argv[1]), 2, sys.argv[2]
    b = get_backend()
    with b.distributed_init(rank, rank, world):
        dist.init_process_group(b.dist_backend, init_method=init, world_size=world, rank=rank)
    assert dist.get_backend() == b.dist_backend, dist.get_backend()
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    mod = getattr(torch, b.torch_device_type)
    state = sys.modules["torch_gcu" if b.name == "gcu" else "torch_tpu"].state
    print("RESULT", rank, t.tolist(), [e for e in state.log if e[0] != "import"])
    dist.destroy_process_group()
""")


def _two_ranks(kind, tmp_path, env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init = f"tcp://127.0.0.1:{port}"
    import os
    full = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "FAKE_VENDOR_MODE": "faithful",
            "PYTHONPATH": os.pathsep.join(paths(kind, tmp_path)), **env}
    procs = [subprocess.Popen([sys.executable, "-c", DIST, str(r), init], env=full,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err[-4000:]
    return [next(l for l in out.splitlines() if l.startswith("RESULT")) for out, _ in outs]


def test_eccl_process_group_over_two_ranks(tmp_path):
    lines = _two_ranks("gcu", tmp_path, {"ACCEL_BACKEND": "gcu"})
    for rank, line in enumerate(lines):
        assert f"RESULT {rank} [3.0, 3.0, 3.0]" in line
        assert f"('eccl_create', {rank}, 2)" in line


def test_sccl_gets_chip_map_options_and_local_ranks(tmp_path):
    lines = _two_ranks("sophgo", tmp_path, {"ACCEL_BACKEND": "sophtpu", "CHIP_MAP": "6,7"})
    for rank, line in enumerate(lines):
        assert f"RESULT {rank} [3.0, 3.0, 3.0]" in line
        # chip map of local ranks; set_device(local rank) mapped by torch_tpu to chip 6/7
        assert "('set_chip_map', [0, 1])" in line
        assert f"('set_device', {rank}, {6 + rank})" in line
        assert f"('sccl_create', {rank}, 2, [0, 1])" in line
