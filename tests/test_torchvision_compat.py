"""PyPI's torchvision (a CUDA build) beside vLLM's CPU torch: without the import hook
``import vllm.config`` fails (transformers imports torchvision); with it, vLLM and
torchvision's transforms import, and its compiled ops say which wheel to install."""

import subprocess
import sys
import sysconfig
from pathlib import Path

from vllm_accel import torchvision_compat

DROP_HOOK = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path "
             "if type(f).__name__ != '_FirstLookup']; ")


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)


def test_setup_installed_the_hook():
    pth = Path(sysconfig.get_paths()["purelib"]) / torchvision_compat.PTH_NAME
    assert pth.read_text() == torchvision_compat.PTH_LINE


def test_without_the_hook_vllm_config_does_not_import():
    """What the hook is for (this environment's torchvision cannot load its ops)."""
    assert torchvision_compat.compiled_ops_library() is not None
    proc = run(DROP_HOOK + "import vllm.config")
    assert proc.returncode != 0
    assert "operator torchvision::nms does not exist" in proc.stderr


def test_with_the_hook_vllm_and_transforms_import():
    proc = run(
        "import vllm.config, torch, torchvision\n"
        "from torchvision.transforms.v2 import functional as F\n"
        "out = F.resize(torch.arange(48.).reshape(3, 4, 4), [2, 2], antialias=False)\n"
        "assert out.shape == (3, 2, 2), out.shape\n"
        "try:\n"
        "    torch.ops.torchvision.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)\n"
        "except RuntimeError as e:\n"
        "    print('NMS:', e)\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "NMS: torchvision's compiled ops do not load" in proc.stdout
    assert "download.pytorch.org/whl/cpu" in proc.stdout


def test_defined_once_and_left_alone_when_the_operators_exist(monkeypatch):
    """Idempotent; and where ``torchvision::nms`` already exists (a torchvision whose
    ops loaded, or here our definition from the hook) nothing is defined again."""
    import torchvision  # noqa: F401

    assert torchvision_compat.ensure_importable() is True  # the hook defined them
    monkeypatch.setattr(torchvision_compat, "_library", None)
    assert torchvision_compat.ensure_importable() is False
