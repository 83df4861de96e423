"""Fake Enflame torch_gcu 2.x: the import-time contract and API shapes, on CPU.

Side effects in torch_gcu's order: autoload variable, PrivateUse1 rename + device
module (faithful mode) or a plain ``torch.gcu`` attribute (lite mode),
``is_eccl_available``, the ``eccl`` backend (over gloo, devices=["cpu"]: tensors
stay on CPU -- a documented deviation).
"""

import os
import sys

import torch
import torch.distributed as dist

_saved_autoload = os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD")
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"

__version__ = "2.10.0"
is_transfer_to_gcu = False
MODE = os.environ.get("FAKE_VENDOR_MODE", "lite")

from torch_gcu import _C, distributed, gcu  # noqa: E402

state = gcu.state


def _autoload():
    if _saved_autoload is None:
        os.environ.pop("TORCH_DEVICE_BACKEND_AUTOLOAD", None)
    else:
        os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = _saved_autoload


def launch_host_func(fn, *args):
    fn(*args)


def _create_eccl(store, rank, size, timeout):
    state.log.append(("eccl_create", rank, size))
    return _C._distributed_c10d.ProcessGroupECCL(store, rank, size, timeout)


def _install():
    if MODE == "faithful":
        torch.utils.rename_privateuse1_backend("gcu")
        torch._register_device_module("gcu", gcu)
        torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
    else:
        torch.gcu = gcu
        sys.modules["torch.gcu"] = gcu
    dist.is_eccl_available = lambda: True
    if "eccl" not in dist.Backend.backend_list:
        dist.Backend.register_backend("eccl", _create_eccl, devices=["cpu"])
    state.log.append(("import", "torch_gcu", MODE))


_install()
_autoload()
