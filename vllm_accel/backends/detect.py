"""Find the vendor libraries without importing them.

Importing ``torch_gcu`` renames PrivateUse1 and registers ``eccl``; importing a
``torch_tpu`` renames it to ``tpu`` -- and PyPI's ``torch-tpu`` is Google's
TorchTPU, an unrelated package with the same module name. Renaming happens once
per process, so detection must decide from the module spec and the distribution
metadata alone, and only the chosen backend's ``load()`` imports anything.
"""

import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_accel.logger import init_logger

logger = init_logger(__name__)

SOPHGO_HOME = "sophgo/torch-tpu"
GOOGLE_HOME = "google-pytorch/torch_tpu"


@dataclass(frozen=True)
class Detection:
    """Whether a vendor library is usable, and why (logged; shown in errors)."""

    found: bool
    reason: str


def _package_dir(module: str) -> Path | None:
    """The package directory of ``module``, found without importing it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    if locations:
        return Path(locations[0])
    return Path(spec.origin).parent if spec.origin else None


def _metadata(dist: str):
    try:
        return importlib.metadata.metadata(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _major_minor(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def detect_torch_gcu() -> Detection:
    """Enflame torch_gcu 2.x built for the installed torch."""
    pkg = _package_dir("torch_gcu")
    if pkg is None:
        return Detection(False, "torch_gcu is not installed")
    if any(pkg.glob("_GCUC*")):
        return Detection(False, f"torch_gcu at {pkg} is the legacy 1.x (XLA) package; "
                                "vllm_accel needs torch_gcu 2.x (TopsRider >= 3.x)")
    meta = _metadata("torch_gcu")
    if meta is None:
        return Detection(False, f"torch_gcu at {pkg} has no distribution metadata "
                                "(install it with pip from the TopsRider wheel)")
    version = meta["Version"] or ""
    gcu_mm, torch_mm = _major_minor(version), _major_minor(torch.__version__)
    if gcu_mm is None or gcu_mm[0] < 2:
        return Detection(False, f"torch_gcu {version} is not 2.x")
    if gcu_mm != torch_mm:
        return Detection(False, f"torch_gcu {version} is built for torch "
                                f"{gcu_mm[0]}.{gcu_mm[1]}, but torch {torch.__version__} "
                                "is installed; install the torch the TopsRider release names")
    return Detection(True, f"torch_gcu {version} at {pkg}")


def _torch_tpu_vendor(pkg: Path) -> tuple[str, str]:
    """('sophgo' | 'google' | 'unknown', evidence) for an installed ``torch_tpu``."""
    meta = _metadata("torch_tpu")
    author = (meta["Author"] or "").strip().lower() if meta else ""
    home = " ".join(filter(None, (meta.get("Home-page") if meta else None,
                                  *(meta.get_all("Project-URL") or [] if meta else []))))
    if author == "sophgo" or SOPHGO_HOME in home:
        return "sophgo", f"metadata Author={author!r} Home-page={home!r}"
    if (pkg / "tpu").is_dir() and any((pkg / "lib").glob("libtpudnn.*.so")):
        return "sophgo", f"{pkg} has tpu/ and lib/libtpudnn.*.so"
    if author == "torch team" or GOOGLE_HOME in home:
        return "google", f"metadata Author={author!r} Home-page={home!r}"
    if (pkg / "_internal").is_dir() and (pkg / "_loader.py").is_file():
        return "google", f"{pkg} has _internal/ and _loader.py"
    return "unknown", f"metadata Author={author!r} Home-page={home!r}"


def detect_sophgo_torch_tpu() -> Detection:
    """Sophgo torch_tpu (SG2260); Google's TorchTPU under the same name is ignored."""
    pkg = _package_dir("torch_tpu")
    if pkg is None:
        return Detection(False, "torch_tpu is not installed")
    vendor, evidence = _torch_tpu_vendor(pkg)
    if vendor == "sophgo":
        return Detection(True, f"Sophgo torch_tpu at {pkg} ({evidence})")
    if vendor == "google":
        logger.info(
            "Ignoring torch_tpu at %s: it is Google's TorchTPU from PyPI (%s), not "
            "Sophgo's torch_tpu. Install Sophgo's wheel (github.com/sophgo/torch-tpu "
            "releases) to serve an SG2260.", pkg, evidence)
        return Detection(False, f"torch_tpu at {pkg} is Google's TorchTPU (PyPI "
                                f"torch-tpu), not Sophgo's ({evidence})")
    return Detection(False, f"torch_tpu at {pkg} is not recognisably Sophgo's ({evidence})")
