"""The card path's Mamba2 kernels (ops/state_space.py and the registry's
``ssd_scan``, ``ssm_decode_step``, ``causal_conv1d``, ``causal_conv1d_step``):
``torch_fast``'s chunked scan against the token-by-token ``reference`` in float64;
the adapters, called with vLLM's signatures, against vLLM's own C++ CPU kernels
(``layers/mamba/ops/cpu``, what the simulator runs) in float32; the convolution
against torch's conv1d; a scan continued by decode steps equal to one longer scan."""

import pytest
import torch
import torch.nn.functional as F

from vllm_accel.ops import state_space
from vllm_accel.ops.registry import get_kernel

H, P, N, G, K = 4, 8, 16, 2, 4


def _inputs(lengths, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return dict(x=rand(total, H, P), dt=rand(total, H, scale=0.5),
                A=-torch.rand(H, generator=gen).to(dtype) - 0.5, B=rand(total, G, N),
                C=rand(total, G, N), D=rand(H), dt_bias=rand(H, scale=0.3), cu=cu,
                init=rand(len(lengths), H, P, N, scale=0.5))


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("chunked", [False, True])
def test_chunked_scan_equals_token_by_token_float64(chunked, gated):
    """Sequences of 1-45 tokens, cut into chunks of up to 16 (a chunk never spans two
    sequences), two groups of heads, some starting from a state: outputs and every
    chunk's end state equal."""
    lengths = [1, 45, 16, 17, 3]
    t = _inputs(lengths, torch.float64)
    bounds = t["cu"].tolist()
    ends = (sorted({e for s in range(len(lengths)) for e in range(bounds[s] + 16,
                                                                    bounds[s + 1], 16)}
                   | set(bounds[1:])) if chunked else None)
    z = torch.randn(t["x"].shape, dtype=torch.float64) if gated else None
    init = t["init"].clone()
    init[1] = 0
    args = (t["x"], t["dt"], t["A"], t["B"], t["C"], t["cu"], init, t["D"], z, t["dt_bias"],
            True, (0.0, float("inf")))
    kwargs = {"chunk_ends": torch.tensor(ends)} if chunked else {}
    y_ref, s_ref = get_kernel("ssd_scan", "reference")(*args, **kwargs)
    y, s = get_kernel("ssd_scan", "torch_fast")(*args, **kwargs)
    assert s.shape[0] == (len(ends) if chunked else len(lengths))
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s, s_ref, rtol=1e-10, atol=1e-10)


