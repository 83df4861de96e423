# make setup | make serve [PORT=8000] | make test | make bench
VENV ?= .venv
PORT ?= 8000
PY := $(VENV)/bin/python

.PHONY: setup serve test bench

setup:
	@bash scripts/setup.sh

serve: setup
	@model=$$($(PY) -m vllm_accel.models path) && \
	echo "[serve] vllm serve $$model --device gcu --port $(PORT)" && \
	. $(VENV)/bin/activate && exec vllm serve "$$model" --device gcu --port $(PORT)

test: setup
	$(VENV)/bin/python -m pytest -q -rs tests

bench: setup
	$(PY) benchmarks/throughput.py
