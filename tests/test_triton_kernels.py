"""The ``triton`` provider's kernels vs. float64 oracles (cases: ``triton_kernel_cases``).

On a GPU they run here, on device tensors, with only torch, triton and pytest
installed::

    ACCEL_TEST_DEVICE=cuda python -m pytest -q tests/test_triton_kernels.py

On CPU they need Triton's interpreter, which Triton binds when a kernel is defined
(``TRITON_INTERPRET=1`` at import) and reads while it runs: CI runs the cases in a
pytest of their own with the variable set, so it never reaches another test's
engine subprocess (where a card backend would then pick interpreted kernels).
"""

import os
import subprocess
import sys
from pathlib import Path

DEVICE = os.environ.get("ACCEL_TEST_DEVICE", "cpu")

if DEVICE != "cpu" or os.environ.get("TRITON_INTERPRET") == "1":
    from triton_kernel_cases import *  # noqa: F401,F403  (pytest collects the cases)
else:
    from conftest import on_worker_core

    def test_triton_kernels_in_the_interpreter():
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
            cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=900,
            env={**os.environ, "TRITON_INTERPRET": "1"}, preexec_fn=on_worker_core())
        summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
        assert proc.returncode == 0 and " passed" in summary, proc.stdout[-8000:] + proc.stderr[-2000:]
        print(summary)
