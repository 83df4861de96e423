"""Kernel registry: one name per kernel, several providers per name.

The device-agnostic layers (attention, quant, ops) never call a kernel directly;
they ask ``get_kernel(name)``. Every kernel has a ``reference`` provider written
in plain torch (the oracle tests compare against). A backend lists the providers
it prefers (e.g. ``("gcu_vendor", "torch_fast", "reference")``); the first one
that registered the kernel wins, so a real card can plug its own kernel in per op
and fall back to ours for the rest. The one exception to "every kernel has a
reference": a kernel that runs on a provider's own weight layout
(``wint_prepared_linear``) exists only for providers whose ``wint_prepare``
makes that layout, and a kernel that fuses a provider's own kernels
(``attention_step``) only for providers that offer it; callers pair them with
:func:`resolve_provider`.
"""

import os
from collections.abc import Callable
from typing import Any

import torch

from vllm_accel import envs

REFERENCE = "reference"

_KERNELS: dict[str, dict[str, Callable[..., Any]]] = {}
_preferred_providers: tuple[str, ...] = (REFERENCE,)
#: get_kernel's answers by name and raw ACCEL_KERNEL_PROVIDER: layers ask on every
#: forward, so the order is walked once per kernel instead of per call; emptied
#: whenever a registration or the preferred order changes
_resolved: dict[tuple, Callable[..., Any]] = {}


def register_kernel(name: str, provider: str = REFERENCE):
    """Decorator: register ``fn`` as ``provider``'s implementation of ``name``."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        _KERNELS.setdefault(name, {})[provider] = fn
        _resolved.clear()
        return fn

    return wrap


def set_preferred_providers(providers: tuple[str, ...]) -> None:
    """Called by the active device backend; ``reference`` is always the last resort."""
    global _preferred_providers
    _preferred_providers = tuple(p for p in providers if p != REFERENCE) + (REFERENCE,)
    _resolved.clear()


def providers_of(name: str) -> list[str]:
    return sorted(_KERNELS.get(name, {}))


def fallback_kernel(name: str, provider: str) -> Callable[..., Any]:
    """The next provider of ``name`` after ``provider`` in the preferred order (the
    first one when ``provider`` is not in it): a vendor kernel's way out for argument
    combinations it does not support. Always later in the order, so two providers that
    each hand a call on never hand it back and forth."""
    impls = _KERNELS.get(name, {})
    order = _preferred_providers
    after = order[order.index(provider) + 1:] if provider in order else order
    for p in after:
        if p in impls:
            return impls[p]
    return impls[REFERENCE]


def resolve_provider(name: str) -> str:
    """The provider ``get_kernel(name)`` picks (to pair a provider's kernels)."""
    impls = _KERNELS.get(name)
    if not impls:
        raise KeyError(f"no kernel named {name!r} is registered; known: {sorted(_KERNELS)}")
    forced = envs.ACCEL_KERNEL_PROVIDER
    order = ((forced,) if forced else ()) + _preferred_providers
    return next((p for p in order if p in impls), REFERENCE)


def get_kernel(name: str, provider: str | None = None) -> Callable[..., Any]:
    """The implementation of ``name`` for ``provider`` or the preferred order.

    ``ACCEL_KERNEL_PROVIDER`` forces one provider for every kernel it implements.
    """
    impls = _KERNELS.get(name)
    if not impls:
        raise KeyError(f"no kernel named {name!r} is registered; known: {sorted(_KERNELS)}")
    if provider is not None:
        if provider not in impls:
            raise KeyError(
                f"kernel {name!r} has no provider {provider!r}; it has {sorted(impls)}"
            )
        return impls[provider]
    # (the providers' dict and its size too: tests edit _KERNELS directly)
    key = (name, os.environ.get("ACCEL_KERNEL_PROVIDER"), id(impls), len(impls))
    fn = _resolved.get(key)
    if fn is None:
        fn = impls[resolve_provider(name)]
        # Not while torch.compile traces (a kernel that asks per call, e.g. W8A8's
        # activation quantizer): dynamo replays a traced dict write in the compiled
        # code, keyed by this process's id(), and the restart that loads that code
        # from vLLM's compile cache then failed on it with a KeyError.
        if not torch.compiler.is_compiling():
            _resolved[key] = fn
    return fn
