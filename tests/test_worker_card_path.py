"""AccelWorker on a real card must not run the CPU worker's process-wide patches.

vLLM's ``CPUWorker.init_device`` replaces ``torch.set_num_threads`` and its
``CPUModelRunner`` swaps ``torch.cuda.Stream``/``torch.Event`` while it builds and
turns ``torch.accelerator`` calls into no-ops. On a card those would silently
break the vendor runtime. Here the card backend is a recording stand-in and the
CPU-worker entry points raise if reached; the simulator path is the control.
"""

import contextlib
from types import SimpleNamespace

import pytest
import torch

from vllm_accel.worker import worker as W


class RecordingCard:
    name = device_name = "gcu"
    is_real_card = True
    dist_backend = "eccl"

    def __init__(self):
        self.calls = []

    def torch_device(self, local_rank):
        return torch.device("cpu")  # the stand-in has no device of its own

    def set_device(self, local_rank):
        self.calls.append(("set_device", local_rank))

    def empty_cache(self):
        self.calls.append(("empty_cache",))

    @contextlib.contextmanager
    def distributed_init(self, rank, local_rank, world_size):
        self.calls.append(("distributed_init", rank, local_rank, world_size))
        yield

    def manual_seed_all(self, seed):
        self.calls.append(("manual_seed_all", seed))


def _worker(backend):
    worker = object.__new__(W.AccelWorker)
    worker.backend = backend
    worker.local_rank, worker.rank = 1, 3
    worker.distributed_init_method = "tcp://127.0.0.1:1234"
    worker.parallel_config = SimpleNamespace(world_size=4)
    worker.model_config = SimpleNamespace(seed=7)
    worker.vllm_config = SimpleNamespace()
    return worker


@pytest.fixture
def cpu_worker_tripwires(monkeypatch):
    """CPU-worker entry points that must not run on a card, and the globals they patch."""
    reached = []
    def cpu_init_device(self):
        reached.append("CPUWorker.init_device")
        self.device = torch.device("cpu")

    monkeypatch.setattr(W.CPUWorker, "init_device", cpu_init_device)
    monkeypatch.setattr(W, "AccelModelRunner",
                        lambda *a: reached.append("CPU model runner") or "cpu-runner")
    monkeypatch.setattr(W, "AccelCardModelRunner", lambda cfg, device: ("card-runner", device))
    monkeypatch.setattr(W, "init_worker_distributed_environment",
                        lambda cfg, rank, method, local_rank, backend:
                        reached.append(("dist", rank, local_rank, backend)))
    monkeypatch.setattr(W, "set_random_seed", lambda seed: None)
    globals_before = (torch.set_num_threads, torch.cuda.Stream, torch.Event,
                      torch.accelerator.synchronize)
    return reached, globals_before


def test_card_worker_skips_cpu_worker_patches(cpu_worker_tripwires):
    reached, globals_before = cpu_worker_tripwires
    card = RecordingCard()
    worker = _worker(card)
    worker.init_device()
    assert reached == [("dist", 3, 1, "eccl")]  # vLLM's dist init only, over the card's backend
    assert worker.model_runner == ("card-runner", torch.device("cpu"))
    assert card.calls == [("set_device", 1), ("empty_cache",),
                          ("distributed_init", 3, 1, 4), ("manual_seed_all", 7)]
    assert (torch.set_num_threads, torch.cuda.Stream, torch.Event,
            torch.accelerator.synchronize) == globals_before


def test_simulator_worker_keeps_the_cpu_worker_path(cpu_worker_tripwires):
    reached, _ = cpu_worker_tripwires
    sim = RecordingCard()
    sim.is_real_card = False
    worker = _worker(sim)
    worker.init_device()
    assert reached == ["CPUWorker.init_device", "CPU model runner"]
    assert sim.calls == []
