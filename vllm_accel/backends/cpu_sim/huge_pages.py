"""The simulated device's weights in 2 MiB pages.

A decode step streams every weight once, and with 4 KiB pages a single core's
read stream stalls on a page walk every 4 KiB (the STLB reaches ~8 MiB): measured
on an Intel Xeon (model 207), one core read 270 MB at 14.0-15.0 GB/s from 4 KiB
pages and 16.6-16.8 GB/s from 2 MiB pages. A card's memory has no such cost, so
the simulator asks Linux to back the model's parameters and buffers (what the
plugin's kernels read in place; weights vLLM hands to oneDNN live in oneDNN's own
buffers and are not covered) with transparent huge pages: ``MADV_HUGEPAGE`` on their
address ranges, then ``MADV_COLLAPSE`` (Linux >= 6.1) to rebuild the pages already
there in place. Nothing moves: the tensors keep their addresses and contents, and
whatever shares a huge page with a weight (glibc's heap) is collapsed with it
unchanged; the flagged heap ranges keep taking huge pages when reused. A kernel
without THP or ``MADV_COLLAPSE`` leaves the 4 KiB pages, which is only slower.
"""

import ctypes
import errno
import os
import time
from collections.abc import Iterable

import torch


def _pmd_huge_page() -> int:
    """The size of a transparent huge page here (2 MiB on x86-64)."""
    try:
        return int(open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size").read())
    except (OSError, ValueError):
        return 2 << 20


HUGE_PAGE = _pmd_huge_page()
_PAGE = os.sysconf("SC_PAGE_SIZE")
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25  # linux/mman.h, Linux 6.1
#: gaps up to this size between two weights are collapsed with them (heap
#: bookkeeping, small tensors), so neighbouring weights form one range
_MERGE_GAP = 64 << 10
#: smaller storages (norms, biases, scales) are left alone unless a merge covers them
_MIN_BYTES = 64 << 10


def storage_ranges(tensors: Iterable[torch.Tensor], min_bytes: int = _MIN_BYTES) -> list[tuple[int, int]]:
    """Sorted, merged, page-aligned [start, end) address ranges of the CPU storages
    of ``tensors`` that hold at least ``min_bytes``."""
    spans = set()
    for t in tensors:
        if t.device.type != "cpu" or t.is_meta:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() >= min_bytes:
            spans.add((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        start -= start % _PAGE
        end += -end % _PAGE
        if merged and start <= merged[-1][1] + _MERGE_GAP:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


#: MADV_COLLAPSE's EAGAIN is "temporary resource contention" (madvise(2)): seen while
#: other processes churned memory; tried again this many times, 20 ms apart
EAGAIN_RETRIES = 5


def _madvise(libc, start: int, end: int, advice: int) -> int:
    """0 or the errno of madvise(2) over [start, end) (EAGAIN: after retries)."""
    for attempt in range(EAGAIN_RETRIES + 1):
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice) == 0:
            return 0
        err = ctypes.get_errno()
        if err != errno.EAGAIN or attempt == EAGAIN_RETRIES:
            return err
        time.sleep(0.02)


def back_with_huge_pages(tensors: Iterable[torch.Tensor]) -> tuple[int, str | None]:
    """Ask for huge pages under the storages of ``tensors`` (those of 64 KiB or
    more, merged with their neighbours); returns (bytes of those ranges now in huge
    pages, at most; the first madvise error or None)."""
    return advise_huge_pages(storage_ranges(tensors))


def advise_huge_pages(ranges: list[tuple[int, int]]) -> tuple[int, str | None]:
    """``MADV_HUGEPAGE`` over page-aligned ``ranges``, then ``MADV_COLLAPSE`` over the
    whole huge pages inside each; returns what :func:`back_with_huge_pages` does."""
    if not ranges:
        return 0, None
    libc = ctypes.CDLL(None, use_errno=True)
    problem = None
    for start, end in ranges:
        # collapse works on whole huge pages: the ones inside the range. An unmapped
        # gap in a merged range fails MADV_HUGEPAGE with ENOMEM after it flagged the
        # mapped parts, so the collapse is tried regardless.
        inner = (start + -start % HUGE_PAGE, end - end % HUGE_PAGE)
        for (lo, hi), advice, name in (((start, end), MADV_HUGEPAGE, "MADV_HUGEPAGE"),
                                       (inner, MADV_COLLAPSE, "MADV_COLLAPSE")):
            err = _madvise(libc, lo, hi, advice) if lo < hi else 0
            if err:
                problem = problem or f"{name}: {errno.errorcode.get(err, err)} ({os.strerror(err)})"
    return huge_page_bytes(ranges), problem


def huge_page_bytes(ranges: list[tuple[int, int]]) -> int:
    """Bytes of ``ranges`` that /proc/self/smaps counts as anonymous huge pages: per
    mapping, its huge pages up to its overlap with the ranges (an upper bound where a
    mapping reaches past them; madvise splits mappings at the ranges' edges)."""
    total = 0
    try:
        smaps = open("/proc/self/smaps").read().splitlines()
    except OSError:
        return 0
    lo = hi = 0
    for line in smaps:
        if not line.strip():
            continue
        head = line.split(None, 1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
        elif head == "AnonHugePages:":
            huge = int(line.split()[1]) << 10
            if huge:
                overlap = sum(max(0, min(hi, end) - max(lo, start)) for start, end in ranges)
                total += min(huge, overlap)
    return total
