"""Put the fake vendor libraries (tests/fakes/) on the path -- in-process ("lite")
or for a fresh interpreter ("faithful": PrivateUse1 really renamed)."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import torch

FAKES = Path(__file__).parent / "fakes"
TORCH_MM = ".".join(torch.__version__.split(".")[:2])
VENDOR_MODULES = ("torch_gcu", "torch_tpu", "tops_extension", "vllm_gcu", "torch.gcu", "torch.tpu")


def torch_gcu_dist_info(site: Path, version: str | None = None) -> Path:
    """torch_gcu's dist-info: ``<torch major.minor>.0+<tops tag>`` like the real wheel."""
    version = version or f"{TORCH_MM}.0+3.7.1"
    info = site / f"torch_gcu-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: torch_gcu\nVersion: {version}\nAuthor: Enflame\n")
    (info / "top_level.txt").write_text("torch_gcu\n")
    return site


def paths(kind: str, tmp_path: Path, gcu_version: str | None = None) -> list[str]:
    """sys.path entries for ``kind``: gcu, gcu+ops, sophgo, google, google+gcu, sophgo+gcu."""
    out: list[str] = []
    for part in kind.split("+"):
        if part == "gcu":
            out += [str(torch_gcu_dist_info(tmp_path / "gcu-site", gcu_version)),
                    str(FAKES / "torch_gcu")]
        elif part == "ops":
            out.append(str(FAKES / "vllm_gcu_ops"))
        elif part == "sophgo":
            out.append(str(FAKES / "sophgo_torch_tpu"))
        elif part == "google":
            out.append(str(FAKES / "google_torch_tpu"))
        else:
            raise ValueError(part)
    return out


def install_lite(monkeypatch, kind: str, tmp_path: Path, **kw) -> None:
    """Make the fakes importable in this process; undone by monkeypatch (plus the
    cleanup in ``forget_vendor_modules``)."""
    monkeypatch.setenv("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    monkeypatch.setenv("FAKE_VENDOR_MODE", "lite")
    for p in reversed(paths(kind, tmp_path, **kw)):
        monkeypatch.syspath_prepend(p)
    importlib.invalidate_caches()


def forget_vendor_modules() -> None:
    for name in list(sys.modules):
        if name.split(".")[0] in VENDOR_MODULES or name in VENDOR_MODULES:
            del sys.modules[name]
    for attr in ("gcu", "tpu"):
        if attr in vars(torch):
            delattr(torch, attr)
    importlib.invalidate_caches()


def run_faithful(code: str, kind: str, tmp_path: Path, env: dict | None = None,
                 timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with the fakes in faithful mode."""
    full_env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "FAKE_VENDOR_MODE": "faithful",
                "PYTHONPATH": os.pathsep.join(paths(kind, tmp_path) + [os.environ.get("PYTHONPATH", "")]),
                **(env or {})}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, env=full_env)
