"""Imported by the virtual GCU backend where the Enflame backend imports
``torch_gcu``, with the same side effects: PrivateUse1 renamed ``gcu``,
``torch.gcu``, ``Tensor.gcu()``/``.is_gcu`` and the ``eccl`` backend.

Devices: ``ACCEL_VIRTUAL_GCU_COUNT`` (8, like an S60 server) before
``TOPS_VISIBLE_DEVICES``; each holds ``ACCEL_SIM_DEVICE_MEMORY_GB`` of host
memory, capped by what the host can give (``ACCEL_SIM_HOST_MEMORY_FRACTION``).
"""

from vllm_accel import envs
from vllm_accel.backends.cpu_sim import CpuSimBackend
from vllm_accel.backends.virtual_gcu.device import install

# The simulated GCU's rule: ACCEL_SIM_DEVICE_MEMORY_GB, capped by the host.
gcu = install(envs.ACCEL_VIRTUAL_GCU_COUNT, CpuSimBackend().total_memory(0, 1))
__version__ = "virtual"
