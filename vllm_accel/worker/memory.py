"""KV-cache sizing on a real card, from the vendor allocator's own numbers.

Kept free of vLLM and vendor imports so the arithmetic is testable anywhere.
"""

from dataclasses import dataclass

GiB = 1 << 30


@dataclass(frozen=True)
class CardMemory:
    """What the backend reported for one rank's card (bytes)."""

    total: int  #: capacity (Sophgo: mem_get_info()[1]; properties report 0)
    free: int  #: free now, all processes on the card counted
    weights: int  #: allocator growth while loading the model
    peak: int  #: allocator peak during the profiling forward pass (weights included)


def card_kv_bytes(mem: CardMemory, utilization: float, explicit: int | None, name: str) -> int:
    """Bytes for the KV cache: ``utilization`` of the card minus what this rank
    already peaked at, and never more than is free right now."""
    if mem.total <= 0:
        raise ValueError(f"Device {name} reports {mem.total} bytes of memory; the vendor "
                         "runtime is not answering memory queries.")
    if explicit is not None:
        if explicit > mem.free:
            raise ValueError(
                f"--kv-cache-memory-bytes={explicit} exceeds the {mem.free / GiB:.2f} GiB "
                f"free on device {name}; lower it.")
        return int(explicit)
    budget = int(mem.total * utilization)
    kv = min(budget - mem.peak, mem.free)
    if kv <= 0:
        raise ValueError(
            f"No room for a KV cache on device {name}: {mem.total / GiB:.2f} GiB x "
            f"gpu_memory_utilization {utilization} = {budget / GiB:.2f} GiB, but the model "
            f"peaked at {mem.peak / GiB:.2f} GiB (weights {mem.weights / GiB:.2f} GiB) and "
            f"{mem.free / GiB:.2f} GiB is free. Raise --gpu-memory-utilization or lower "
            "--max-num-batched-tokens.")
    return kv