def test_scan_then_decode_steps_equal_one_scan():
    """A 20-token prefill then 5 one-token steps (through the decode kernel, states in
    their cache slots) give the outputs and state of one 25-token scan."""
    t = _inputs([25], torch.float64, seed=3)
    full_y, full_s = get_kernel("ssd_scan")(t["x"], t["dt"], t["A"], t["B"], t["C"], t["cu"],
                                             None, t["D"], None, t["dt_bias"], True)
    cache = torch.zeros(3, H, P, N, dtype=torch.float64)
    y, s = get_kernel("ssd_scan")(t["x"][:20], t["dt"][:20], t["A"], t["B"][:20],
                                  t["C"][:20], torch.tensor([0, 20]), None, t["D"], None,
                                  t["dt_bias"], True)
    cache[2] = s[0]
    steps = []
    for i in range(20, 25):
        steps.append(get_kernel("ssm_decode_step")(
            cache, t["x"][i:i + 1], t["dt"][i:i + 1], t["A"], t["B"][i:i + 1],
            t["C"][i:i + 1], torch.tensor([2]), D=t["D"], dt_bias=t["dt_bias"],
            dt_softplus=True, null_slot=0))
    torch.testing.assert_close(torch.cat([y] + steps), full_y, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(cache[2], full_s[0], rtol=1e-10, atol=1e-10)


def _vllm_cpu():
    from vllm.model_executor.layers.mamba.ops.cpu import causal_conv1d, mamba_ssm

    return causal_conv1d, mamba_ssm


@pytest.mark.parametrize("intermediate", [False, True])
def test_scan_adapter_matches_vllm_cpu_kernel(intermediate):
    """``mamba_chunk_scan_combined_varlen`` as MambaMixer2 calls it: ``out`` and each
    sequence's final state as vLLM's CPU kernel computes them; with
    ``return_intermediate_states`` the states after each of vLLM's chunks, the last of
    each sequence being its final state."""
    lengths = [5, 40, 18]
    t = _inputs(lengths, torch.float32, seed=1)
    cu = t["cu"]
    chunk_ends = [5, 16, 32, 45, 61, 63]
    cu_chunks = torch.tensor([0, *chunk_ends], dtype=torch.int32)
    last_chunk = torch.tensor([0, 3, 5])
    seq_idx = torch.tensor([0, 1, 1, 1, 2, 2], dtype=torch.int32)
    out = torch.empty_like(t["x"])
    states = state_space.mamba_chunk_scan_combined_varlen(
        t["x"], t["dt"], t["A"], t["B"], t["C"], 16, cu, cu_chunks, last_chunk, seq_idx,
        out, D=t["D"], dt_bias=t["dt_bias"], initial_states=t["init"], dt_softplus=True,
        return_intermediate_states=intermediate, state_dtype=torch.float32)
    _, mamba_ssm = _vllm_cpu()
    expected_out = torch.empty_like(t["x"])
    expected = mamba_ssm._mamba_chunk_scan_combined_fwd_cpu(
        t["x"], t["dt"], t["A"], t["B"], t["C"], 16, expected_out, D=t["D"],
        dt_bias=t["dt_bias"], initial_states=t["init"], cu_seqlens=cu, dt_softplus=True,
        state_dtype=torch.float32)
    torch.testing.assert_close(out, expected_out, rtol=1e-4, atol=1e-4)
    finals = states[last_chunk] if intermediate else states
    assert states.shape[0] == (len(chunk_ends) if intermediate else len(lengths))
    torch.testing.assert_close(finals, expected, rtol=1e-4, atol=1e-4)


def test_state_update_adapter_matches_vllm_cpu_kernel():
    """``selective_state_update`` with the mixer's expanded ``dt``/``A``/``D``/``dt_bias``
    and ``[sequences, 1]`` slot indices, a padded row on the null block (0) untouched."""
    t = _inputs([1, 1, 1], torch.float32, seed=2)
    dt = t["dt"][:, :, None].expand(-1, -1, P)
    A = t["A"][:, None, None].expand(-1, P, N)
    D = t["D"][:, None].expand(-1, P)
    dt_bias = t["dt_bias"][:, None].expand(-1, P)
    slots = torch.tensor([[3], [0], [1]], dtype=torch.int32)
    state = torch.randn(4, H, P, N)
    expected_state = state.clone()
    out = torch.empty_like(t["x"])
    state_space.selective_state_update(state, t["x"], dt, A, t["B"], t["C"], D, dt_bias,
                                       dt_softplus=True, state_batch_indices=slots,
                                       dst_state_batch_indices=slots, out=out)
    _, mamba_ssm = _vllm_cpu()
    expected = torch.empty_like(t["x"])
    mamba_ssm.selective_state_update(expected_state, t["x"], dt, A, t["B"], t["C"], D=D,
                                     dt_bias=dt_bias, dt_softplus=True,
                                     state_batch_indices=slots,
                                     dst_state_batch_indices=slots, null_block_id=0,
                                     out=expected)
    for row in (0, 2):
        torch.testing.assert_close(out[row], expected[row], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, expected_state, rtol=1e-4, atol=1e-4)


def test_convolution_adapters_match_vllm_cpu_kernels():
    """``causal_conv1d_fn`` over three prefills (one continuing a cached state, one on
    the padding slot) then ``causal_conv1d_update`` one token each: outputs and conv
    states as vLLM's CPU kernels leave them; the prefill also against torch's conv1d."""
    gen = torch.Generator().manual_seed(4)
    dim, lengths = 24, [6, 2, 9]
    cu = torch.tensor([0, 6, 8, 17], dtype=torch.int32)
    x = torch.randn(dim, 17, generator=gen)
    weight, bias = torch.randn(dim, K, generator=gen), torch.randn(dim, generator=gen)
    # the mixer's (dim, state) view of vLLM's default (state, dim) layout
    states = torch.randn(5, K - 1, dim, generator=gen).transpose(1, 2)
    expected_states = states.clone()
    slots, has_init = torch.tensor([4, -1, 2]), torch.tensor([False, False, True])
    out = state_space.causal_conv1d_fn(x, weight, bias, states, cu, cache_indices=slots,
                                       has_initial_state=has_init, activation="silu")
    causal_conv1d, _ = _vllm_cpu()
    expected = causal_conv1d.causal_conv1d_fn_cpu(x, weight, bias, expected_states, cu,
                                                  cache_indices=slots,
                                                  has_initial_state=has_init,
                                                  activation="silu")
    for s in (0, 2):
        cols = slice(int(cu[s]), int(cu[s + 1]))
        torch.testing.assert_close(out[:, cols], expected[:, cols], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, expected_states)
    first = F.silu(F.conv1d(F.pad(x[None, :, :6], (K - 1, 0)), weight[:, None], bias,
                            groups=dim))[0]
    torch.testing.assert_close(out[:, :6], first, rtol=1e-5, atol=1e-5)

    step = torch.randn(2, dim, generator=gen)
    indices = torch.tensor([[4], [2]], dtype=torch.int32)
    y = state_space.causal_conv1d_update(step, states, weight, bias, "silu",
                                         conv_state_indices=indices)
    expected_y = causal_conv1d.causal_conv1d_update_cpu(step, expected_states, weight, bias,
                                                        "silu", conv_state_indices=indices)
    torch.testing.assert_close(y, expected_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, expected_states)


def test_speculative_rows_are_refused_by_name():
    with pytest.raises(NotImplementedError, match="speculative decoding with state-space layers"):
        state_space.causal_conv1d_update(torch.zeros(1, 4), torch.zeros(1, 4, 3),
                                         torch.zeros(4, 4), num_accepted_tokens=torch.ones(1))


def test_gated_delta_rule_matches_hf_recurrence():
    """Qwen3-Next / Qwen3.5's Gated DeltaNet: three packed sequences (one continuing a
    cached state, one on the padding slot) against HF transformers' own token-by-token
    ``torch_recurrent_gated_delta_rule`` run per sequence (key heads shared by two value
    heads each): outputs and the final states left in the cache."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_recurrent_gated_delta_rule,
    )

    gen = torch.Generator().manual_seed(6)
    hk, hv, dk, dv, lengths = 2, 4, 16, 8, [7, 3, 12]
    total = sum(lengths)
    q, k = torch.randn(total, hk, dk, generator=gen), torch.randn(total, hk, dk, generator=gen)
    v = torch.randn(total, hv, dv, generator=gen)
    g = -torch.rand(total, hv, generator=gen)
    beta = torch.rand(total, hv, generator=gen)
    states = torch.randn(5, hv, dv, dk, generator=gen)
    before = states.clone()
    cu = torch.tensor([0, 7, 10, 22])
    slots, has_init = torch.tensor([3, -1, 1]), torch.tensor([False, False, True])
    out = get_kernel("gated_delta_rule", "reference")(q, k, v, g, beta, states, cu, slots,
                                                      has_init)
    for s in (0, 2):
        rows = slice(int(cu[s]), int(cu[s + 1]))
        init = before[slots[s]].transpose(-1, -2)[None] if has_init[s] else None
        expected, final = torch_recurrent_gated_delta_rule(
            q[None, rows].repeat_interleave(2, 2), k[None, rows].repeat_interleave(2, 2),
            v[None, rows], g[None, rows], beta[None, rows], initial_state=init,
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[rows], expected[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(states[slots[s]], final[0].transpose(-1, -2),
                                   rtol=1e-5, atol=1e-5)
    assert torch.equal(states[[0, 2, 4]], before[[0, 2, 4]])
    assert not out[7:10].any()


def test_chunked_delta_rule_equals_token_by_token_float64():
    """``torch_fast``'s chunked gated delta rule (64 tokens a chunk, a triangular solve
    each) against the ``reference`` recurrence in float64: sequences of 1 to 150 tokens
    (three chunks, a partial one last), from a cached state or zeros, padding rows; the
    one-token sequences (decodes, batched in one step) among them."""
    gen = torch.Generator().manual_seed(7)
    hk, hv, dk, dv, lengths = 2, 4, 16, 8, [150, 1, 64, 30, 1, 1]
    total = sum(lengths)
    q = torch.randn(total, hk, dk, generator=gen, dtype=torch.float64)
    k = torch.randn(total, hk, dk, generator=gen, dtype=torch.float64)
    v = torch.randn(total, hv, dv, generator=gen, dtype=torch.float64)
    g = -torch.rand(total, hv, generator=gen, dtype=torch.float64) * 0.2
    beta = torch.rand(total, hv, generator=gen, dtype=torch.float64)
    states = torch.randn(8, hv, dv, dk, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, 150, 151, 215, 245, 246, 247])
    slots = torch.tensor([1, 2, -1, 5, 6, -1])
    has_init = torch.tensor([True, False, False, True, True, True])
    expected_states = states.clone()
    expected = get_kernel("gated_delta_rule", "reference")(q, k, v, g, beta, expected_states,
                                                           cu, slots, has_init)
    out = get_kernel("gated_delta_rule", "torch_fast")(q, k, v, g, beta, states, cu, slots,
                                                       has_init)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(states, expected_states, rtol=1e-9, atol=1e-9)


def test_batched_decode_steps_equal_the_reference_float64():
    """``torch_fast``'s one-step-for-all ``ssm_decode_step`` (a different destination
    slot for one sequence) and ``causal_conv1d_step`` equal the reference's loop over
    sequences, padding rows included."""
    t = _inputs([1, 1, 1, 1], torch.float64, seed=8)
    slots, dst = torch.tensor([3, 0, 1, 4]), torch.tensor([3, 0, 2, 4])
    state = torch.randn(5, H, P, N, dtype=torch.float64)
    states = {p: state.clone() for p in ("reference", "torch_fast")}
    ys = {p: get_kernel("ssm_decode_step", p)(states[p], t["x"], t["dt"], t["A"], t["B"],
                                                 t["C"], slots, D=t["D"], dt_bias=t["dt_bias"],
                                                 dt_softplus=True, null_slot=0, dst_slots=dst)
          for p in states}
    torch.testing.assert_close(ys["torch_fast"], ys["reference"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(states["torch_fast"], states["reference"], rtol=1e-12,
                               atol=1e-12)
    dim = 12
    x = torch.randn(4, dim, dtype=torch.float64)
    weight, bias = torch.randn(dim, K, dtype=torch.float64), torch.randn(dim, dtype=torch.float64)
    conv = torch.randn(5, K - 1, dim, dtype=torch.float64).transpose(1, 2)
    convs = {p: conv.clone() for p in ("reference", "torch_fast")}
    outs = {p: get_kernel("causal_conv1d_step", p)(x, convs[p], weight, bias,
                                                    torch.tensor([2, -1, 4, 0]), "silu")
            for p in convs}
    torch.testing.assert_close(outs["torch_fast"], outs["reference"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(convs["torch_fast"], convs["reference"])
