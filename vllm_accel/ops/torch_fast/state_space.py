"""``torch_fast`` state-space kernels, chunked: a few batched matmuls a chunk instead
of one step a token (the ``reference`` recurrences are the oracle).

Mamba2's scan in the state-space duality's form: within a chunk of ``L`` tokens, with
``a_t`` the running sum of ``dt * A`` from the chunk's start and ``h0`` the state
entering it::

    y_t   = exp(a_t) * (C_t . h0) + sum_{s<=t} exp(a_t - a_s) * dt_s * (C_t . B_s) * x_s
    h_end = exp(a_L) * h0 + sum_s exp(a_L - a_s) * dt_s * x_s (outer) B_s

The gated delta rule: see :func:`_delta_chunk`."""

import torch

from vllm_accel.ops.reference.state_space import (
    _activate,
    _heads,
    _skip_and_gate,
    delta_rule_inputs,
    delta_rule_over_sequences,
    prepare_dt,
)
from vllm_accel.ops.registry import register_kernel

#: tokens a chunk when the caller gives no chunk boundaries (vLLM always does)
DEFAULT_CHUNK = 256


def _chunk(x, steps, a, Bh, Ch, h0):
    """One chunk of one sequence: ``(y [L, H, P], h_end [H, P, N])``."""
    cum = torch.cumsum(steps * a, dim=0)  # [L, H]
    # decay[h, t, s] = exp(cum_t - cum_s) for s <= t, else 0
    diff = cum.T[:, :, None] - cum.T[:, None, :]
    causal = torch.ones(diff.shape[1:], dtype=torch.bool, device=x.device).tril()
    decay = torch.exp(diff.masked_fill(~causal, float("-inf")))
    scores = torch.einsum("thn,shn->hts", Ch, Bh) * decay  # [H, L, L]
    xs = x * steps[:, :, None]  # dt_s * x_s, [L, H, P]
    y = torch.einsum("hts,shp->thp", scores, xs)
    y = y + torch.exp(cum)[:, :, None] * torch.einsum("thn,hpn->thp", Ch, h0)
    tail = torch.exp(cum[-1][None] - cum)  # [L, H]
    h_end = (torch.exp(cum[-1])[:, None, None] * h0
             + torch.einsum("sh,shp,shn->hpn", tail, xs, Bh))
    return y, h_end


