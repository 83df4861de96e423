#!/bin/sh
# A C++ compiler for the simulator's kernels (CXX=benchmarks/cxx_without_amx.sh) that
# compiles AMX out: on a CPU with AMX it builds what an AVX512-BF16 CPU without it (an
# AMD EPYC Zen 4/5) builds, so those paths can be measured there. torch's, oneDNN's
# and stock vLLM's kernels still use AMX (stock vLLM 0.32's worker died under
# ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 on an Intel Xeon with AMX), so a comparison
# with stock run this way favours stock.
exec g++ "$@" -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
