"""Fake torch_gcu.transfer_to_gcu: records that it was imported (vllm_accel must never)."""

import os

import torch

import torch_gcu

torch_gcu.is_transfer_to_gcu = True
torch_gcu.state.log.append(("import", "torch_gcu.transfer_to_gcu"))
os.environ["FAKE_TRANSFER_TO_GCU_IMPORTED"] = "1"
if os.environ.get("FAKE_TRANSFER_FULL_PATCH") == "1":
    torch.cuda.is_available = lambda: True
