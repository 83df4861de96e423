"""Checks of the virtual card, run in a fresh interpreter by test_virtual_gcu.py
(renaming PrivateUse1 cannot be undone in a process): ``python
virtual_device_checks.py gcu`` checks the device under torch_gcu's contract,
``... sophtpu`` under torch_tpu's. Prints one ``CHECK <name> ok`` or ``CHECK
<name> FAIL <why>`` line per check; the oracle is the same computation on CPU
tensors, or the vendor contract (shared notes, vendor-apis sections 1.2, 2)."""

import os
import sys
import traceback

import torch

os.environ["TOPS_VISIBLE_DEVICES"] = "1,3,5"  # 3 of the 8 GCUs
os.environ["CHIP_MAP"] = "3,5"  # SG2260: local rank 0 -> chip 3, 1 -> chip 5
os.environ["ACCEL_VIRTUAL_DEVICE_COUNT"] = "8"
os.environ["ACCEL_SIM_DEVICE_MEMORY_GB"] = "0.25"
CAPACITY = 256 << 20
CHECKS = []  # torch_gcu's contract
SOPHTPU_CHECKS = []  # torch_tpu's


def check(fn):
    CHECKS.append(fn)
    return fn


def sophtpu_check(fn):
    SOPHTPU_CHECKS.append(fn)
    return fn


@check
def device_identity():
    assert torch._C._get_privateuse1_backend_name() == "gcu"
    t = torch.ones(2, device="gcu")
    assert t.device == torch.device("gcu", 0) and t.is_gcu and str(t.device) == "gcu:0"
    assert torch.gcu.is_available() and torch.gcu.device_count() == 3  # TOPS_VISIBLE_DEVICES
    assert torch.ones(1).gcu().is_gcu and torch.nn.Linear(2, 2).gcu().weight.is_gcu
    props = torch.gcu.get_device_properties(0)
    assert props.total_memory == CAPACITY and torch.gcu.get_device_capability() == (3, 0)


@check
def device_selection():
    with torch.gcu.device(2):
        assert torch.gcu.current_device() == 2 and torch.ones(1, device="gcu").device.index == 2
    assert torch.gcu.current_device() == 0
    assert torch.zeros(1, device="gcu:1").device.index == 1
    try:
        torch.gcu.set_device(3)
    except RuntimeError as e:
        assert "gcu:3 does not exist" in str(e), str(e)
    else:
        raise AssertionError("gcu:3 is not visible")


@check
def copies_and_kernels_match_cpu():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(7, 33, generator=g), torch.randn(33, 5, generator=g)
    da, db = a.to("gcu"), b.to("gcu")
    torch.testing.assert_close((da @ db).cpu(), a @ b, rtol=0, atol=0)
    torch.testing.assert_close(torch.softmax(da, -1).cpu(), torch.softmax(a, -1), rtol=0, atol=0)
    idx = torch.tensor([4, 0, 6])
    assert torch.equal(da.index_select(0, idx.to("gcu")).cpu(), a.index_select(0, idx))
    assert torch.equal(torch.cat([da, da]).cpu(), torch.cat([a, a]))
    assert torch.equal(da.to(torch.bfloat16).cpu(), a.to(torch.bfloat16))
    assert torch.equal(torch.arange(10, device="gcu").cpu(), torch.arange(10))  # out= resize
    assert [p.device.type for p in da.split(3)] == ["gcu"] * 3
    assert da.argmax(-1).device.type == "gcu" and da.sum().item() == a.sum().item()
    # convolutions (Whisper's Conv1d audio stem; torch sends unknown backends to an
    # overrideable op the fallback never sees)
    x, w, bias = (torch.randn(2, 8, 30, generator=g), torch.randn(16, 8, 3, generator=g),
                  torch.randn(16, generator=g))
    conv = torch.nn.functional.conv1d(x.to("gcu"), w.to("gcu"), bias.to("gcu"), stride=2,
                                      padding=1)
    assert conv.device.type == "gcu"
    torch.testing.assert_close(conv.cpu(), torch.nn.functional.conv1d(x, w, bias, stride=2,
                                                                     padding=1), rtol=0, atol=0)


