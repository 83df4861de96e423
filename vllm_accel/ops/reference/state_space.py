"""``reference`` state-space kernels: Mamba2's selective scan and its causal
depthwise convolution, token by token as the recurrences are defined. The oracle of
``torch_fast``'s chunked scan, and what the card path runs where no other provider
has a kernel.

Shapes (one layer, one rank): ``x [T, H, P]`` (tokens, heads, head dim), ``dt [T, H]``,
``A [H]`` (negative decay rates), ``B``/``C [T, G, N]`` (groups of heads, state size),
``D [H]`` or ``[H, P]``, the state ``[H, P, N]``. Sequences are packed along ``T`` and
delimited by ``cu_seqlens``. The recurrence, with ``dt`` after bias, softplus and
limits::

    h_t = exp(dt_t * A) * h_{t-1} + dt_t * x_t (outer) B_t
    y_t = h_t . C_t + D * x_t            (then * silu(z_t) where z is given)
"""

import torch
import torch.nn.functional as F

from vllm_accel.ops.registry import register_kernel


def prepare_dt(dt: torch.Tensor, dt_bias: torch.Tensor | None, softplus: bool,
               limit: tuple[float, float]) -> torch.Tensor:
    """The step sizes the recurrence uses: bias added, softplus'd, clamped to ``limit``."""
    dt = dt.float() if dt.dtype != torch.float64 else dt
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if softplus:
        dt = F.softplus(dt)
    if limit[0] > 0.0 or limit[1] < float("inf"):
        dt = dt.clamp(min=limit[0], max=limit[1])
    return dt


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[..., G, N]`` -> ``[..., H, N]``: each group's B or C shared by its heads."""
    return t.repeat_interleave(heads // t.shape[-2], dim=-2)


def _skip_and_gate(y, x, D, z):
    if D is not None:
        y = y + (D if D.dim() == 2 else D[:, None]).to(y.dtype) * x.to(y.dtype)
    if z is not None:
        y = y * F.silu(z.to(y.dtype))
    return y


@register_kernel("ssd_scan")
def ssd_scan(x, dt, A, B, C, cu_seqlens, initial_states=None, D=None, z=None,
             dt_bias=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
             chunk_ends=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every packed sequence's scan from its initial state (zeros where None).

    Returns ``(y [T, H, P], states)``: ``states`` are each sequence's final state
    ``[S, H, P, N]``, or with ``chunk_ends`` (token index one past each chunk's end)
    the state after each chunk ``[len(chunk_ends), H, P, N]``. Math in float32 (float64
    inputs stay float64)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    heads, head_dim = x.shape[1:]
    steps = prepare_dt(dt, dt_bias, dt_softplus, dt_limit).to(compute)
    Bh, Ch = _heads(B.to(compute), heads), _heads(C.to(compute), heads)
    a = A.to(compute)
    y = torch.empty(x.shape, dtype=compute, device=x.device)
    bounds = cu_seqlens.tolist()
    state_after = {}
    finals = []
    for s in range(len(bounds) - 1):
        h = (initial_states[s].to(compute) if initial_states is not None else
             torch.zeros(heads, head_dim, B.shape[-1], dtype=compute, device=x.device))
        for t in range(bounds[s], bounds[s + 1]):
            h = (torch.exp(steps[t] * a)[:, None, None] * h
                 + (steps[t][:, None] * x[t].to(compute))[:, :, None] * Bh[t][:, None, :])
            y[t] = (h * Ch[t][:, None, :]).sum(-1)
            state_after[t + 1] = h
        finals.append(h)
    y = _skip_and_gate(y, x, D, z)
    if chunk_ends is None:
        return y, torch.stack(finals)
    return y, torch.stack([state_after[int(e)] for e in chunk_ends])


@register_kernel("ssm_decode_step")
def ssm_decode_step(state, x, dt, A, B, C, slots, D=None, z=None, dt_bias=None,
                    dt_softplus=False, null_slot=-1, dst_slots=None) -> torch.Tensor:
    """One token per sequence: ``state[slots[i]]`` advanced by token ``i`` and stored
    at ``dst_slots[i]`` (default: in place), returns ``y [S, H, P]``. ``dt [S, H]``;
    slots equal to ``null_slot`` are padding (output zero, no state touched)."""
    dst = (slots if dst_slots is None else dst_slots).tolist()
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    steps = prepare_dt(dt, dt_bias, dt_softplus, (0.0, float("inf"))).to(compute)
    heads = x.shape[1]
    y = torch.zeros(x.shape, dtype=compute, device=x.device)
    for i, slot in enumerate(slots.tolist()):
        if slot == null_slot:
            continue
        h = state[slot].to(compute)
        h = (torch.exp(steps[i] * A.to(compute))[:, None, None] * h
             + (steps[i][:, None] * x[i].to(compute))[:, :, None]
             * _heads(B[i].to(compute), heads)[:, None, :])
        state[dst[i]] = h.to(state.dtype)
        y[i] = (h * _heads(C[i].to(compute), heads)[:, None, :]).sum(-1)
    return _skip_and_gate(y, x, D, z)


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return F.silu(y) if activation in ("silu", "swish") else y


@register_kernel("causal_conv1d")
def causal_conv1d(x, weight, bias, conv_states, cu_seqlens, slots, has_initial_state,
                  activation=None, null_slot=-1) -> torch.Tensor:
    """Depthwise causal convolution of packed sequences, ``x [dim, T]``, weight
    ``[dim, K]``: each sequence continues from ``conv_states[slot, :, :K-1]`` (its
    last ``K-1`` inputs) where ``has_initial_state``, else from zeros, and leaves its
    own last ``K-1`` inputs there. Returns ``[dim, T]``."""
    width = weight.shape[1] - 1
    out = torch.zeros_like(x)
    bounds = cu_seqlens.tolist()
    for s, slot in enumerate(slots.tolist()):
        if slot == null_slot or bounds[s] == bounds[s + 1]:
            continue
        seq = x[:, bounds[s]:bounds[s + 1]]
        start = (conv_states[slot, :, :width].to(x.dtype) if has_initial_state is not None
                 and bool(has_initial_state[s]) else x.new_zeros(x.shape[0], width))
        window = torch.cat([start, seq], dim=1)
        # (sliding windows, not F.conv1d: a card's torch may lack convolution)
        y = (window.to(weight.dtype).unfold(1, weight.shape[1], 1) * weight[:, None]).sum(-1)
        if bias is not None:
            y = y + bias[:, None]
        out[:, bounds[s]:bounds[s + 1]] = _activate(y, activation).to(x.dtype)
        conv_states[slot, :, :width] = window[:, -width:].to(conv_states.dtype)
    return out


@register_kernel("causal_conv1d_step")
def causal_conv1d_step(x, conv_states, weight, bias, slots, activation=None,
                       null_slot=-1) -> torch.Tensor:
    """One new input per sequence, ``x [S, dim]``: each convolved with its state's
    last ``K-1`` inputs, the state shifted by one. Returns ``[S, dim]``."""
    width = weight.shape[1] - 1
    out = torch.zeros_like(x)
    for i, slot in enumerate(slots.tolist()):
        if slot == null_slot:
            continue
        window = torch.cat([conv_states[slot, :, :width].to(x.dtype), x[i][:, None]], dim=1)
        y = (window.to(weight.dtype) * weight).sum(-1)
        if bias is not None:
            y = y + bias
        out[i] = _activate(y, activation).to(x.dtype)
        conv_states[slot, :, :width] = window[:, 1:].to(conv_states.dtype)
    return out


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(|x|^2 + eps)`` over the last dim, as vLLM's and HF's kernels have it."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


@register_kernel("gated_delta_rule")
def gated_delta_rule(q, k, v, g, beta, states, cu_seqlens, slots, has_initial_state=None,
                     null_slot=-1) -> torch.Tensor:
    """Gated DeltaNet's recurrence (Qwen3-Next / Qwen3.5 linear attention) over packed
    sequences, token by token. ``q``/``k [T, Hk, K]`` (each head's key heads shared by
    ``Hv / Hk`` value heads), ``v [T, Hv, V]``, ``g [T, Hv]`` (log decay), ``beta
    [T, Hv]``; ``states [slots, Hv, V, K]`` (read where ``has_initial_state``, else
    zeros; each sequence's final state written back). With q and k L2-normalised and q
    scaled by ``K ** -0.5``::

        S = exp(g_t) * S;  S += beta_t * (v_t - S k_t) (outer) k_t;  o_t = S q_t

    Returns ``o [T, Hv, V]``."""
    return delta_rule_over_sequences(_delta_tokens, q, k, v, g, beta, states, cu_seqlens,
                                     slots, has_initial_state, null_slot)


def _delta_tokens(q, k, v, g, beta, S):
    """One sequence token by token (``q``/``k``/``v [L, H, *]``, ``g``/``beta [L, H]``)."""
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    for t in range(v.shape[0]):
        S = torch.exp(g[t])[:, None, None] * S
        delta = beta[t][:, None] * (v[t] - (S @ k[t][:, :, None])[..., 0])
        S = S + delta[:, :, None] * k[t][:, None, :]
        out[t] = (S @ q[t][:, :, None])[..., 0]
    return out, S


def delta_rule_inputs(q, k, v, g, beta):
    """In float32 (float64 stays): q/k L2-normalised (q scaled by ``K ** -0.5``) and
    repeated over their value heads."""
    compute = torch.float64 if v.dtype == torch.float64 else torch.float32
    heads, key_dim = v.shape[1], q.shape[-1]
    q = (_l2norm(q.to(compute)) * key_dim ** -0.5).repeat_interleave(heads // q.shape[1], 1)
    k = _l2norm(k.to(compute)).repeat_interleave(heads // k.shape[1], 1)
    return q, k, v.to(compute), g.to(compute), beta.to(compute)


def delta_rule_over_sequences(sequence_fn, q, k, v, g, beta, states, cu_seqlens, slots,
                              has_initial_state, null_slot) -> torch.Tensor:
    """What every provider's ``gated_delta_rule`` shares: q/k normalised (q scaled) and
    repeated over their value heads, each sequence's state read from its slot or zeros,
    ``sequence_fn(q, k, v, g, beta, S) -> (o, S)`` run on it, the state written back."""
    q, k, v, g, beta = delta_rule_inputs(q, k, v, g, beta)
    heads, key_dim = v.shape[1], q.shape[-1]
    compute = v.dtype
    out = torch.zeros(v.shape, dtype=compute, device=v.device)
    bounds = cu_seqlens.tolist()
    for s, slot in enumerate(slots.tolist()):
        if slot == null_slot:
            continue
        S = (states[slot].to(compute) if has_initial_state is not None
             and bool(has_initial_state[s]) else
             torch.zeros(heads, v.shape[-1], key_dim, dtype=compute, device=v.device))
        rows = slice(bounds[s], bounds[s + 1])
        out[rows], S = sequence_fn(q[rows], k[rows], v[rows], g[rows], beta[rows], S)
        states[slot] = S.to(states.dtype)
    return out
