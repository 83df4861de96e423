"""Run a command as it runs on a CPU with less than this one: the plugin, torch,
oneDNN, inductor and stock vLLM all take the paths such a CPU takes, on this machine's
cores and memory, so one run compares them::

    python benchmarks/as_cpu.py avx512 python benchmarks/throughput.py --compile
    python benchmarks/as_cpu.py avx2 make test

- ``avx512``: an AVX512-BF16 CPU without AMX (an AMD EPYC Zen 4/5). On an Intel Xeon
  with AMX, Linux gives a process AMX tile state only when it asks
  (``arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)``): a seccomp filter refuses that
  request, inherited by every child process, so oneDNN, torch and the plugin's kernels
  (``amx::ready()``) take their AVX-512 paths.
- ``avx2``: an AVX2 + FMA + F16C CPU without AVX-512 (an AMD EPYC Zen 3): AMX refused
  as above, torch and inductor held to AVX2 (``ATEN_CPU_CAPABILITY=avx2``; inductor's
  generated C++ built for x86-64-v3, ``TORCHINDUCTOR_CPP_MARCH``: its AVX2 code built
  with ``-march=native`` on an AVX-512 CPU computed wrong int64 indices), oneDNN to
  AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``), the plugin's C++ kernels built for x86-64-v3
  (``ACCEL_NATIVE_MARCH``).
- ``baseline``: an x86-64 CPU with SSE2 only, for the kernels' scalar paths (torch's
  default kernels, the plugin's built for x86-64). vLLM's CPU wheel needs AVX2, so
  engines do not run this way; kernel tests do.

Either way ``as_cpu_site/`` goes on ``PYTHONPATH``, whose ``sitecustomize`` makes
torch's CPUID queries (``torch.cpu._is_amx_tile_supported()``, and with ``avx2`` the
AVX-512 ones) answer what such a CPU answers: stock vLLM picks its kernels
(``_C_AVX2``, its attention ISA) and inductor its vector ISA by them.

Linux x86-64 only (seccomp filters are per architecture; AMX is x86's).
"""

import ctypes
import getpass
import os
import struct
import sys
import tempfile
from pathlib import Path

ARCH_REQ_XCOMP_PERM = 0x1023
_SYS_ARCH_PRCTL = 158  # x86-64
_AUDIT_ARCH_X86_64 = 0xC000003E
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_LD_ABS_W, _JEQ_K, _RET_K = 0x20, 0x15, 0x06
_RET_ALLOW, _RET_EPERM = 0x7FFF0000, 0x00050000 | 1
SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "as_cpu_site")
#: what each mode exports (besides the seccomp filter and the site directory)
MODES = {
    "avx512": {"ACCEL_AS_CPU": "avx512"},
    "avx2": {"ACCEL_AS_CPU": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "ACCEL_NATIVE_MARCH": "x86-64-v3", "TORCHINDUCTOR_CPP_MARCH": "x86-64-v3"},
    "baseline": {"ACCEL_AS_CPU": "baseline", "ATEN_CPU_CAPABILITY": "default",
                 "ONEDNN_MAX_CPU_ISA": "SSE41", "ACCEL_NATIVE_MARCH": "x86-64",
                 "TORCHINDUCTOR_CPP_MARCH": "x86-64"},
}


def _filter() -> bytes:
    """BPF over ``seccomp_data`` (nr at 0, arch at 4, args[0] at 16): EPERM for
    ``arch_prctl(ARCH_REQ_XCOMP_PERM, ...)``, everything else allowed."""
    prog = [
        (_LD_ABS_W, 0, 0, 4),
        (_JEQ_K, 0, 5, _AUDIT_ARCH_X86_64),
        (_LD_ABS_W, 0, 0, 0),
        (_JEQ_K, 0, 3, _SYS_ARCH_PRCTL),
        (_LD_ABS_W, 0, 0, 16),
        (_JEQ_K, 0, 1, ARCH_REQ_XCOMP_PERM),
        (_RET_K, 0, 0, _RET_EPERM),
        (_RET_K, 0, 0, _RET_ALLOW),
    ]
    return b"".join(struct.pack("HBBI", *ins) for ins in prog)


def refuse_amx() -> None:
    """Refuse AMX tile state to this process and every process it starts."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        raise SystemExit("as_cpu: Linux x86-64 only")
    libc = ctypes.CDLL(None, use_errno=True)
    code = _filter()
    buf = ctypes.create_string_buffer(code, len(code))

    class _Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = _Prog(len(code) // 8, ctypes.addressof(buf))
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or libc.prctl(
            _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise SystemExit(f"as_cpu: seccomp filter refused: {os.strerror(ctypes.get_errno())}")


def environment(mode: str) -> dict[str, str]:
    """The variables a command run as ``mode``'s CPU gets: PYTHONPATH extended, and
    inductor's cache of its own (its FX-graph cache key leaves out the vector ISA, so
    code generated for AVX2 would be loaded by the next process on this CPU, and
    built with -march=native it corrupts memory)."""
    cache = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}_as_{mode}"
    return {**MODES[mode], "TORCHINDUCTOR_CACHE_DIR": str(cache),
            "PYTHONPATH": os.pathsep.join(p for p in (SITE, os.environ.get("PYTHONPATH")) if p)}


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] not in MODES:
        raise SystemExit(f"usage: as_cpu.py {{{'|'.join(MODES)}}} COMMAND...\n\n{__doc__}")
    refuse_amx()
    os.environ.update(environment(argv[0]))
    os.execvp(argv[1], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