@register_kernel("ssd_scan", provider="torch_fast")
def ssd_scan(x, dt, A, B, C, cu_seqlens, initial_states=None, D=None, z=None,
             dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
             chunk_ends=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``reference`` ``ssd_scan``'s contract, chunk by chunk: sequences are cut at
    ``chunk_ends`` (vLLM's chunk boundaries, which never span two sequences), else
    every ``DEFAULT_CHUNK`` tokens."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    heads, head_dim = x.shape[1:]
    steps = prepare_dt(dt, dt_bias, dt_softplus, dt_limit).to(compute)
    Bh, Ch = _heads(B.to(compute), heads), _heads(C.to(compute), heads)
    xc, a = x.to(compute), A.to(compute)
    bounds = cu_seqlens.tolist()
    if chunk_ends is not None:
        cuts = sorted(set(int(e) for e in chunk_ends) | set(bounds[1:]))
    else:
        cuts = sorted({e for s in range(len(bounds) - 1)
                       for e in range(bounds[s] + DEFAULT_CHUNK, bounds[s + 1],
                                      DEFAULT_CHUNK)} | set(bounds[1:]))
    y = torch.empty(x.shape, dtype=compute, device=x.device)
    state_after, finals = {}, []
    cut = 0
    for s in range(len(bounds) - 1):
        h = (initial_states[s].to(compute) if initial_states is not None else
             torch.zeros(heads, head_dim, B.shape[-1], dtype=compute, device=x.device))
        start = bounds[s]
        while start < bounds[s + 1]:
            while cuts[cut] <= start:
                cut += 1
            end = cuts[cut]
            y[start:end], h = _chunk(xc[start:end], steps[start:end], a, Bh[start:end],
                                     Ch[start:end], h)
            state_after[end] = h
            start = end
        finals.append(h)
    y = _skip_and_gate(y, x, D, z)
    if chunk_ends is None:
        return y, torch.stack(finals)
    return y, torch.stack([state_after[int(e)] for e in chunk_ends])


#: tokens a chunk of the gated delta rule
DELTA_CHUNK = 64


def _delta_chunk(q, k, v, g, beta, S):
    """One chunk of one sequence, heads batched: ``q``/``k [H, L, K]`` (normalised,
    q scaled), ``v [H, L, V]``, ``g``/``beta [H, L]``, entering state ``S [H, V, K]``.

    With ``c_t`` the running sum of ``g`` and ``u_t`` the value each token writes,
    ``S_t = exp(c_t) S + sum_{i<=t} exp(c_t - c_i) u_i k_i^T``; the delta rule makes
    ``u = beta * (v - exp(c) * (S k) - A u)`` with ``A[t, i] = exp(c_t - c_i) k_t.k_i``
    (i < t), a unit lower-triangular system solved for all tokens at once."""
    c = torch.cumsum(g, dim=-1)  # [H, L]
    diff = c[:, :, None] - c[:, None, :]
    length = g.shape[-1]
    lower = torch.ones(length, length, dtype=torch.bool, device=g.device).tril()
    decay = torch.exp(diff.masked_fill(~lower, float("-inf")))  # exp(c_t - c_i), i <= t
    strict = decay * (k @ k.transpose(-1, -2))
    strict = strict.masked_fill(torch.eye(length, dtype=torch.bool, device=g.device), 0)
    system = torch.eye(length, dtype=q.dtype, device=q.device) + beta[..., None] * strict
    rhs = beta[..., None] * (v - torch.exp(c)[..., None] * (k @ S.transpose(-1, -2)))
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    out = (torch.exp(c)[..., None] * (q @ S.transpose(-1, -2))
           + (decay * (q @ k.transpose(-1, -2))) @ u)
    tail = torch.exp(c[:, -1:] - c)[..., None]  # exp(c_L - c_i)
    S = torch.exp(c[:, -1])[:, None, None] * S + (u * tail).transpose(-1, -2) @ k
    return out, S


@register_kernel("gated_delta_rule", provider="torch_fast")
def gated_delta_rule(q, k, v, g, beta, states, cu_seqlens, slots, has_initial_state=None,
                     null_slot=-1) -> torch.Tensor:
    """The ``reference`` ``gated_delta_rule``'s contract, ``DELTA_CHUNK`` tokens a step
    (a few matmuls and one triangular solve per chunk instead of a loop per token); the
    one-token sequences (decodes) in one batched step."""
    single = (cu_seqlens.diff() == 1) & (slots != null_slot)
    out = delta_rule_over_sequences(_delta_chunks, q, k, v, g, beta, states, cu_seqlens,
                                    torch.where(single, null_slot, slots),
                                    has_initial_state, null_slot)
    if single.any():
        rows = cu_seqlens[:-1][single].to(v.device)
        src = slots[single].to(states.device)
        q1, k1, v1, g1, beta1 = delta_rule_inputs(q[rows], k[rows], v[rows], g[rows],
                                                  beta[rows])
        S = states[src].to(v1.dtype)
        if has_initial_state is not None:
            keep = has_initial_state.cpu()[single].to(S.device)
            S = torch.where(keep[:, None, None, None], S, 0)
        else:
            S = torch.zeros_like(S)
        S = torch.exp(g1)[..., None, None] * S
        delta = beta1[..., None] * (v1 - (S @ k1[..., None])[..., 0])
        S = S + delta[..., None] * k1[:, :, None, :]
        out[rows] = (S @ q1[..., None])[..., 0]
        states[src] = S.to(states.dtype)
    return out


def _delta_chunks(q, k, v, g, beta, S):
    """One sequence (``q``/``k``/``v [L, H, *]``, ``g``/``beta [L, H]``), chunk by chunk."""
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for start in range(0, v.shape[0], DELTA_CHUNK):
        rows = slice(start, start + DELTA_CHUNK)
        o, S = _delta_chunk(q[rows].transpose(0, 1), k[rows].transpose(0, 1),
                            v[rows].transpose(0, 1), g[rows].T, beta[rows].T, S)
        out[rows] = o.transpose(0, 1)
    return out, S


@register_kernel("ssm_decode_step", provider="torch_fast")
def ssm_decode_step(state, x, dt, A, B, C, slots, D=None, z=None, dt_bias=None,
                    dt_softplus=False, null_slot=-1, dst_slots=None) -> torch.Tensor:
    """The ``reference`` ``ssm_decode_step``'s contract, every sequence in one step."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    heads = x.shape[1]
    live = torch.nonzero(slots != null_slot).flatten()
    src = slots[live].to(state.device)
    dst = src if dst_slots is None else dst_slots[live].to(state.device)
    rows = live.to(x.device)
    steps = prepare_dt(dt[rows], dt_bias, dt_softplus, (0.0, float("inf"))).to(compute)
    h = (torch.exp(steps * A.to(compute))[:, :, None, None] * state[src].to(compute)
         + (steps[:, :, None] * x[rows].to(compute))[..., None]
         * _heads(B[rows].to(compute), heads)[:, :, None, :])
    state[dst] = h.to(state.dtype)
    y = torch.zeros(x.shape, dtype=compute, device=x.device)
    y[rows] = (h * _heads(C[rows].to(compute), heads)[:, :, None, :]).sum(-1)
    return _skip_and_gate(y, x, D, z)


@register_kernel("causal_conv1d_step", provider="torch_fast")
def causal_conv1d_step(x, conv_states, weight, bias, slots, activation=None,
                       null_slot=-1) -> torch.Tensor:
    """The ``reference`` ``causal_conv1d_step``'s contract, every sequence at once."""
    width = weight.shape[1] - 1
    live = torch.nonzero(slots != null_slot).flatten()
    index, rows = slots[live].to(conv_states.device), live.to(x.device)
    window = torch.cat([conv_states[index, :, :width].to(x.dtype), x[rows][:, :, None]], dim=2)
    y = (window.to(weight.dtype) * weight).sum(-1)
    if bias is not None:
        y = y + bias
    out = torch.zeros_like(x)
    out[rows] = _activate(y, activation).to(x.dtype)
    conv_states[index, :, :width] = window[:, :, 1:].to(conv_states.dtype)
    return out
