"""The MLA kernels (``ops/*/mla.py``: latent cache write, absorbed decode, latent
gather for prefill) of every provider against float64 oracles over the original
latents: vLLM's latent cache ``[num_blocks, block_size, L + R]`` filled with garbage,
shuffled block tables with garbage columns past each request's blocks, padding slots."""


import pytest
import torch

from mla_cases import TOL, absorbed_oracle, latent_case
from vllm_accel.ops import mla as _backend  # noqa: F401  (registers every provider)
from vllm_accel.ops.cpu_native import build as native
from vllm_accel.ops.registry import get_kernel

PROVIDERS = ["reference", "torch_fast", "cpu_native"]
#: (kv_lora_rank, rope dims): DeepSeek-V2/V3's 512 + 64, V2-Lite-like smaller latents
DIMS = [(512, 64), (256, 64), (448, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [1, 16, 128])
@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"{d[0]}+{d[1]}")
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_decode_matches_the_float64_oracle(provider, block_size, dims, heads, dtype):
    lora, rope = dims
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 7, 45]
    latents, table, cache = latent_case(seq_lens, block_size, lora, rope, dtype, seed=heads + lora)
    g = torch.Generator().manual_seed(1)
    b = len(seq_lens)
    q_nope = torch.randn(b, heads, lora, generator=g).to(dtype)
    # q_pe as vLLM hands it: a strided view of a wider tensor
    q_pe = torch.randn(heads, b, 2 * rope, generator=g).to(dtype).transpose(0, 1)[..., :rope]
    scale = (lora + rope) ** -0.5
    out = get_kernel("mla_decode", provider)(q_nope, q_pe, cache, table,
                                             torch.tensor(seq_lens, dtype=torch.int32), scale)
    assert out.shape == (b, heads, lora) and out.dtype == dtype
    torch.testing.assert_close(out.double(), absorbed_oracle(q_nope, q_pe, latents, lora, scale),
                               **TOL[dtype])


