"""Run a command as it runs on an AVX512-BF16 CPU without AMX (an AMD EPYC Zen 4/5).

On an Intel Xeon with AMX, Linux gives a process AMX tile state only when it asks
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)``). This installs a seccomp filter that
refuses that request, inherited by every child process, so oneDNN, torch and the
plugin's kernels (``amx::ready()``) take their AVX-512 paths, and puts
``without_amx_site/`` on ``PYTHONPATH``, whose ``sitecustomize`` makes
``torch.cpu._is_amx_tile_supported()`` answer False (it reads CPUID only; stock vLLM
picks its AMX attention kernels by it). Both the plugin and stock vLLM then run what
they run on a CPU without AMX, on this machine's cores and memory::

    python benchmarks/without_amx.py python benchmarks/throughput.py --compile

Linux x86-64 only (seccomp filters are per architecture; AMX is x86's).
"""

import ctypes
import os
import struct
import sys

ARCH_REQ_XCOMP_PERM = 0x1023
_SYS_ARCH_PRCTL = 158  # x86-64
_AUDIT_ARCH_X86_64 = 0xC000003E
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_LD_ABS_W, _JEQ_K, _RET_K = 0x20, 0x15, 0x06
_RET_ALLOW, _RET_EPERM = 0x7FFF0000, 0x00050000 | 1
SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "without_amx_site")


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
        raise SystemExit("without_amx: Linux x86-64 only")
    libc = ctypes.CDLL(None, use_errno=True)
    code = _filter()
    buf = ctypes.create_string_buffer(code, len(code))

    class _Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = _Prog(len(code) // 8, ctypes.addressof(buf))
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or libc.prctl(
            _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise SystemExit(f"without_amx: seccomp filter refused: {os.strerror(ctypes.get_errno())}")


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    refuse_amx()
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (SITE, os.environ.get("PYTHONPATH")) if p)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