@check
def views_share_device_memory():
    base = torch.zeros(4, 6, device="gcu")
    view = base[1:3, ::2]
    assert view.device.type == "gcu" and view.data_ptr() != base.data_ptr()
    view.add_(5)  # in place through a strided view
    expected = torch.zeros(4, 6)
    expected[1:3, ::2] = 5
    assert torch.equal(base.cpu(), expected)
    out = torch.empty(4, 6, device="gcu")
    torch.mul(base, 2, out=out)
    assert torch.equal(out.cpu(), expected * 2)
    host = torch.ones(4, 6)
    base.copy_(host)
    assert torch.equal(base.cpu(), host)


@check
def memory_accounting_and_oom():
    torch.gcu.reset_peak_memory_stats()
    before = torch.gcu.memory_allocated()
    t = torch.empty(1 << 20, dtype=torch.uint8, device="gcu")
    assert torch.gcu.memory_allocated() == before + (1 << 20)
    free, total = torch.gcu.mem_get_info()
    assert total == CAPACITY and free == CAPACITY - torch.gcu.memory_allocated()
    y = t.float()  # a new result, adopted into device memory
    assert torch.gcu.memory_allocated() == before + 5 * (1 << 20)
    del t, y
    assert torch.gcu.memory_allocated() == before
    assert torch.gcu.max_memory_allocated() >= before + 5 * (1 << 20)
    try:
        torch.empty(CAPACITY - before + 1, dtype=torch.uint8, device="gcu")
    except torch.OutOfMemoryError as e:
        assert "ACCEL_SIM_DEVICE_MEMORY_GB" in str(e)
    else:
        raise AssertionError("allocating past the capacity must fail")
    assert torch.gcu.memory_allocated() == before


@check
def seeding_and_generators():
    torch.manual_seed(7)
    a = torch.randn(5, device="gcu").cpu()
    torch.gcu.manual_seed(7)
    b = torch.randn(5, device="gcu").cpu()
    assert torch.equal(a, b)
    gen = torch.Generator(device="gcu")
    gen.manual_seed(3)
    c = torch.randint(0, 100, (6,), device="gcu", generator=gen).cpu()
    gen.manual_seed(3)
    assert torch.equal(c, torch.randint(0, 100, (6,), device="gcu", generator=gen).cpu())


@check
def pinned_memory_streams_events():
    host = torch.ones(8, pin_memory=True)
    assert host.is_pinned() and torch.empty(4).pin_memory().is_pinned()
    dev = host.to("gcu", non_blocking=True)
    stream = torch.gcu.current_stream()
    with torch.gcu.stream(torch.gcu.Stream()):
        dev.mul_(2)
    stream.synchronize()
    start, end = torch.gcu.Event(enable_timing=True), torch.gcu.Event(enable_timing=True)
    start.record()
    end.record()
    torch.gcu.synchronize()
    assert end.elapsed_time(start) <= 0 <= start.elapsed_time(end)
    event = torch.Event(device="gcu")
    event.record()
    event.synchronize()
    assert dev.sum().item() == 16


@check
def op_without_cpu_kernel_names_the_op():
    x = torch.ones(3, 3, device="gcu")
    try:
        torch._cudnn_rnn_flatten_weight([x], 1, 3, 0, 3, 0, 1, False, False)
    except NotImplementedError as e:
        assert "_cudnn_rnn_flatten_weight" in str(e) and "virtual gcu" in str(e), str(e)
    else:
        raise AssertionError("expected NotImplementedError")
    assert torch.ones(2, device="gcu").sum().item() == 2  # the device still works


def _collectives_rank(flavour: str, rank: int, init_file: str, results) -> None:
    """One rank of a 2-rank group of the vendor's collective backend on device
    tensors, in place, set up as our backend does on a card."""
    import torch.distributed as dist

    from vllm_accel.backends.virtual import VirtualGcuBackend, VirtualSophTpuBackend

    backend = (VirtualGcuBackend if flavour == "gcu" else VirtualSophTpuBackend)("check")
    with backend.distributed_init(rank, rank, 2):
        backend.set_device(rank)
        dist.init_process_group(backend.dist_backend, init_method=f"file://{init_file}",
                                rank=rank, world_size=2)
    dev = backend.torch_device(rank)
    x = torch.full((4,), float(rank + 1), device=dev)
    dist.all_reduce(x)
    gathered = torch.empty(8, device=dev)
    dist.all_gather_into_tensor(gathered, torch.full((4,), float(rank), device=dev))
    shard = torch.empty(2, device=dev)
    dist.reduce_scatter_tensor(shard, torch.arange(4, dtype=torch.float32, device=dev))
    b = torch.full((3,), float(rank), device=dev)
    dist.broadcast(b, src=1)
    dist.barrier()
    results[rank] = (str(x.device), dist.get_backend(), x.cpu().tolist(),
                     gathered.cpu().tolist(), shard.cpu().tolist(), b.cpu().tolist())
    dist.destroy_process_group()


