"""Runs one offline vLLM generation in a fresh process and prints JSON results.

Engine tests call this as a subprocess so each engine starts cleanly (vLLM
spawns EngineCore and workers; a fresh interpreter keeps pytest's process free
of their state). Input: a JSON file path with ``llm`` (LLM kwargs), ``prompts``
(strings or token-id lists), ``sampling`` (SamplingParams kwargs), ``chat``
(optional list of message lists, sampled with ``chat_sampling`` if given), ``prompt_batches`` (optional: lists of prompts
generated one batch after another, e.g. to hit the prefix cache), ``embed`` (optional: token-id
prompts embedded by a pooling model), ``classify`` (optional: token-id prompts
classified by a classifier or reranker: each one's class probabilities),
``lora_requests`` (optional, per prompt:
``[name, id, path]`` of a LoRA adapter or null), ``mm_prompts`` (optional: text prompts
with images, each ``{"prompt", "images": [vlm_models.image_of entries]}`` and optionally
``"videos": [vlm_models.video_of entries]``, ``"audios": [speech_models.audio_of
entries]``), ``audio_prompts``
(optional: encoder-decoder requests, each ``{"decoder_prompt", "audio":
[speech_models.audio_of entry]}`` and optionally its own ``sampling`` overrides), ``requests``
(optional: {"prompt", "sampling"} pairs, each with its own SamplingParams kwargs;
``structured_outputs`` there is a StructuredOutputsParams dict). Output: one
stdout line "ENGINE_RESULT <json>" (outputs, batch outputs, prefix-cache and
preemption counters when ``disable_log_stats`` is False; with ``worker_threads``,
each worker's cores and torch thread count; with ``worker_huge_pages``, each
worker's bytes in transparent huge pages; with ``worker_kernel_calls``, each worker's
counts of those C++ ops' kernels). With ``engine_until_exit`` the LLM
stays referenced until the interpreter exits, as a script's top-level ``llm`` does,
so the engine shuts down from the exit hooks. A file ``{"engines": {key: spec}}`` runs
each spec's engine in turn in this one process (``run_each``).
"""

import faulthandler
import gc
import json
import os
import signal
import sys


def _compute_threads(worker) -> dict:
    """In a worker: the cores its model-running thread may use and torch's thread
    count (collective_rpc runs in the thread that runs the model)."""
    import os

    import torch

    return {"cores": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads()}


def _huge_page_bytes(worker) -> int:
    """In a worker: its anonymous memory in transparent huge pages (the kernel's count)."""
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) << 10
    return 0


def _kernel_calls(worker, ops: list[str]) -> dict:
    """In a worker: ``{op: [calls, rows]}`` of the C++ ops' kernels so far
    (csrc/torch_ops.cpp counts them; empty where that library is not built)."""
    import ctypes

    from vllm_accel.ops.cpu_native import build as native

    lib = native.torch_ops()
    if lib is None:
        return {}
    counts = {}
    for op in ops:
        rows = ctypes.c_int64()
        counts[op] = [lib.accel_torch_ops_kernel_calls(op.encode(), ctypes.byref(rows)),
                      rows.value]
    return counts


def _output(o) -> dict:
    """One request's output: tokens, text, per-step log-probs and, per prompt position,
    the top-ranked token id and the prompt token's own log-prob (None for position 0)."""
    return {"token_ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text,
            "logprobs": [{str(t): lp.logprob for t, lp in step.items()}
                         for step in (o.outputs[0].logprobs or [])],
            "prompt_top": [None if step is None else
                           int(next(t for t, lp in step.items() if lp.rank == 1))
                           for step in (o.prompt_logprobs or [])],
            "prompt_logprobs": [None if step is None else step[token].logprob
                                for token, step in zip(o.prompt_token_ids,
                                                       o.prompt_logprobs or [])]}


#: engines that shut down only at interpreter exit (spec ``engine_until_exit``)
_ENGINES_KEPT_UNTIL_EXIT: list = []


