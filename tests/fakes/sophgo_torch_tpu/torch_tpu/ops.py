"""Fake torch.ops.my_ops: profiling hooks and rmsnorm_forward (calls counted)."""

import collections

import torch

# Kept on torch so a re-import (in-process tests) reuses the registered ops' state.
if not hasattr(torch, "_fake_my_ops_state"):
    torch._fake_my_ops_state = (collections.Counter(), [])
CALLS, PROFILE = torch._fake_my_ops_state
_REGISTERED = hasattr(torch, "_fake_my_ops_lib")
_lib = torch.library.Library("my_ops", "FRAGMENT") if not _REGISTERED else None
if not _REGISTERED:
    torch._fake_my_ops_lib = _lib
    _lib.define("enable_profile(int? max_record_num, int? mode) -> ()")
    _lib.define("disable_profile() -> ()")
    _lib.define("rmsnorm_forward(Tensor input, Tensor? scale, Tensor? bias, "
                "Tensor(a!) output, int axis, float eps) -> ()")


def enable_profile(max_record_num=None, mode=None):
    PROFILE.append(("enable", max_record_num, mode))


def disable_profile():
    PROFILE.append(("disable",))


def rmsnorm_forward(input, scale, bias, output, axis, eps):
    CALLS["rmsnorm_forward"] += 1
    h = input.float()
    h = h * torch.rsqrt(h.pow(2).mean(axis, keepdim=True) + eps)
    if scale is not None:
        h = h * scale.float()
    if bias is not None:
        h = h + bias.float()
    output.copy_(h)


if not _REGISTERED:
    _lib.impl("enable_profile", enable_profile, "CompositeExplicitAutograd")
    _lib.impl("disable_profile", disable_profile, "CompositeExplicitAutograd")
    for _key in ("PrivateUse1", "CPU"):
        _lib.impl("rmsnorm_forward", rmsnorm_forward, _key)