def _two_rank_collectives(flavour: str) -> dict:
    import multiprocessing
    import tempfile

    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, tempfile.TemporaryDirectory() as tmp:
        results = manager.dict()
        procs = [ctx.Process(target=_collectives_rank, args=(flavour, r, f"{tmp}/init", results))
                 for r in range(2)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(120)
        assert all(proc.exitcode == 0 for proc in procs), [proc.exitcode for proc in procs]
        results = dict(results)
    for rank in range(2):
        _, _, reduced, gathered, shard, broadcast = results[rank]
        assert reduced == [3.0] * 4
        assert gathered == [0.0] * 4 + [1.0] * 4
        assert shard == [2.0 * v for v in (2 * rank, 2 * rank + 1)]
        assert broadcast == [1.0] * 3
    return results


@check
def eccl_collectives_on_device_tensors():
    import torch.distributed as dist

    assert "eccl" in dist.Backend.backend_list and dist.is_eccl_available()
    results = _two_rank_collectives("gcu")
    assert [results[r][:2] for r in range(2)] == [("gcu:0", "eccl"), ("gcu:1", "eccl")]


@sophtpu_check
def tpu_identity_and_quirks():
    import warnings

    assert torch._C._get_privateuse1_backend_name() == "tpu"
    assert torch.tpu.device_count() == 8  # torch_tpu does no visibility filtering
    props = torch.tpu.get_device_properties(0)
    assert props.total_memory == 0 and "SG2260" in props.name  # as torch_tpu reports
    with warnings.catch_warnings(record=True):
        assert torch.tpu.get_device_capability() is None
    assert torch.tpu.mem_get_info()[1] == CAPACITY
    t = torch.ones(3, device="tpu")
    assert t.is_tpu and torch.ones(1).tpu().is_tpu
    torch.ops.my_ops.enable_profile(1000, 1)
    torch.ops.my_ops.disable_profile()


@sophtpu_check
def chip_map_maps_local_ranks():
    torch.tpu.set_device(1)  # local rank 1 -> chip 5
    assert torch.tpu.current_device() == 5
    assert str(torch.device("tpu:0")) == "tpu:3"  # torch_tpu maps device indices too
    assert str(torch.device("tpu", 1)) == "tpu:5" and str(torch.device(0)) == "tpu:3"
    assert isinstance(torch.device("cpu"), torch.device) and torch.device("cpu").type == "cpu"
    before = torch.tpu.memory_allocated(5)
    t = torch.empty(1 << 20, dtype=torch.uint8, device=torch.device("tpu", 1))
    assert t.device.index == 5 and torch.tpu.memory_allocated(5) == before + (1 << 20)
    assert torch.tpu.mem_get_info()[0] == CAPACITY - torch.tpu.memory_allocated(5)
    try:
        torch.tpu.mem_get_info(0)
    except RuntimeError as e:
        assert "current device" in str(e)
    else:
        raise AssertionError("torch_tpu answers mem_get_info only for the current device")


@sophtpu_check
def sccl_needs_a_chip_map_then_runs_collectives():
    import tempfile

    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        try:
            dist.init_process_group("sccl", init_method=f"file://{tmp}/init", rank=0,
                                    world_size=1)
        except RuntimeError as e:
            assert "set_chip_map" in str(e), str(e)
        else:
            raise AssertionError("sccl must refuse to start without a chip map")
    results = _two_rank_collectives("sophtpu")
    # our backend sets local ranks; CHIP_MAP puts them on chips 3 and 5
    assert [results[r][:2] for r in range(2)] == [("tpu:3", "sccl"), ("tpu:5", "sccl")]


def main(flavour: str) -> int:
    if flavour == "gcu":
        import vllm_accel.backends.virtual.torch_gcu  # noqa: F401
    else:
        import vllm_accel.backends.virtual.torch_tpu  # noqa: F401
    failed = 0
    for fn in CHECKS if flavour == "gcu" else SOPHTPU_CHECKS:
        try:
            fn()
            print(f"CHECK {fn.__name__} ok", flush=True)
        except Exception:
            failed += 1
            why = traceback.format_exc().strip().replace("\n", " | ")
            print(f"CHECK {fn.__name__} FAIL {why}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
