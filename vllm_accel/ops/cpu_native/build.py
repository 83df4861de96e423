"""Compiles and loads the C++ kernels in ``csrc/`` (the ``cpu_native`` provider).

Why not one torch C++ extension: the kernels only need raw pointers, so they are a
plain C ABI built by the host's C++ compiler without torch's headers and callable
through ctypes. Only the thin layer that registers them with torch's dispatcher
(``csrc/torch_ops.cpp``: input checks and calls, so that no Python runs per call)
is built against torch, into its own library that links the kernel library
(:func:`torch_ops`, ~6 s once); where that fails, the ctypes paths run.

The library is built on first use, for this CPU (``-march=native``), into
``ACCEL_NATIVE_CACHE`` under a key of the source, compiler, flags, the CPU's
model and flags and what ``-march=native`` resolves to, and
reused afterwards (the rename into place is atomic, so ranks starting together
are safe). Without a compiler, or if the build fails, :func:`library` returns
``None`` once with a warning, and callers fall back to the torch kernels.
``-fopenmp`` links ``libgomp.so.1``; torch has already loaded its own copy under
that name, so both share one OpenMP runtime and thread count.
"""

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from vllm_accel import envs
from vllm_accel.logger import init_logger

logger = init_logger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "paged_attention.cpp", CSRC / "mla_decode.cpp", CSRC / "elementwise.cpp",
           CSRC / "int4_gemv.cpp", CSRC / "bf16_linear.cpp", CSRC / "int8_linear.cpp",
           CSRC / "lora.cpp")
HEADERS = (CSRC / "dtypes.h", CSRC / "entry_points.h", CSRC / "int8_codes.h", CSRC / "tiles.h",
           CSRC / "vec.h")
#: the dispatcher kernels of vllm_accel's torch.library ops (built against torch)
TORCH_OPS_SOURCE = CSRC / "torch_ops.cpp"
TORCH_OPS_FLAGS = ("-O2", "-std=c++17", "-fPIC", "-shared", "-w")
# -ffast-math: vectorized expf (glibc's libmvec) and reassociated sums in the
# readers, which never see inf/NaN from valid inputs (no -inf masking, finite
# scales); the cache writers opt out to stay bit-exact with the torch writers.
# All arithmetic is float32 (fp16/bf16 only loaded and stored): on CPUs with fp16
# units, fast-math would otherwise narrow it to fused fp16 instructions
# (test_native_kernels checks the code built for such a CPU).
# Compile only: linking with -ffast-math would add crtfastmath.o, whose constructor
# turns on flush-to-zero for the loading thread and so changes torch's numerics.
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-std=c++17", "-fPIC")
LINK_FLAGS = ("-shared", "-fopenmp")
#: dtype codes of the C ABI (csrc/dtypes.h)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_i64, _i32, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "accel_vector_lanes": (),
    "accel_paged_attention": (
        _i32, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i32, _i64, _i64, _i32, _i32, _i64,
        _ptr, _i64, _i64, _ptr, _ptr, _i32, _i32, _i32, _f32, _i32, _f32, _ptr, _ptr,
    ),
    "accel_cache_write": (
        _i32, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _i32, _i64, _i64, _ptr, _i64, _i32,
        _i32, _i32, _i64, _f32, _f32,
    ),
    "accel_rms_norm": (_i32, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i32, _f32),
    "accel_silu_and_mul": (_i32, _ptr, _i64, _ptr, _i64, _i64, _i32),
    "accel_lora_linear": (_i32, _ptr, _i64, _ptr, _i64, _i64, _i32, _ptr, _i32, _i32, _ptr,
                          _ptr, _ptr, _ptr, _ptr, _ptr, _i32, _f32),
    "accel_int4pack_gemv_available": (),
    "accel_int4pack_block_sizes": (),
    "accel_int4pack_amx_rows": (),
    "accel_int4pack_gemv": (_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i32, _i64, _i64, _i64,
                            _i32, _i32),
    "accel_int4pack_gemv_f32": (_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i32, _i64, _i64, _i64,
                                _i32),
    "accel_bf16_linear_available": (),
    "accel_bf16_linear_onednn_rows": (_i32,),
    "accel_bf16_linear_amx_rows": (),
    "accel_bf16_linear_dp_rows": (),
    "accel_bf16_linear": (_ptr, _i64, _i32, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64),
    "accel_int8_gemm_available": (),
    "accel_int8_gemm": (_ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _ptr, _i64),
    "accel_rotary": (_i32, _ptr, _i64, _ptr, _i64, _ptr, _i64, _i32, _i32, _i32, _i32, _ptr, _i64,
                     _i64),
}


def dtype_code(dtype: torch.dtype) -> int | None:
    """The C ABI's code for a tensor dtype, ``None`` if the kernels lack it."""
    return DTYPE_CODES.get(dtype)


def vector_lanes() -> int:
    """float32 lanes of the kernels' vector paths in this build: 16 (AVX-512), 8 (AVX2 +
    FMA + F16C), 0 (scalar paths only, or no library)."""
    lib = library()
    return lib.accel_vector_lanes() if lib is not None else 0


