#!/bin/sh
# A C++ compiler for the simulator's kernels (CXX=benchmarks/cxx_without_amx.sh) that
# compiles AMX out: on a CPU with AMX it builds what an AVX512-BF16 CPU without it (an
# AMD EPYC Zen 4/5) builds, so those paths can be measured there. With
# ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 torch's and stock vLLM's oneDNN kernels leave
# AMX as well (vLLM's own CPU attention still picks AMX where the CPU has it).
exec g++ "$@" -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
