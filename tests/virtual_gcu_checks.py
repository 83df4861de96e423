"""Checks of the virtual GCU device, run in a fresh interpreter by
test_virtual_gcu.py (renaming PrivateUse1 to ``gcu`` cannot be undone in a
process). Prints one ``CHECK <name> ok`` or ``CHECK <name> FAIL <why>`` line
per check; the oracle is the same computation on CPU tensors."""

import os
import sys
import traceback

import torch

os.environ.setdefault("TOPS_VISIBLE_DEVICES", "1,3,5")  # 3 of the 8 devices
CAPACITY = 256 << 20
CHECKS = []


def check(fn):
    CHECKS.append(fn)
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
        assert "TOPS_VISIBLE_DEVICES" in str(e)
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
        assert "_cudnn_rnn_flatten_weight" in str(e) and "virtual GCU" in str(e), str(e)
    else:
        raise AssertionError("expected NotImplementedError")
    assert torch.ones(2, device="gcu").sum().item() == 2  # the device still works


def _eccl_rank(rank: int, init_file: str, results) -> None:
    """One rank of a 2-rank eccl group on gcu tensors (in place, like a card)."""
    import torch.distributed as dist

    from vllm_accel.backends.virtual_gcu.device import install

    install(8, CAPACITY)
    torch.gcu.set_device(rank)
    dist.init_process_group("eccl", init_method=f"file://{init_file}", rank=rank,
                            world_size=2)
    x = torch.full((4,), float(rank + 1), device=f"gcu:{rank}")
    dist.all_reduce(x)
    gathered = torch.empty(8, device=f"gcu:{rank}")
    dist.all_gather_into_tensor(gathered, torch.full((4,), float(rank), device=f"gcu:{rank}"))
    shard = torch.empty(2, device=f"gcu:{rank}")
    dist.reduce_scatter_tensor(shard, torch.arange(4, dtype=torch.float32, device=f"gcu:{rank}"))
    b = torch.full((3,), float(rank), device=f"gcu:{rank}")
    dist.broadcast(b, src=1)
    dist.barrier()
    results[rank] = (x.device.type, x.cpu().tolist(), gathered.cpu().tolist(),
                     shard.cpu().tolist(), b.cpu().tolist())
    dist.destroy_process_group()


@check
def eccl_collectives_on_device_tensors():
    import multiprocessing
    import tempfile

    import torch.distributed as dist

    assert "eccl" in dist.Backend.backend_list and dist.is_eccl_available()
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, tempfile.TemporaryDirectory() as tmp:
        results = manager.dict()
        procs = [ctx.Process(target=_eccl_rank, args=(r, f"{tmp}/init", results))
                 for r in range(2)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(120)
        assert all(proc.exitcode == 0 for proc in procs), [proc.exitcode for proc in procs]
        for rank in range(2):
            device, reduced, gathered, shard, broadcast = results[rank]
            assert device == "gcu" and reduced == [3.0] * 4
            assert gathered == [0.0] * 4 + [1.0] * 4
            assert shard == [2.0 * v for v in (2 * rank, 2 * rank + 1)]
            assert broadcast == [1.0] * 3


def main() -> int:
    from vllm_accel.backends.virtual_gcu.device import install

    install(8, CAPACITY)
    failed = 0
    for fn in CHECKS:
        try:
            fn()
            print(f"CHECK {fn.__name__} ok", flush=True)
        except Exception:
            failed += 1
            why = traceback.format_exc().strip().replace("\n", " | ")
            print(f"CHECK {fn.__name__} FAIL {why}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
