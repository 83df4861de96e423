#!/usr/bin/env python
"""Where a decode step's time goes: torch.profiler over an in-process engine.

One engine (``--engine accel``: our plugin; ``stock``: vLLM's CPU platform, the plugin
excluded through ``VLLM_PLUGINS``) runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the scheduler, the runner and the model are
all visible to the profiler) with ``--threads`` torch threads (default one), generates ``--output-len`` tokens
for ``--num-prompts`` random ``--input-len``-token prompts (greedy, ``ignore_eos``; the
defaults are issue 13's W3, ``--num-prompts 64 --input-len 128`` its W1's batch), and
prints milliseconds per decode step by kind:

- scheduler: ``Scheduler.schedule`` + ``update_from_output``;
- input prep: the runner's ``_update_states`` + ``_prepare_inputs``;
- forward, split into the linear GEMMs (oneDNN or our bf16, int4/int8 kernels), the
  attention ops (vLLM's ``unified_attention_with_output`` and
  ``unified_kv_cache_update``, with everything they call, our Python included), the
  one-op decoder layers (``cpu_decoder_layer``'s own time: all of a layer's kernels,
  where ``models/llama.py`` runs the layer as one op) and the rest of the model
  (compiled graph glue, norms, rotary, activation, our layer op's Python);
- LM head (``compute_logits``) and sampler (``_sample``);
- other: the rest of the step (engine loop, output processing).

The profiler adds its own overhead per op, so the split is what matters; the
unprofiled wall time per step is printed beside it. Prefill is left out of the split
(the profile starts after the first generated token); its unprofiled wall time, the
one-token run, is printed on its own line.

Usage::

    python benchmarks/step_profile.py [--engine accel|stock] [--model DIR] [--compile]
                                      [--kv-cache-dtype auto|int8]
                                      [--threads 1] [--num-prompts 1] [--input-len 32] [--output-len 128]
                                      [--top N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: (kind, profiler event names whose total CPU time it is)
SPANS = (
    ("scheduler", ("step_profile::schedule", "step_profile::update_from_output")),
    ("input prep", ("step_profile::update_states", "step_profile::prepare_inputs")),
    ("forward", ("step_profile::model_forward",)),
    ("LM head", ("step_profile::compute_logits",)),
    ("sampler", ("step_profile::sample",)),
)
#: forward's parts, counted only inside ``_model_forward`` (the LM head runs one of them
#: too): the linear GEMMs' own time, the attention ops with everything they call
FORWARD_GEMMS = ("_C::onednn_mm", "vllm_accel::bf16_linear", "vllm_accel::int4pack_linear",
                 "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm", "aten::_int_mm",
                 "aten::mm", "aten::addmm")
FORWARD_ATTENTION = ("vllm::unified_attention_with_output", "vllm::unified_kv_cache_update")
#: a whole decoder layer in one C++ op (models/llama.py); its own time is what its
#: phases leave
FORWARD_LAYERS = ("vllm_accel::cpu_decoder_layer",)
#: the phases of that op, profiler ranges it opens itself (``accel_layer::qkv_proj``,
#: ``::attention``, ...), each reported as ``forward: layer <phase>``
LAYER_PHASE = "accel_layer::"


def _wrap(cls, name: str, label: str) -> None:
    """Run ``cls.name`` inside ``record_function(label)`` (this process only)."""
    import torch

    original = getattr(cls, name)

    def wrapped(self, *args, **kwargs):
        with torch.profiler.record_function(label):
            return original(self, *args, **kwargs)

    setattr(cls, name, wrapped)


def _instrument() -> None:
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _wrap(Scheduler, "schedule", "step_profile::schedule")
    _wrap(Scheduler, "update_from_output", "step_profile::update_from_output")
    for name, label in (("_update_states", "update_states"), ("_prepare_inputs", "prepare_inputs"),
                        ("_model_forward", "model_forward"), ("_sample", "sample")):
        _wrap(GPUModelRunner, name, "step_profile::" + label)
    _wrap(LogitsProcessor, "forward", "step_profile::compute_logits")


def _inside(event, name: str, prefix: bool = False) -> bool:
    """Whether an enclosing event is ``name`` (with ``prefix``: starts with it)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == name or (prefix and parent.name.startswith(name)):
            return True
        parent = parent.cpu_parent
    return False


def _split(events) -> dict[str, float]:
    """Microseconds by kind over the profiler's events."""
    span_of = {n: kind for kind, names in SPANS for n in names}
    out = {kind: 0.0 for kind, _ in SPANS}
    out.update({"forward: linear GEMMs": 0.0, "forward: attention + KV write": 0.0,
                "forward: one-op decoder layers": 0.0})
    phases = 0.0
    for e in events:
        if e.name in span_of:
            out[span_of[e.name]] += e.cpu_time_total
        elif e.name.startswith(LAYER_PHASE) and _inside(e, "step_profile::model_forward"):
            kind = "forward: layer " + e.name[len(LAYER_PHASE):]
            out[kind] = out.get(kind, 0.0) + e.cpu_time_total
            phases += e.cpu_time_total
        elif (e.name in FORWARD_GEMMS and _inside(e, "step_profile::model_forward")
              and not _inside(e, LAYER_PHASE, prefix=True)):  # (counted in its phase)
            out["forward: linear GEMMs"] += e.self_cpu_time_total
        elif e.name in FORWARD_ATTENTION and _inside(e, "step_profile::model_forward"):
            out["forward: attention + KV write"] += e.cpu_time_total
        elif e.name in FORWARD_LAYERS and _inside(e, "step_profile::model_forward"):
            out["forward: one-op decoder layers"] += e.self_cpu_time_total
    out["forward: rest"] = (out["forward"] - out["forward: linear GEMMs"]
                            - out["forward: attention + KV write"]
                            - out["forward: one-op decoder layers"] - phases)
    return out


