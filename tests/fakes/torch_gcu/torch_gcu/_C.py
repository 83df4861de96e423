"""Fake torch_gcu._C: device counting and the ECCL process group (gloo inside)."""

import collections
import types

import torch.distributed as dist

_GcuDeviceProperties = collections.namedtuple(
    "_GcuDeviceProperties",
    "name major minor multi_processor_count total_memory max_threads_per_multi_processor "
    "sip_count")


def _state():
    from torch_gcu.gcu import state
    return state


def _gcu_getDeviceCount():
    return _state().count if _state().available else 0


def _gcu_setDevice(d):
    _state().current = d


def _gcu_getDevice():
    return _state().current


def _gcu_synchronize(d=None):
    _state().log.append(("synchronize", d))


def _c10d_gcu_init():
    return True


def _support_kineto_gcu():
    return False


def ProcessGroupECCL(store, rank, size, timeout):
    return dist.ProcessGroupGloo(store, rank, size, timeout)


_distributed_c10d = types.SimpleNamespace(ProcessGroupECCL=ProcessGroupECCL)
