"""On-disk cache of load-time repacked quantized weights.

Every weight-only format converts its checkpoint tensors into the resident
layout of :mod:`vllm_accel.quant.packed` at load. The cache stores each layer's
result under a key that hashes the *content* of the source tensors this process
loaded (its TP shard), the format and its conversion parameters, the plugin
version and the resident layout version. Hence:

* a changed checkpoint, a different TP rank/size, or a new plugin release gets
  a new key (automatic invalidation; nothing is keyed by directory name, so two
  models in directories of the same name never collide);
* concurrent TP ranks are safe: an entry is written to a unique temp file in
  the cache directory and published with ``os.replace`` (atomic on POSIX); a
  reader sees either no file or a complete one;
* an unreadable or inconsistent entry is treated as a miss and rewritten.

Location: ``ACCEL_REPACK_CACHE`` (default ``~/.cache/vllm-accel/repack``);
``off``/``0``/``none``/empty disables it. Old entries are not pruned
automatically (delete the directory to reclaim space).

Each process logs one summary line (layers reused / repacked and the time
spent) at the first forward of a quantized layer.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from vllm_accel import envs
from vllm_accel.logger import init_logger
from vllm_accel.quant.packed import LAYOUT_VERSION, WIntResident

logger = init_logger(__name__)


def _plugin_version() -> str:
    """The installed vllm-accel's version (part of every cache key: a release may
    change a conversion without changing the layout)."""
    try:
        return importlib.metadata.version("vllm-accel")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        return "source"

_DISABLED = ("", "0", "off", "none", "false", "no", "disable", "disabled")


def cache_dir() -> Path | None:
    """The cache directory, or None when disabled."""
    raw = envs.ACCEL_REPACK_CACHE
    if raw.lower() in _DISABLED:
        return None
    return Path(raw)


class _Stats:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.reused = self.repacked = self.failed_writes = 0
        self.seconds = 0.0
        self.logged = False
        self.formats: set[str] = set()


stats = _Stats()


def _hash_tensor(h, name: str, t: torch.Tensor | None) -> None:
    if t is None:
        h.update(f"{name}:none;".encode())
        return
    t = t.detach().contiguous().cpu()
    h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
    if t.numel():
        h.update(memoryview(t.view(torch.uint8).reshape(-1).numpy()))


def content_key(fmt: str, params: dict, sources: dict[str, torch.Tensor | None]) -> str:
    """sha256 over format, parameters, versions and the source tensors' bytes."""
    h = hashlib.sha256()
    head = {"fmt": fmt, "params": params, "plugin": _plugin_version(), "layout": LAYOUT_VERSION}
    h.update(json.dumps(head, sort_keys=True, default=str).encode())
    for name in sorted(sources):
        _hash_tensor(h, name, sources[name])
    return h.hexdigest()


def _meta(res: WIntResident) -> dict[str, str]:
    return {"bits": str(res.bits), "group_size": str(res.group_size),
            "in_features": str(res.in_features), "out_features": str(res.out_features)}


def _read(path: Path, key: str) -> WIntResident | None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("key") != key:
                return None
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        res = WIntResident(
            **{name: tensors.get(name) for name in WIntResident.TENSORS},
            bits=int(meta["bits"]), group_size=int(meta["group_size"]),
            in_features=int(meta["in_features"]), out_features=int(meta["out_features"]))
        if res.qweight is None or res.scales is None:
            return None
        return res
    except Exception as e:  # corrupt / truncated / foreign file: a miss
        logger.warning("repack cache: ignoring unreadable entry %s (%s)", path, e)
        return None


def _write(path: Path, key: str, fmt: str, res: WIntResident) -> None:
    from safetensors.torch import save_file

    tensors = {name: getattr(res, name).contiguous() for name in WIntResident.TENSORS
               if getattr(res, name) is not None}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        save_file(tensors, str(tmp), metadata={"key": key, "format": fmt, **_meta(res)})
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def cached_resident(fmt: str, params: dict, sources: dict[str, torch.Tensor | None],
                    convert: Callable[[], WIntResident]) -> WIntResident:
    """The resident weight for ``sources``: from the cache when an entry with the
    same content key exists, else ``convert()`` (then stored)."""
    t0 = time.perf_counter()
    stats.formats.add(fmt)
    root = cache_dir()
    if root is None:
        res = convert()
        stats.repacked += 1
        stats.seconds += time.perf_counter() - t0
        return res
    key = content_key(fmt, params, sources)
    path = root / f"{fmt}-{key[:40]}.safetensors"
    res = _read(path, key) if path.exists() else None
    if res is not None:
        stats.reused += 1
        stats.seconds += time.perf_counter() - t0
        return res
    res = convert()
    try:
        _write(path, key, fmt, res)
    except OSError as e:
        stats.failed_writes += 1
        if stats.failed_writes == 1:
            logger.warning("repack cache: cannot write %s (%s); continuing without "
                           "caching (set ACCEL_REPACK_CACHE to a writable directory or "
                           "'off')", root, e)
    stats.repacked += 1
    stats.seconds += time.perf_counter() - t0
    return res


def log_summary_once() -> None:
    """One line per process and load: layers reused / repacked and time (logged
    after loading, with the quant methods' summaries)."""
    if stats.logged or not (stats.reused or stats.repacked):
        return
    stats.logged = True
    root = cache_dir()
    logger.info("repack cache %s: %d layers reused / %d repacked (%s) in %.3f s",
                root if root is not None else "(disabled)", stats.reused, stats.repacked,
                ", ".join(sorted(stats.formats)), stats.seconds)
