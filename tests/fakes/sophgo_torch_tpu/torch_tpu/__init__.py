"""Fake Sophgo torch_tpu (SG2260): the import contract and API shapes, on CPU.

Import side effects in torch_tpu's order: environment variables (CHIP_ARCH,
TPU_CACHE_BACKEND unless DISABLE_CACHE is non-empty, ...), PrivateUse1 renamed to
``tpu`` with ``torch.tpu`` (faithful mode) or only ``torch.tpu`` (lite mode),
``torch.ops.my_ops`` (profiling hooks, rmsnorm_forward) and the ``sccl`` backend
(extended API, over gloo, devices=["cpu"] -- documented deviation).
"""

import os
import sys

import torch
import torch.distributed as dist

MODE = os.environ.get("FAKE_VENDOR_MODE", "lite")
_here = os.path.dirname(__file__)

os.environ["CHIP_ARCH"] = os.environ.get("CHIP_ARCH", "sg2260")
os.environ["TPU_EMULATOR_PATH"] = os.path.join(_here, "lib", "sg2260_cmodel_firmware.so")
if not os.environ.get("DISABLE_CACHE"):
    os.environ["TPU_CACHE_BACKEND"] = os.environ["TPU_EMULATOR_PATH"]
os.environ["TorchTpuSaveKernelModule"] = "1"
os.environ["CHIP"] = "bm1690"

from torch_tpu import tpu  # noqa: E402
from torch_tpu import ops as _ops  # noqa: E402,F401  (registers torch.ops.my_ops)

state = tpu.state


class ProcessGroupSCCLOptions:
    def __init__(self):
        self.timeout = None
        self.chip_map = []


def _create_sccl(dist_opts, pg_options):
    state.log.append(("sccl_create", dist_opts.group_rank, dist_opts.group_size,
                      None if pg_options is None else list(pg_options.chip_map)))
    return dist.ProcessGroupGloo(dist_opts.store, dist_opts.group_rank, dist_opts.group_size,
                                 dist_opts.timeout)


if MODE == "faithful":
    torch.utils.rename_privateuse1_backend("tpu")
    torch._register_device_module("tpu", tpu)
    torch.utils.generate_methods_for_privateuse1_backend(
        for_tensor=True, for_module=True, for_storage=True)
else:
    torch.tpu = tpu
    sys.modules["torch.tpu"] = tpu
if "sccl" not in dist.Backend.backend_list:
    dist.Backend.register_backend("SCCL", _create_sccl, extended_api=True, devices=["cpu"])
state.log.append(("import", "torch_tpu", MODE))
