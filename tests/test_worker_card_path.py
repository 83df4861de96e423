"""Two workers: the card worker must not run the CPU worker's process-wide patches.

vLLM's ``CPUWorker.init_device`` replaces ``torch.set_num_threads`` and its
``CPUModelRunner`` swaps ``torch.cuda.Stream``/``torch.Event`` while it builds and
turns ``torch.accelerator`` calls into no-ops. On a card those would silently
break the vendor runtime. Here the card backend is a recording stand-in and the
CPU-worker entry points are recorded if reached; the simulator worker is the
control. The platform picks the worker from the backend; the workers themselves
never ask which kind of device they serve.
"""

import contextlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm_accel.backends.card import CardBackend
from vllm_accel.backends.cpu_sim import CpuSimBackend
from vllm_accel.worker import card_worker as CW
from vllm_accel.worker import sim_worker as SW


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


def _worker(cls, backend):
    worker = object.__new__(cls)
    worker.backend = backend
    worker.local_rank, worker.rank = 1, 3
    worker.distributed_init_method = "tcp://127.0.0.1:1234"
    worker.parallel_config = SimpleNamespace(world_size=4, use_ray=False,
                                             distributed_executor_backend="mp")
    worker.model_config = SimpleNamespace(seed=7)
    worker.vllm_config = SimpleNamespace(device_config=SimpleNamespace(device=None))
    return worker


@pytest.fixture
def cpu_worker_tripwires(monkeypatch):
    """CPU-worker entry points that must not run on a card, and the globals they patch."""
    reached = []

    def cpu_init_device(self):
        reached.append("CPUWorker.init_device")
        self.device = torch.device("cpu")

    monkeypatch.setattr(SW.CPUWorker, "init_device", cpu_init_device)
    monkeypatch.setattr(SW, "AccelSimModelRunner",
                        lambda *a: reached.append("CPU model runner") or "cpu-runner")
    monkeypatch.setattr(CW, "AccelCardModelRunner", lambda cfg, device: ("card-runner", device))
    monkeypatch.setattr(CW, "init_worker_distributed_environment",
                        lambda cfg, rank, method, local_rank, backend:
                        reached.append(("dist", rank, local_rank, backend)))
    monkeypatch.setattr(CW, "set_random_seed", lambda seed: None)
    globals_before = (torch.set_num_threads, torch.cuda.Stream, torch.Event,
                      torch.accelerator.synchronize)
    return reached, globals_before


def test_card_worker_skips_cpu_worker_patches(cpu_worker_tripwires):
    reached, globals_before = cpu_worker_tripwires
    card = RecordingCard()
    worker = _worker(CW.AccelCardWorker, card)
    worker.init_device()
    assert reached == [("dist", 3, 1, "eccl")]  # vLLM's dist init only, over the card's backend
    assert worker.model_runner == ("card-runner", torch.device("cpu"))
    assert worker.vllm_config.device_config.device == torch.device("cpu")  # for the loader
    assert card.calls == [("set_device", 1), ("empty_cache",),
                          ("distributed_init", 3, 1, 4), ("manual_seed_all", 7)]
    assert (torch.set_num_threads, torch.cuda.Stream, torch.Event,
            torch.accelerator.synchronize) == globals_before


def test_simulator_worker_keeps_the_cpu_worker_path(cpu_worker_tripwires):
    reached, _ = cpu_worker_tripwires
    sim = RecordingCard()
    worker = _worker(SW.AccelSimWorker, sim)
    worker.init_device()
    assert reached == ["CPUWorker.init_device", "CPU model runner"]
    assert sim.calls == []


def test_workers_and_runners_subclass_the_matching_vllm_classes():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    from vllm_accel.worker.card_model_runner import AccelCardModelRunner
    from vllm_accel.worker.sim_model_runner import AccelSimModelRunner

    assert issubclass(SW.AccelSimWorker, CPUWorker)
    assert issubclass(AccelSimModelRunner, CPUModelRunner)
    assert issubclass(CW.AccelCardWorker, Worker) and not issubclass(CW.AccelCardWorker,
                                                                      CPUWorker)
    assert issubclass(AccelCardModelRunner, GPUModelRunner)
    assert not issubclass(AccelCardModelRunner, CPUModelRunner)


def test_backend_names_its_worker():
    """The platform sets ``worker_cls`` from the backend (both vendor backends
    inherit the card one); no worker or runner branches on the device kind."""
    assert CpuSimBackend.worker_cls == "vllm_accel.worker.sim_worker.AccelSimWorker"
    assert CardBackend.worker_cls == "vllm_accel.worker.card_worker.AccelCardWorker"
    worker_dir = Path(SW.__file__).parent
    for source in worker_dir.glob("*.py"):
        assert "is_real_card" not in source.read_text(), source.name
