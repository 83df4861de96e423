"""Two workers, chosen by the platform from the backend (``backend.worker_cls``):
the simulated GCU's over vLLM's CPUWorker and CPU runner (``sim_worker``), and a
vendor card's over vLLM's GPU Worker and runner (``card_worker``). What they
share is in ``common``."""
