"""Static per-layer INT8 KV-cache scales (``ACCEL_KV_SCALES``).

The GCU fork ships calibrated per-tensor scales in an ``int8_kv_cache.json``. We
accept the same idea in this schema (layer index -> scales)::

    {"0": {"k_scale": 0.021, "v_scale": 0.013}, "1": {...}, ...}

``k_zero`` / ``v_zero`` may be given but must be 0: the cache is symmetric. With
the file, every token of a layer is quantized with that layer's constants instead
of its own absmax; without it, scales are dynamic per (token, head).
"""

import functools
import json
import math


def _scale(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where} must be a positive number, got {value!r}")
    return float(value)


@functools.cache
def load_kv_scales(path: str, num_layers: int) -> dict[int, tuple[float, float]]:
    """Layer index -> (k_scale, v_scale); errors name the file, the entry and the fix."""
    hint = (f"Fix {path} (schema: {{\"<layer>\": {{\"k_scale\": s, \"v_scale\": s}}}} for "
            f"layers 0..{num_layers - 1}) or unset ACCEL_KV_SCALES for dynamic scales.")
    try:
        with open(path) as f:
            raw = json.load(f)
    except OSError as e:
        raise ValueError(f"ACCEL_KV_SCALES: cannot read {path}: {e.strerror}. {hint}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"ACCEL_KV_SCALES: {path} is not valid JSON ({e}). {hint}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"ACCEL_KV_SCALES: {path} must hold a JSON object. {hint}")
    scales = {}
    for key, entry in raw.items():
        if not str(key).isdigit() or int(key) >= num_layers:
            raise ValueError(f"ACCEL_KV_SCALES: {path}: {key!r} is not a layer index of "
                             f"this model (0..{num_layers - 1}). {hint}")
        if not isinstance(entry, dict) or not {"k_scale", "v_scale"} <= entry.keys():
            raise ValueError(f"ACCEL_KV_SCALES: {path}: layer {key} needs k_scale and "
                             f"v_scale. {hint}")
        for zero in ("k_zero", "v_zero"):
            if entry.get(zero, 0) != 0:
                raise ValueError(f"ACCEL_KV_SCALES: {path}: layer {key} has {zero}="
                                 f"{entry[zero]}; the INT8 cache is symmetric, so zero "
                                 "points must be 0 (recalibrate symmetric scales).")
        where = f"ACCEL_KV_SCALES: {path}: layer {key}"
        scales[int(key)] = (_scale(entry["k_scale"], f"{where} k_scale"),
                            _scale(entry["v_scale"], f"{where} v_scale"))
    missing = sorted(set(range(num_layers)) - scales.keys())
    if missing:
        raise ValueError(f"ACCEL_KV_SCALES: {path} has no scales for layers {missing}. {hint}")
    return scales
