"""Backend selection and the real-card backends against in-process ("lite") fakes.

Detection must decide from metadata without importing a vendor library; loading
must import torch_gcu (after tops_extension.torch) but never transfer_to_gcu.
Fakes: tests/fakes/ (see vendor_fakes.py); TORCH_DEVICE_BACKEND_AUTOLOAD=0.
"""

import logging
import sys

import pytest
import torch

from vendor_fakes import forget_vendor_modules, install_lite
from vllm_accel.backends import detect, select_backend
from vllm_accel.worker.memory import CardMemory, card_kv_bytes

GiB = 1 << 30


@pytest.fixture(autouse=True)
def clean_vendor_modules(monkeypatch):
    monkeypatch.setenv("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    for var in ("TOPS_VISIBLE_DEVICES", "CHIP_MAP", "FAKE_TRANSFER_TO_GCU_IMPORTED"):
        monkeypatch.delenv(var, raising=False)
    forget_vendor_modules()
    yield
    forget_vendor_modules()


@pytest.fixture
def renamed(monkeypatch):
    """Lite mode cannot rename PrivateUse1 in-process; report the vendor's name."""
    def rename(name):
        monkeypatch.setattr(torch._C, "_get_privateuse1_backend_name", lambda: name)
    return rename


def test_no_vendor_library_selects_the_simulator():
    assert not detect.detect_torch_gcu().found
    assert not detect.detect_sophgo_torch_tpu().found
    assert select_backend("auto").name == "sim"
    assert select_backend("sim").name == "sim"


@pytest.mark.parametrize("choice,needle", [("gcu", "torch_gcu is not installed"),
                                           ("sophtpu", "torch_tpu is not installed")])
def test_forcing_a_missing_backend_is_a_clear_error(choice, needle):
    with pytest.raises(RuntimeError, match=f"ACCEL_BACKEND={choice} .*{needle}.*Fix: install"):
        select_backend(choice)


def test_unknown_choice_lists_the_choices():
    with pytest.raises(ValueError, match="auto, sim, gcu, sophtpu"):
        select_backend("npu")


def test_torch_gcu_is_detected_without_importing_it(monkeypatch, tmp_path):
    install_lite(monkeypatch, "gcu", tmp_path)
    backend = select_backend("auto")
    assert (backend.name, backend.torch_device_type, backend.dist_backend) == ("gcu", "gcu", "eccl")
    assert backend.visible_devices_env == "TOPS_VISIBLE_DEVICES"
    assert "torch_gcu" not in sys.modules and "tops_extension" not in sys.modules


def test_torch_gcu_for_another_torch_is_rejected(monkeypatch, tmp_path):
    install_lite(monkeypatch, "gcu", tmp_path, gcu_version="1.99.0+2.0")
    d = detect.detect_torch_gcu()
    assert not d.found and "not 2.x" in d.reason
    forget_vendor_modules()
    install_lite(monkeypatch, "gcu", tmp_path / "b", gcu_version="2.1.0+3.0")
    d = detect.detect_torch_gcu()
    assert not d.found and "built for torch 2.1" in d.reason
    assert select_backend("auto").name == "sim"


def test_google_torch_tpu_is_ignored_with_a_log_line(monkeypatch, tmp_path):
    install_lite(monkeypatch, "google", tmp_path)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("vllm.vllm_accel.backends.detect")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        d = detect.detect_sophgo_torch_tpu()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert not d.found and "Google's TorchTPU" in d.reason
    assert any("Ignoring torch_tpu" in r.getMessage() for r in records)
    assert select_backend("auto").name == "sim"
    with pytest.raises(RuntimeError, match="Google's TorchTPU"):
        select_backend("sophtpu")
    assert "torch_tpu" not in sys.modules


def test_sophgo_torch_tpu_is_detected_from_its_metadata(monkeypatch, tmp_path):
    install_lite(monkeypatch, "sophgo", tmp_path)
    backend = select_backend("auto")
    assert (backend.name, backend.device_name, backend.torch_device_type) == ("sophtpu", "sophtpu", "tpu")
    assert backend.device_name != "tpu"  # vLLM's own TPU platform name
    assert (backend.dist_backend, backend.visible_devices_env) == ("sccl", "CHIP_MAP")
    assert "Author='sophgo'" in backend.detection_reason
    assert "torch_tpu" not in sys.modules


def test_both_vendors_need_an_explicit_choice(monkeypatch, tmp_path):
    install_lite(monkeypatch, "gcu+sophgo", tmp_path)
    with pytest.raises(RuntimeError, match="Set ACCEL_BACKEND=gcu or ACCEL_BACKEND=sophtpu"):
        select_backend("auto")
    assert select_backend("gcu").name == "gcu"
    assert select_backend("sophtpu").name == "sophtpu"


def test_gcu_load_order_visibility_memory_and_seeding(monkeypatch, tmp_path, renamed):
    install_lite(monkeypatch, "gcu", tmp_path)
    renamed("gcu")
    backend = select_backend("gcu")
    backend.load()
    backend.load()  # idempotent
    import tops_extension.torch
    import torch_gcu

    assert tops_extension.torch.IMPORTED_BEFORE_TORCH_GCU
    assert "torch_gcu.transfer_to_gcu" not in sys.modules and not torch_gcu.is_transfer_to_gcu
    assert [e for e in torch_gcu.state.log if e[0] == "import"] == [("import", "torch_gcu", "lite")]
    assert torch.distributed.is_eccl_available()
    assert backend.device_count() == 2
    monkeypatch.setenv("TOPS_VISIBLE_DEVICES", "1")
    assert backend.device_count() == 1
    monkeypatch.setenv("TOPS_VISIBLE_DEVICES", "0,0")
    assert backend.device_count() == 0
    monkeypatch.delenv("TOPS_VISIBLE_DEVICES")
    backend.set_device(1)
    assert backend.current_device() == 1
    assert backend.total_memory(1, 2) == 48 * GiB
    torch.gcu.fake_allocate(3 * GiB)
    assert backend.memory_allocated() == 3 * GiB
    assert backend.mem_get_info() == (45 * GiB, 48 * GiB)
    backend.manual_seed_all(7)
    assert ("manual_seed_all", 7) in torch_gcu.state.log
    assert backend.device_capability() == (3, 0)


def test_sophgo_chip_map_memory_and_profiler(monkeypatch, tmp_path, renamed):
    install_lite(monkeypatch, "sophgo", tmp_path)
    renamed("tpu")
    backend = select_backend("sophtpu")
    monkeypatch.setenv("CHIP_MAP", "4,5")
    assert backend.device_count() == 2  # only the mapped chips, of 8
    backend.set_device(1)  # a local rank: torch_tpu maps it to chip 5
    import torch_tpu

    assert torch_tpu.state.log[-1] == ("set_device", 1, 5)
    assert torch.tpu.get_device_properties().total_memory == 0
    assert backend.total_memory(1, 2) == 64 * GiB  # from mem_get_info, not properties
    monkeypatch.setenv("CHIP_MAP", "4,9")
    with pytest.raises(ValueError, match=r"names chips \[9\].*sees 8 chips"):
        backend.device_count()
    monkeypatch.setenv("CHIP_MAP", "4,x")
    with pytest.raises(ValueError, match="comma list of chip ids"):
        backend.device_count()
    from torch_tpu import ops as my_ops

    before = len(my_ops.PROFILE)
    with backend.profiler():
        pass
    assert my_ops.PROFILE[before:] == [("enable", 1_000_000, 1), ("disable",)]
    assert backend.device_capability() is None


def test_load_refuses_a_privateuse1_claimed_by_another_library(monkeypatch, tmp_path, renamed):
    install_lite(monkeypatch, "gcu", tmp_path)
    renamed("tpu")
    with pytest.raises(RuntimeError, match="PrivateUse1 is named 'tpu'.*TORCH_DEVICE_BACKEND_AUTOLOAD=0"):
        select_backend("gcu").load()


def test_card_kv_sizing_from_allocator_numbers():
    mem = CardMemory(total=48 * GiB, free=40 * GiB, weights=6 * GiB, peak=8 * GiB)
    assert card_kv_bytes(mem, 0.9, None, "gcu:0") == int(48 * GiB * 0.9) - 8 * GiB
    tight = CardMemory(total=48 * GiB, free=10 * GiB, weights=6 * GiB, peak=8 * GiB)
    assert card_kv_bytes(tight, 0.9, None, "gcu:0") == 10 * GiB  # another process holds the rest
    assert card_kv_bytes(mem, 0.9, 5 * GiB, "gcu:0") == 5 * GiB
    with pytest.raises(ValueError, match="exceeds the 40.00 GiB free on device gcu:0"):
        card_kv_bytes(mem, 0.9, 41 * GiB, "gcu:0")
    with pytest.raises(ValueError, match="No room for a KV cache on device gcu:0"):
        card_kv_bytes(mem, 0.1, None, "gcu:0")
    with pytest.raises(ValueError, match="reports 0 bytes"):
        card_kv_bytes(CardMemory(0, 0, 0, 0), 0.9, None, "sophtpu:0")


def test_xformers_probe_falls_back_on_cpu():
    from vllm_accel.ops import registry
    from vllm_accel.ops.vendor.kernels import probe_xformers
    import vllm_accel.ops.torch_fast.attention  # noqa: F401

    usable, why = probe_xformers(torch.device("cpu"))
    assert not usable and "not usable on cpu" in why
    assert "xformers" not in registry.providers_of("paged_prefill")
