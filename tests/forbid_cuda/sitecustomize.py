"""Put on PYTHONPATH by the virtual-card tests: every public ``torch.cuda``
function and class raises when vLLM or vllm_accel calls it, and says so on
stderr, so a test that serves through the card path proves that path makes no
CUDA call. Other callers pass through: torch's internals (``torch.manual_seed``
seeds CUDA lazily) and libraries probing at import (triton, tvm_ffi), which a
card box has too. Active only with ``ACCEL_TEST_FORBID_CUDA=1``."""

import os
import sys


def _forbid() -> None:
    import torch
    import torch.cuda

    def off_the_card_path(depth: int) -> bool:
        """True unless the caller is vLLM or vllm_accel (the card path)."""
        caller = sys._getframe(depth).f_globals.get("__name__", "")
        return caller.split(".")[0] not in ("vllm", "vllm_accel")

    def refuse(name: str):
        caller = sys._getframe(2).f_globals.get("__name__", "?")
        message = f"FORBIDDEN_CUDA_CALL torch.cuda.{name} from {caller}"
        print(message, file=sys.stderr, flush=True)
        raise RuntimeError(message)

    def guard_function(name, fn):
        def guarded(*args, **kwargs):
            if not off_the_card_path(2):
                refuse(name)
            return fn(*args, **kwargs)

        guarded.__name__ = getattr(fn, "__name__", name)
        return guarded

    def guard_class(name, cls):
        def __new__(klass, *args, **kwargs):
            if not off_the_card_path(2):
                refuse(name)
            return cls.__new__(klass, *args, **kwargs) if cls.__new__ is not object.__new__ \
                else object.__new__(klass)

        return type(name, (cls,), {"__new__": __new__, "__module__": cls.__module__})

    guarded = 0
    for name in dir(torch.cuda):
        if name.startswith("_"):
            continue
        value = getattr(torch.cuda, name)
        if isinstance(value, type):
            try:
                setattr(torch.cuda, name, guard_class(name, value))
            except TypeError:  # a final type: guard its construction site instead
                setattr(torch.cuda, name, guard_function(name, value))
        elif callable(value) and not isinstance(value, type(torch)):
            setattr(torch.cuda, name, guard_function(name, value))
        else:
            continue
        guarded += 1
    print(f"FORBID_CUDA: {guarded} torch.cuda entry points raise for vLLM and vllm_accel",
          file=sys.stderr, flush=True)


if os.environ.get("ACCEL_TEST_FORBID_CUDA") == "1":
    _forbid()
