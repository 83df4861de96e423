"""Fake tops_extension.torch: records that it was imported before torch_gcu."""

import sys

IMPORTED_BEFORE_TORCH_GCU = "torch_gcu" not in sys.modules