def compiler() -> str | None:
    """The C++ compiler: ``$CXX``, else ``c++``/``g++`` on PATH."""
    return next((c for c in (os.environ.get("CXX"), "c++", "g++") if c and shutil.which(c)),
                None)


def cpu_signature() -> str:
    """What ``-march=native`` depends on: the architecture, the CPU's model and flags.

    A checkout's cache can outlive the CPU (a machine may come back with another
    model), so a library built for one CPU must never be found under another's key.
    """
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = ("flags", "Features", "model name", "vendor_id", "CPU part")
    seen = {}
    for line in lines:
        name = line.split(":", 1)[0].strip()
        if name in wanted:
            seen.setdefault(name, line)
    return "\n".join([platform.machine(), platform.processor(), *seen.values()])


def _build(cxx: str) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    # FLAGS with the -march ACCEL_NATIVE_MARCH names (native unless overridden)
    march = f"-march={envs.ACCEL_NATIVE_MARCH}"
    flags = tuple(march if f == "-march=native" else f for f in FLAGS)
    # what that -march turns on, as the compiler resolves it on this CPU
    native_target = subprocess.run([cxx, march, "-Q", "--help=target"],
                                   capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join(
        [*(f.read_text() for f in SOURCES + HEADERS), cxx, version, " ".join(flags),
         " ".join(LINK_FLAGS), cpu_signature(), native_target]
    ).encode()).hexdigest()[:16]
    target = Path(envs.ACCEL_NATIVE_CACHE) / f"cpu_native-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [str(Path(tmp) / f"{src.stem}.o") for src in SOURCES]
        built = Path(tmp) / target.name
        steps = [[cxx, *flags, "-c", str(src), "-o", obj] for src, obj in zip(SOURCES, objects)]
        steps.append([cxx, *LINK_FLAGS, *objects, "-o", str(built)])
        for step in steps:
            result = subprocess.run(step, capture_output=True, text=True)
            if result.returncode:
                raise RuntimeError(f"{cxx} failed:\n{result.stderr[-4000:]}")
        os.replace(built, target)
    logger.info("Built the cpu_native kernels: %s", target)
    return target


def torch_flags() -> list[str]:
    """Compile and link flags for code built against the installed torch."""
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-L{root / 'lib'}", "-lc10", "-ltorch_cpu",
            f"-Wl,-rpath,{root / 'lib'}"]


def _build_torch_ops(cxx: str, kernels: Path) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join(
        [TORCH_OPS_SOURCE.read_text(), (CSRC / "entry_points.h").read_text(), kernels.name,
         cxx, version, " ".join(TORCH_OPS_FLAGS),
         torch.__version__, str(Path(torch.__file__).parent)]).encode()).hexdigest()[:16]
    target = kernels.parent / f"cpu_native_ops-{key}.so"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run(
            [cxx, *TORCH_OPS_FLAGS, str(TORCH_OPS_SOURCE), "-o", str(built), *torch_flags(),
             f"-L{kernels.parent}", f"-l:{kernels.name}", f"-Wl,-rpath,{kernels.parent}"],
            capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"{cxx} failed:\n{result.stderr[-4000:]}")
        os.replace(built, target)
    logger.info("Built the cpu_native torch ops: %s", target)
    return target


@functools.cache
def torch_ops() -> ctypes.CDLL | None:
    """Build (once) and load the dispatcher kernels of vllm_accel's ops
    (``csrc/torch_ops.cpp``); the library (for its C entry points), or ``None``
    (warned once) when the kernel library is off or this cannot be built: the ops'
    Python kernels then run."""
    lib = library()
    if lib is None:
        return None
    try:
        path = _build_torch_ops(compiler(), Path(lib._name))
        torch.ops.load_library(str(path))
        ops = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("Could not build the cpu_native torch ops (%s); their Python "
                       "kernels run instead (~10 us more a call).", exc)
        return None
    ops.accel_torch_ops_kernel_calls.argtypes = (ctypes.c_char_p, ctypes.POINTER(_i64))
    ops.accel_torch_ops_kernel_calls.restype = _i64
    ops.accel_torch_ops_set_int4pack_layout.argtypes = (_i32,)
    ops.accel_torch_ops_set_int4pack_layout.restype = None
    return ops


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or ``None`` (warned once) if it cannot be built."""
    if envs.ACCEL_NATIVE_CACHE.lower() in ("", "off", "0", "none"):
        return None
    cxx = compiler()
    if cxx is None:
        logger.warning("No C++ compiler found (set CXX or install g++): the cpu_native "
                       "attention kernels are off; using the torch kernels instead.")
        return None
    try:
        lib = ctypes.CDLL(str(_build(cxx)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("Could not build the cpu_native attention kernels (%s); using the "
                       "torch kernels instead.", exc)
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    if envs.ACCEL_NATIVE_MARCH != "native":  # (a warning: often logged before vLLM's logging is set up)
        logger.warning("cpu_native kernels built for -march=%s, not for this CPU "
                       "(ACCEL_NATIVE_MARCH)", envs.ACCEL_NATIVE_MARCH)
    return lib
