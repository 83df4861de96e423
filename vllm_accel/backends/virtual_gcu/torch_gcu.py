"""Imported by the virtual GCU backend where the Enflame backend imports
``torch_gcu``, with the same side effects: PrivateUse1 renamed ``gcu``,
``torch.gcu``, ``Tensor.gcu()``/``.is_gcu`` and the ``eccl`` backend.

Devices: ``ACCEL_VIRTUAL_GCU_COUNT`` (8, like an S60 server) before
``TOPS_VISIBLE_DEVICES``; each holds ``ACCEL_SIM_DEVICE_MEMORY_GB`` of host
memory, capped by what the host can give (``ACCEL_SIM_HOST_MEMORY_FRACTION``).
"""

import psutil

from vllm_accel import envs
from vllm_accel.backends.virtual_gcu.device import install
from vllm_accel.envs import GiB

_capacity = min(int(envs.ACCEL_SIM_DEVICE_MEMORY_GB * GiB),
                int(psutil.virtual_memory().available * envs.ACCEL_SIM_HOST_MEMORY_FRACTION))
if _capacity <= 0:
    raise ValueError("ACCEL_SIM_DEVICE_MEMORY_GB must be positive (the virtual GCU's memory "
                     f"in GiB); got {envs.ACCEL_SIM_DEVICE_MEMORY_GB}.")
gcu = install(envs.ACCEL_VIRTUAL_GCU_COUNT, _capacity)
__version__ = "virtual"