def _self_times(events, inside: str) -> dict[str, list[float]]:
    """[self CPU microseconds, calls] by op name over the events inside ``inside``."""
    out: dict[str, list[float]] = {}
    for e in events:
        if _inside(e, inside):
            entry = out.setdefault(e.name, [0.0, 0])
            entry[0] += e.self_cpu_time_total
            entry[1] += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("accel", "stock"), default="accel")
    ap.add_argument("--model", default=None, help="HF model dir (default model)")
    ap.add_argument("--compile", action="store_true", help="vLLM's default torch.compile")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (the simulator's multiprocess worker runs one a core)")
    ap.add_argument("--num-prompts", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="vLLM's --kv-cache-dtype (e.g. int8: the INT8 KV cache)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--top", type=int, default=0,
                    help="also print the N ops with the most self time inside the forward")
    args = ap.parse_args()

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import roofline
    import throughput

    engine = throughput.ENGINES[args.engine]  # the benchmark's platform and environment
    os.environ.update(engine["env"])

    import torch
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    torch.set_num_threads(args.threads)
    model = args.model or throughput.default_model()
    _instrument()
    llm = LLM(model=model, dtype="bfloat16", seed=0, max_model_len=1024,
              kv_cache_memory_bytes=1 << 30, enforce_eager=not args.compile,
              enable_prefix_caching=False,  # each generate() repeats the prompts
              kv_cache_dtype=args.kv_cache_dtype,
              skip_tokenizer_init=True)
    platform = type(current_platform).__name__
    if platform != engine["platform"]:
        raise SystemExit(f"--engine {args.engine} runs on {platform}, expected "
                         f"{engine['platform']}")
    prompt = throughput.random_prompts(args.num_prompts, args.input_len, throughput.vocab_size(model), 0)
    prompts = throughput._token_prompts(prompt)

    def generate(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    generate(args.output_len)  # warm-up
    steps = args.output_len - 1
    prefill_s = generate(1)
    wall_ms = (generate(args.output_len) - prefill_s) / steps * 1e3  # prefill excluded
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        seconds = generate(args.output_len)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof_one:
        seconds -= generate(1)
    # the decode steps: the long run's events less the one-token run's (its prefill)
    whole, first = _split(prof.events()), _split(prof_one.events())
    split = {kind: (whole[kind] - first.get(kind, 0.0)) / steps / 1e3 for kind in whole}
    profiled_ms = seconds / steps * 1e3
    split["other (engine loop, outputs)"] = profiled_ms - sum(
        ms for kind, ms in split.items() if not kind.startswith("forward:"))

    cpu, flags = roofline.cpu_model(), " ".join(roofline.cpu_flags())
    print(f"CPU: {cpu}; flags: {flags}")
    print(f"engine {args.engine} ({platform}), {'compiled' if args.compile else 'eager'}, "
          f"{Path(model).name}, {args.num_prompts} x {args.input_len} in / "
          f"{args.output_len} out")
    print(f"unprofiled prefill (the one-token run): {prefill_s * 1e3:.1f} ms")
    print(f"unprofiled: {wall_ms:.2f} ms per decode step ({1e3 / wall_ms:.1f} tok/s); "
          f"profiled: {profiled_ms:.2f}")
    print("profiled, ms per decode step:")
    for kind, ms in split.items():
        print(f"  {kind:32s} {ms:7.2f}")
    if args.top:
        whole_ops = _self_times(prof.events(), "step_profile::model_forward")
        first_ops = _self_times(prof_one.events(), "step_profile::model_forward")
        ops = {n: [(t - first_ops.get(n, [0.0, 0])[0]) / steps / 1e3,
                   (c - first_ops.get(n, [0.0, 0])[1]) / steps]
               for n, (t, c) in whole_ops.items()}
        print(f"forward: top {args.top} ops by self time per decode step (ms, calls):")
        for name, (ms, calls) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:args.top]:
            print(f"  {ms:7.3f} {calls:6.1f}  {name[:90]}")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu, "flags": flags, "engine": args.engine,
                                         "compiled": args.compile, "model": model,
                                         "num_prompts": args.num_prompts, "kv_cache_dtype": args.kv_cache_dtype,
                                         "prefill_ms": prefill_s * 1e3,
                                         "wall_ms_per_step": wall_ms,
                                         "profiled_ms_per_step": profiled_ms, "split_ms": split},
                                        indent=2))


if __name__ == "__main__":
    main()
