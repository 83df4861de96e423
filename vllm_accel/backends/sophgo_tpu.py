"""Sophgo SG2260 through Sophgo's ``torch_tpu`` (tpuv7-runtime).

The device is called ``sophtpu`` here (vLLM already has a ``tpu`` platform);
torch's device type is ``tpu`` because torch_tpu renames PrivateUse1 to it.
Quirks handled (see shared notes, vendor-apis section 2):

* ``CHIP_MAP`` maps *local rank* -> physical chip inside ``torch.tpu.set_device``;
  we always pass local ranks and never map ourselves (that would map twice).
* ``get_device_properties().total_memory`` is 0, so capacity comes from
  ``mem_get_info()`` (which only answers for the current device).
* ``sccl`` needs ``ProcessGroupSCCLOptions`` with a chip map, and the chip map
  and device set before ``init_process_group``.
* ``torch.ops.my_ops.enable_profile``/``disable_profile`` are the profiler hooks.
"""

import contextlib
import os

import torch

from vllm_accel import patches
from vllm_accel.backends.card import CardBackend
from vllm_accel.logger import init_logger

logger = init_logger(__name__)

#: my_ops.enable_profile's mode for book-keeping records (what vllm-sophon uses)
PROFILE_BOOK_KEEPING = 1
PROFILE_MAX_RECORDS = 1_000_000


def parse_chip_map(raw: str | None) -> list[int] | None:
    """``CHIP_MAP`` -> chip per local rank; a clear error on anything else."""
    if raw is None or raw.strip() == "":
        return None
    try:
        chips = [int(x) for x in raw.split(",")]
    except ValueError:
        raise ValueError(f"CHIP_MAP={raw!r} must be a comma list of chip ids, one per "
                         "local rank (e.g. CHIP_MAP=4,5,6,7)") from None
    if len(set(chips)) != len(chips) or min(chips) < 0:
        raise ValueError(f"CHIP_MAP={raw!r} lists a chip twice or a negative id")
    return chips


class SophgoTpuBackend(CardBackend):
    name = "sophtpu"
    device_name = "sophtpu"
    torch_device_type = "tpu"
    dist_backend = "sccl"
    # A rank -> chip map, not a filter; vLLM's DP launcher writes a chip list here,
    # which read as a map gives each DP rank its chips.
    visible_devices_env = "CHIP_MAP"
    kernel_providers = ("sophgo_vendor", "triton", "torch_fast")
    vendor_modules = ("torch_tpu",)

    def describe(self) -> str:
        return f"Sophgo SG2260 via torch_tpu ({self.detection_reason})"

    def device_count(self) -> int:
        """Chips this process may use: torch_tpu does no visibility filtering, so
        with CHIP_MAP set only the mapped chips count."""
        physical = int(self.mod.device_count())
        chips = parse_chip_map(os.environ.get("CHIP_MAP"))
        if chips is None:
            return physical
        missing = [c for c in chips if c >= physical]
        if missing:
            raise ValueError(f"CHIP_MAP={os.environ['CHIP_MAP']!r} names chips {missing}, "
                             f"but torch_tpu sees {physical} chips (0..{physical - 1}).")
        return len(chips)

    def set_device(self, local_rank: int) -> None:
        # torch_tpu maps local_rank through CHIP_MAP itself.
        self.mod.set_device(local_rank)

    def total_memory(self, local_rank: int, local_world_size: int) -> int:
        # get_device_properties().total_memory is hard-coded to 0 in torch_tpu.
        total = self.mem_get_info()[1]
        if total <= 0:
            raise RuntimeError(f"torch.tpu.mem_get_info() reported {total} bytes for "
                               f"local rank {local_rank}; is the tpuv7 runtime running?")
        return total

    def device_capability(self) -> tuple[int, int] | None:
        return None  # torch_tpu returns None (and warns)

    def sccl_options(self, world_size: int):
        """ProcessGroupSCCLOptions for the world group: local ranks as the chip map."""
        opts = self.vendor_library.ProcessGroupSCCLOptions()
        opts.chip_map = list(range(world_size))
        return opts

    @contextlib.contextmanager
    def distributed_init(self, rank: int, local_rank: int, world_size: int):
        """Set the chip map and device, and pass the SCCL options to the world
        group's ``init_process_group`` (vLLM's init has no ``pg_options``)."""
        self.load()
        opts = self.sccl_options(world_size)
        self.mod.set_chip_map(opts)
        self.set_device(local_rank)
        with patches.applied("sccl_init", dist_backend=self.dist_backend, pg_options=opts):
            yield

    @contextlib.contextmanager
    def _my_ops_profile(self):
        my_ops = torch.ops.my_ops
        my_ops.enable_profile(PROFILE_MAX_RECORDS, PROFILE_BOOK_KEEPING)
        try:
            yield
        finally:
            my_ops.disable_profile()

    def profiler(self) -> contextlib.AbstractContextManager:
        self.load()
        return self._my_ops_profile()
