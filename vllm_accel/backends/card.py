"""Shared part of the real-card backends: a device module shaped like ``torch.cuda``.

Both vendors expose ``torch.<device>`` (``torch.gcu``, ``torch.tpu``) after their
library is imported. Everything here goes through that module, loaded on first
use, so constructing a backend (detection, the platform class attributes) never
imports a vendor library; ``load()`` does, once per process.
"""

import contextlib
import importlib
import importlib.util
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

from vllm_accel.logger import init_logger

logger = init_logger(__name__)

_load_lock = threading.Lock()


def load_kernel_extension(package: str, module: str) -> Path | None:
    """Load ``package/module`` (a torch op library) without running ``package``'s
    ``__init__``, which for vendor vLLM plugins (vllm_gcu) patches vLLM for their
    own platform. A compiled ``module*.so`` goes through ``torch.ops.load_library``
    (its static initializers register the ops); a pure-Python ``module.py`` that
    registers ops with ``torch.library`` is executed as ``package.module``.
    """
    from vllm_accel.backends.detect import _package_dir

    pkg = _package_dir(package)
    if pkg is None:
        return None
    libraries = sorted(pkg.glob(f"{module}.*so")) + sorted(pkg.glob(f"{module}.so"))
    if libraries:
        torch.ops.load_library(str(libraries[0]))
        return libraries[0]
    source = pkg / f"{module}.py"
    if not source.is_file():
        return None
    qualname = f"{package}.{module}"
    if qualname not in sys.modules:
        spec = importlib.util.spec_from_file_location(qualname, source)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[qualname] = mod
        spec.loader.exec_module(mod)
    return source


class CardBackend:
    """Base for backends whose tensors live on a vendor PrivateUse1 device."""

    is_real_card = True
    worker_cls = "vllm_accel.worker.card_worker.AccelCardWorker"
    dispatch_key = "PrivateUse1"
    #: name the vendor renames PrivateUse1 to (``torch.device(<this>)``)
    torch_device_type: str
    #: modules ``load()`` imports, in order (optional ones may be missing)
    vendor_modules: tuple[str, ...] = ()
    optional_vendor_modules: frozenset[str] = frozenset()
    #: (package, module) of kernel extensions loaded after the vendor library, if present
    kernel_extensions: tuple[tuple[str, str], ...] = ()

    def __init__(self, detection_reason: str = "") -> None:
        self.detection_reason = detection_reason
        self._loaded = False
        self.loaded_kernel_modules: list[str] = []

    # ----- lifecycle -------------------------------------------------------

    def load(self) -> None:
        """Import the vendor library (and kernel extensions); idempotent.

        Must run before ``torch.distributed`` initializes, because importing the
        library registers its collective backend.
        """
        if self._loaded:
            return
        with _load_lock:
            if self._loaded:
                return
            for name in self.vendor_modules:
                try:
                    importlib.import_module(name)
                except ImportError:
                    if name in self.optional_vendor_modules:
                        continue
                    raise
            actual = torch._C._get_privateuse1_backend_name()
            if actual != self.torch_device_type:
                raise RuntimeError(
                    f"{self.vendor_modules[-1]} was imported but PrivateUse1 is named "
                    f"{actual!r}, not {self.torch_device_type!r}: another library "
                    "claimed it first (is Google's torch_tpu or torch_gcu autoloading? "
                    "export TORCH_DEVICE_BACKEND_AUTOLOAD=0)."
                )
            for package, module in self.kernel_extensions:
                path = load_kernel_extension(package, module)
                if path is None:
                    logger.info("Vendor kernel extension %s.%s not installed; vllm_accel's "
                                "torch kernels are used instead.", package, module)
                else:
                    self.loaded_kernel_modules.append(f"{package}.{module}")
            self._loaded = True
            self._after_load()
            logger.info("Loaded %s (%s)", self.vendor_modules[-1], self.detection_reason)

    def _after_load(self) -> None:
        """Backend-specific set-up right after the import."""

    @property
    def vendor_library(self) -> ModuleType:
        """The vendor library itself (``torch_gcu``, ``torch_tpu``), for what it
        offers beside ``torch.<device>`` (e.g. collective options)."""
        self.load()
        return sys.modules[self.vendor_modules[-1]]

    @property
    def mod(self) -> ModuleType:
        """``torch.<device>``: the vendor's torch.cuda look-alike."""
        self.load()
        return getattr(torch, self.torch_device_type)

    # ----- device ----------------------------------------------------------

    def torch_device(self, local_rank: int | None = None) -> torch.device:
        """``<type>:<local_rank>``, or the current device's (no index: an index
        read back from the vendor may already be mapped, e.g. through CHIP_MAP)."""
        if local_rank is None:
            return torch.device(self.torch_device_type)
        return torch.device(self.torch_device_type, local_rank)

    def device_count(self) -> int:
        return int(self.mod.device_count())

    def set_device(self, local_rank: int) -> None:
        self.mod.set_device(local_rank)

    def current_device(self) -> int:
        return int(self.mod.current_device())

    def synchronize(self) -> None:
        self.mod.synchronize()

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.mod.manual_seed_all(seed)

    def device_properties_name(self) -> str:
        return str(self.mod.get_device_name(self.current_device()))

    # ----- memory ----------------------------------------------------------

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the *current* device (all vendors support that)."""
        free, total = self.mod.mem_get_info()
        return int(free), int(total)

    def memory_allocated(self) -> int:
        return int(self.mod.memory_allocated())

    def max_memory_allocated(self) -> int:
        return int(self.mod.max_memory_allocated())

    def reset_peak_memory_stats(self) -> None:
        self.mod.reset_peak_memory_stats()

    def empty_cache(self) -> None:
        self.mod.empty_cache()

    def total_memory(self, local_rank: int, local_world_size: int) -> int:
        """The card's memory; the worker calls this after ``set_device(local_rank)``."""
        return self.mem_get_info()[1]

    # ----- distributed / profiling / ops -------------------------------------

    @contextlib.contextmanager
    def distributed_init(self, rank: int, local_rank: int, world_size: int):
        """Wraps vLLM's ``init_distributed_environment`` (options the backend needs)."""
        self.load()
        yield

    def profiler(self) -> contextlib.AbstractContextManager:
        return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    def op(self, qualname: str):
        """The vendor kernel ``ns::name`` if a PrivateUse1 implementation is registered."""
        self.load()
        try:
            has = torch._C._dispatch_has_kernel_for_dispatch_key(qualname, self.dispatch_key)
        except RuntimeError:  # operator does not exist
            return None
        if not has:
            return None
        ns, name = qualname.split("::")
        return getattr(getattr(torch.ops, ns), name).default

    def process_env(self, local_world_size: int) -> dict[str, str]:
        return {}