def run(spec: dict):
    """One engine's run of ``spec``: (its results, the LLM)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    llm = LLM(**spec["llm"])
    params = SamplingParams(**spec["sampling"])
    prompts = [
        TokensPrompt(prompt_token_ids=p) if isinstance(p, list) else p
        for p in spec.get("prompts", [])
    ]
    results = {"platform": type(current_platform).__name__, "outputs": []}
    if prompts:
        lora = None
        if spec.get("lora_requests"):  # per prompt: [name, int id, path] or None
            from vllm.lora.request import LoRARequest

            lora = [None if r is None else LoRARequest(*r) for r in spec["lora_requests"]]
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        results["outputs"] = [_output(o) for o in outs]
    if spec.get("requests"):
        from vllm.sampling_params import StructuredOutputsParams

        def params_of(sampling: dict) -> SamplingParams:
            sampling = dict(sampling)
            if "structured_outputs" in sampling:
                sampling["structured_outputs"] = StructuredOutputsParams(
                    **sampling["structured_outputs"])
            if "logit_bias" in sampling:  # JSON object keys are strings
                sampling["logit_bias"] = {int(k): v for k, v in sampling["logit_bias"].items()}
            return SamplingParams(**sampling)

        params_list = [params_of(r["sampling"]) for r in spec["requests"]]
        outs = llm.generate([r["prompt"] for r in spec["requests"]], params_list, use_tqdm=False)
        results["requests"] = [{"token_ids": list(o.outputs[0].token_ids),
                                "text": o.outputs[0].text} for o in outs]
    if spec.get("mm_prompts"):  # text prompts with images (and videos): {"prompt", "images"}
        sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
        from vlm_models import image_of, video_of

        def media(p: dict) -> dict:
            data = {"image": [image_of(entry) for entry in p["images"]]} if p["images"] else {}
            if p.get("videos"):
                data["video"] = [video_of(entry) for entry in p["videos"]]
            if p.get("audios"):
                from speech_models import audio_of

                data["audio"] = [audio_of(entry) for entry in p["audios"]]
            return {"multi_modal_data": data} if data else {}

        mm = [{"prompt": p["prompt"]} | media(p) for p in spec["mm_prompts"]]
        outs = llm.generate(mm, params, use_tqdm=False)
        results["mm_outputs"] = [_output(o) | {"prompt_token_ids": list(o.prompt_token_ids)}
                                 for o in outs]
    if spec.get("audio_prompts"):  # encoder-decoder (Whisper): {"decoder_prompt", "audio"}
        sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
        from speech_models import audio_of

        requests = [{"encoder_prompt": {"prompt": "", "multi_modal_data": {
            "audio": audio_of(p["audio"])}}, "decoder_prompt": p["decoder_prompt"]}
            for p in spec["audio_prompts"]]
        per_request = [SamplingParams(**{**spec["sampling"], **p.get("sampling", {})})
                       for p in spec["audio_prompts"]]
        outs = llm.generate(requests, per_request, use_tqdm=False)
        results["audio_outputs"] = [_output(o) | {"prompt_token_ids": o.prompt_token_ids}
                                    for o in outs]
    if spec.get("embed"):  # a pooling model: one embedding per token-id prompt
        outs = llm.embed([TokensPrompt(prompt_token_ids=p) for p in spec["embed"]],
                         use_tqdm=False)
        results["embeddings"] = [list(o.outputs.embedding) for o in outs]
    if spec.get("classify"):  # a sequence classifier / reranker: probabilities per prompt
        outs = llm.classify([TokensPrompt(prompt_token_ids=p) for p in spec["classify"]],
                            use_tqdm=False)
        results["probs"] = [list(o.outputs.probs) for o in outs]
    results["batches"], results["batch_outputs"] = [], []
    for batch in spec.get("prompt_batches", []):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params,
                            use_tqdm=False)
        results["batches"].append([list(o.outputs[0].token_ids) for o in outs])
        results["batch_outputs"].append([_output(o) for o in outs])
    if spec["llm"].get("disable_log_stats") is False:  # LLM disables stats by default
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        results["prefix_cache"] = {name: metrics[name] for name in
                                   ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries")}
        results["preemptions"] = metrics.get("vllm:num_preemptions")
        results["spec_decode"] = {name: value for name, value in metrics.items()
                                  if name.startswith("vllm:spec_decode")}
    if spec.get("chat"):
        chat_params = SamplingParams(**spec.get("chat_sampling", spec["sampling"]))
        outs = llm.chat(spec["chat"], chat_params, use_tqdm=False)
        results["chat"] = [o.outputs[0].text for o in outs]
    if spec.get("worker_threads"):
        results["worker_threads"] = llm.collective_rpc(_compute_threads)
    if spec.get("worker_kernel_calls"):
        results["worker_kernel_calls"] = llm.collective_rpc(
            _kernel_calls, args=(spec["worker_kernel_calls"],))
    if spec.get("worker_huge_pages"):
        results["worker_huge_pages"] = llm.collective_rpc(_huge_page_bytes)
    return results, llm


def run_each(engines: dict) -> None:
    """Several engines one after another in this process (``{"engines": {key: spec}}``),
    each shut down before the next starts: what N processes would print, with
    "ENGINE_BEGIN <key>" before each engine's log and "ENGINE_RESULT <key> <json>" (or
    "ENGINE_ERROR <key>" and its traceback) after it; kernel counts are each engine's
    own. Saves each later engine the interpreter's start and vLLM's imports (~7 s of a
    ~13-30 s engine on 2 cores). In-process engines only (no worker processes)."""
    import traceback

    import torch
    import vllm.logger
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    for key, spec in engines.items():
        # a fresh process's logs: each engine's "once" messages again
        for once in (vllm.logger._print_debug_once, vllm.logger._print_info_once,
                     vllm.logger._print_warning_once, vllm.logger._print_error_once):
            once.cache_clear()
        torch._dynamo.reset()
        # The earlier engines' shutdown unfroze and collected the heap; what is left
        # (imports, compile caches: ~1M objects after one engine) is static. vLLM
        # collects the whole heap ~5 times while an engine starts and freezes it only
        # once started, each collection ~0.45 s on 2 cores: frozen now, they scan only
        # this engine's objects (test_attention_models.py's 14 simulator engines: 148
        # to 125 s, Intel Xeon with AMX). The engine's shutdown unfreezes it again.
        gc.freeze()
        print(f"ENGINE_BEGIN {key}", flush=True)
        llm = None
        try:
            # the kernels' counters are the process's: this engine's calls are the change
            ops = spec.get("worker_kernel_calls")
            before = _kernel_calls(None, ops) if ops else {}
            results, llm = run(spec)
            for counts in results.get("worker_kernel_calls", []):
                for op, (calls, rows) in counts.items():
                    counts[op] = [calls - before[op][0], rows - before[op][1]]
            print(f"ENGINE_RESULT {key} " + json.dumps(results), flush=True)
        except Exception:
            print(f"ENGINE_ERROR {key}\n{traceback.format_exc()}", flush=True)
        finally:
            # the engine's shutdown ends the distributed state and collects garbage
            # itself; each full collection takes ~0.4 s in this process's heap
            if llm is not None:
                llm.llm_engine.engine_core.shutdown()
                del llm
            else:
                cleanup_dist_env_and_memory()


def _exit_now(llm=None) -> None:
    """End the process once the results are printed, without the engine's shutdown and
    the interpreter's teardown: two full garbage collections and the teardown of
    vLLM's and torch's modules, ~3 s of an 11 s tiny-engine run on 2 cores. An engine
    with processes of its own (a multiprocess EngineCore, several ranks) is shut down
    first, so that none outlives this one; with Ray the process exits as a script does
    (Ray's exit hook stops the local instance it started). ``run_each`` shuts each of
    its engines down and the ``engine_until_exit`` specs exit as a script does, so both
    paths stay tested."""
    if llm is not None:
        from vllm.v1.engine.core_client import InprocClient

        parallel = llm.llm_engine.vllm_config.parallel_config
        if parallel.use_ray:
            return
        if not isinstance(llm.llm_engine.engine_core, InprocClient) or parallel.world_size > 1:
            llm.llm_engine.engine_core.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks of a hung run
    spec = json.load(open(sys.argv[1]))
    if "engines" in spec:
        run_each(spec["engines"])
        _exit_now()
    results, llm = run(spec)
    print("ENGINE_RESULT " + json.dumps(results), flush=True)
    if spec.get("engine_until_exit"):
        _ENGINES_KEPT_UNTIL_EXIT.append(llm)
    else:
        _exit_now(llm)


if __name__ == "__main__":
    main()
