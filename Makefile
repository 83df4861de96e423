# make setup | make serve [PORT=8000] | make test | make bench
VENV ?= .venv
PORT ?= 8000
TEST_WORKERS ?= 2
PY := $(VENV)/bin/python

.PHONY: setup serve test bench

setup:
	@bash scripts/setup.sh

# float32: the default model is a Q4_1 GGUF dequantized to float32 (exact there);
# vLLM's default downcast to bf16 rounds its greedy first chat token into a tie.
serve: setup
	@model=$$($(PY) -m vllm_accel.tools.models path) && \
	echo "[serve] vllm serve $$model --device gcu --dtype float32 --port $(PORT)" && \
	. $(VENV)/bin/activate && exec vllm serve "$$model" --device gcu --dtype float32 --port $(PORT)

# two pytest-xdist workers, each taking whole files (module-scoped engines and
# servers start once): an engine test keeps one core busy, so two fit 2 cores.
# Then the tests with a process per simulated GCU (TP, DP, EP, Ray; marked
# tensor_parallel), one at a time on the whole machine. Both parts always run.
test: setup
	@$(PY) -m pytest -q -rs -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		--durations=25 -m "not tensor_parallel" tests; shared=$$?; \
	$(PY) -m pytest -q -rs --durations=10 -m tensor_parallel tests; whole=$$?; \
	exit $$(( shared > whole ? shared : whole ))

# both modes: compiled (vLLM's default, with the W4A16, W8A8 and INT8-KV engines
# as well), then eager; then the batch-size sweep (compiled) with its plot.
# matplotlib alone: installing the package again would bring back the
# torchaudio/torchcodec that setup removes.
bench: setup
	$(PY) -m pip install -q "matplotlib>=3.8,<3.11"
	$(PY) benchmarks/throughput.py --compile --engines accel,stock,accel-w4a16,accel-w8a8,accel-int8
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/batch_sweep.py --json benchmarks/results/batch_sweep.json \
		--png benchmarks/results/batch_sweep.png