@pytest.mark.parametrize("provider", PROVIDERS)
def test_decode_padded_slot_is_zero(provider):
    lora, rope, block_size = 256, 64, 16
    latents, table, cache = latent_case([5, 40], block_size, lora, rope, torch.float32, seed=2)
    q_nope, q_pe = torch.randn(3, 4, lora), torch.randn(3, 4, rope)
    table = torch.cat([table, table[:1]])
    out = get_kernel("mla_decode", provider)(q_nope, q_pe, cache, table,
                                             torch.tensor([5, 40, 0], dtype=torch.int32), 0.1)
    assert (out[2] == 0).all()
    torch.testing.assert_close(out[:2].double(), absorbed_oracle(q_nope, q_pe, latents, lora, 0.1),
                               **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("provider", ["reference", "torch_fast"])  # (cpu_native: torch_fast's)
def test_cache_write_and_gather_are_exact(provider, dtype):
    """Writes land exactly in their slots (padding slots -1 write nothing, other rows
    keep their garbage); the gather returns every request's rows in position order."""
    lora, rope, block_size = 256, 64, 16
    seq_lens = [3, 17, 40]
    latents, table, reference_cache = latent_case(seq_lens, block_size, lora, rope, dtype, seed=5)
    cache = torch.full_like(reference_cache, float("nan"))
    slots = torch.cat([table[i, torch.arange(s) // block_size].long() * block_size
                       + torch.arange(s) % block_size for i, s in enumerate(seq_lens)])
    rows = torch.cat(latents)
    order = torch.randperm(len(slots), generator=torch.Generator().manual_seed(0))
    padded_slots = torch.cat([slots[order], torch.full((3,), -1)])
    padded_rows = torch.cat([rows[order], torch.full((3, lora + rope), 7.0).to(dtype)])
    get_kernel("mla_cache_write", provider)(padded_rows[:, :lora], padded_rows[:, lora:],
                                            cache, padded_slots)
    flat = cache.view(-1, lora + rope)
    assert torch.equal(flat[slots], rows)
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert flat[untouched].isnan().all()
    gathered = get_kernel("mla_gather", provider)(cache, table, seq_lens)
    assert torch.equal(gathered, rows)


@pytest.mark.skipif(native.torch_ops() is None, reason="the C++ op library did not build")
def test_cpp_decode_runs_and_declines_what_it_cannot_take():
    """The op computes (no silent fallback) where it takes the inputs, and declines a
    cache in another dtype than the queries (the caller then runs torch_fast)."""
    lora, rope = 256, 64
    latents, table, cache = latent_case([7, 33], 16, lora, rope, torch.bfloat16, seed=8)
    q_nope, q_pe = torch.randn(2, 4, lora).bfloat16(), torch.randn(2, 4, rope).bfloat16()
    lens = torch.tensor([7, 33], dtype=torch.int32)
    out = torch.ops.vllm_accel.cpu_mla_decode(q_nope, q_pe, cache, table, lens, 0.1)
    torch.testing.assert_close(out.double(), absorbed_oracle(q_nope, q_pe, latents, lora, 0.1),
                               **TOL[torch.bfloat16])
    assert torch.ops.vllm_accel.cpu_mla_decode(q_nope.float(), q_pe.float(), cache, table,
                                               lens, 0.1).numel() == 0
    with pytest.raises(ValueError, match="block table"):
        torch.ops.vllm_accel.cpu_mla_decode(q_nope, q_pe, cache, table[:, :1], lens, 0.1)


def _int8_case(seq_lens, block_size, lora, rope, seed):
    """Latents per request, a shuffled block table and an INT8 latent cache (codes, then
    the float32 scales of c and k_pe per token) written by the reference writer over
    garbage."""
    latents, table, _ = latent_case(seq_lens, block_size, lora, rope, torch.float32, seed)
    g = torch.Generator().manual_seed(seed + 1)
    num_blocks = int(table.max()) + 1
    cache = torch.randint(-128, 128, (num_blocks, block_size, lora + rope + 8), generator=g,
                          dtype=torch.int8)
    slots = torch.cat([table[i, torch.arange(s) // block_size].long() * block_size
                       + torch.arange(s) % block_size for i, s in enumerate(seq_lens)])
    rows = torch.cat(latents)
    get_kernel("mla_cache_write_int8", "reference")(rows[:, :lora], rows[:, lora:], cache,
                                                    slots)
    return latents, table, cache, slots


@pytest.mark.parametrize("provider", ["reference", "torch_fast"])
def test_int8_latent_cache(provider):
    """Each part quantized per token (``round(x / (max|x| / 127))``), the scales stored
    after the codes; the gather dequantizes exactly those; decode over the INT8 cache
    stays within the quantization's bound of the float64 oracle on the original latents
    (bf16 queries)."""
    lora, rope, block_size = 256, 64, 16
    seq_lens = [1, 17, 40, 33]
    latents, table, cache, slots = _int8_case(seq_lens, block_size, lora, rope, seed=4)
    rows = torch.cat(latents)
    fresh = torch.zeros_like(cache)
    padded = torch.cat([rows, torch.full((1, lora + rope), 7.0)])  # a padding row, slot -1
    get_kernel("mla_cache_write_int8", provider)(
        padded[:, :lora], padded[:, lora:], fresh, torch.cat([slots, torch.tensor([-1])]))
    assert torch.equal(fresh.view(-1, cache.shape[-1])[slots], cache.view(-1, cache.shape[-1])[slots])
    flat = cache.view(-1, cache.shape[-1])[slots]
    scales = flat[:, -8:].contiguous().view(torch.float32)
    for part, (a, b) in enumerate(((0, lora), (lora, lora + rope))):
        want = rows[:, a:b].abs().amax(-1) / 127
        torch.testing.assert_close(scales[:, part], want, atol=0, rtol=0)
        codes = (rows[:, a:b] / want[:, None]).round().clamp(-127, 127).to(torch.int8)
        assert torch.equal(flat[:, a:b], codes)
    gathered = get_kernel("mla_gather_int8", provider)(cache, table, seq_lens, lora)
    expected = torch.cat((flat[:, :lora].float() * scales[:, :1],
                          flat[:, lora:-8].float() * scales[:, 1:]), dim=-1)
    assert torch.equal(gathered, expected)
    g = torch.Generator().manual_seed(5)
    q_nope = torch.randn(len(seq_lens), 16, lora, generator=g).bfloat16()
    q_pe = torch.randn(len(seq_lens), 16, rope, generator=g).bfloat16()
    scale = (lora + rope) ** -0.5
    out = get_kernel("mla_decode_int8", provider)(q_nope, q_pe, cache, table,
                                                  torch.tensor(seq_lens, dtype=torch.int32),
                                                  scale)
    want = absorbed_oracle(q_nope, q_pe, latents, lora, scale)
    vmax = torch.stack([lat[:, :lora].abs().max() for lat in latents]).double()
    # as the INT8 KV cache's bound (paged_cases.INT8_ERR), on top of bf16's tolerance
    assert ((out.double() - want).abs() <= 0.02 * vmax[:, None, None] + 2e-2).all()


@pytest.mark.parametrize("kv_scale", [1.0, 0.005, torch.tensor([0.5])],
                         ids=["1", "0.005", "tensor"])
@pytest.mark.parametrize("provider", ["reference", "torch_fast"])
def test_fp8_latent_cache(provider, kv_scale):
    """Rows stored as e4m3 of ``x / kv_scale`` (a float or a one-element tensor),
    saturated at 448 (the 0.005 scale pushes latents past it), padding slots skipped; the
    gather returns exactly ``codes * kv_scale``; decode over the fp8 cache is the
    float64 oracle over those dequantized latents (bf16 queries), and within e4m3's
    rounding of the oracle over the originals where nothing saturated."""
    lora, rope, block_size = 256, 64, 16
    seq_lens = [1, 17, 40, 33]
    latents, table, _ = latent_case(seq_lens, block_size, lora, rope, torch.float32, seed=6)
    rows = torch.cat(latents)
    slots = torch.cat([table[i, torch.arange(s) // block_size].long() * block_size
                       + torch.arange(s) % block_size for i, s in enumerate(seq_lens)])
    g = torch.Generator().manual_seed(7)
    cache = torch.randint(0, 256, (int(table.max()) + 1, block_size, lora + rope), generator=g,
                          dtype=torch.uint8).view(torch.float8_e4m3fn)
    untouched = cache.clone()
    padded = torch.cat([rows, torch.full((1, lora + rope), 7.0)])
    get_kernel("mla_cache_write_fp8", provider)(
        padded[:, :lora], padded[:, lora:], cache, torch.cat([slots, torch.tensor([-1])]),
        kv_scale)
    scale = float(kv_scale)
    assert bool((rows.abs() / scale > 448).any()) == (scale < 0.01)
    codes = (rows / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    flat = cache.view(-1, lora + rope)
    assert torch.equal(flat[slots].view(torch.uint8), codes.view(torch.uint8))
    others = torch.ones(flat.shape[0], dtype=torch.bool)
    others[slots] = False
    assert torch.equal(flat[others].view(torch.uint8),
                       untouched.view(-1, lora + rope)[others].view(torch.uint8))
    dequant = codes.float() * scale
    assert torch.equal(get_kernel("mla_gather_fp8", provider)(cache, table, seq_lens,
                                                              kv_scale), dequant)
    q_nope = torch.randn(len(seq_lens), 16, lora, generator=g).bfloat16()
    q_pe = torch.randn(len(seq_lens), 16, rope, generator=g).bfloat16()
    attn_scale = (lora + rope) ** -0.5
    out = get_kernel("mla_decode_fp8", provider)(
        q_nope, q_pe, cache, table, torch.tensor(seq_lens, dtype=torch.int32), attn_scale,
        kv_scale)
    seen = list(dequant.split(seq_lens))
    torch.testing.assert_close(out.double(), absorbed_oracle(q_nope, q_pe, seen, lora,
                                                             attn_scale), **TOL[torch.bfloat16])
    if scale == 1.0:  # e4m3 keeps 3 mantissa bits: 1/16 relative per latent
        want = absorbed_oracle(q_nope, q_pe, latents, lora, attn_scale)
        vmax = torch.stack([lat[:, :lora].abs().max() for lat in latents]).double()
        assert ((out.double() - want).abs() <= 0.1 * vmax[:, None, None] + 2e-2).all()
