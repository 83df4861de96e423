"""``docs/configuration.md``, generated from ``vllm_accel/envs.py``: every ``ACCEL_*``
variable with its default and meaning, and the vLLM settings the plugin changes.

    python -m vllm_accel.tools.configuration           # print it
    python -m vllm_accel.tools.configuration --write   # write docs/configuration.md

``tests/test_docs.py`` holds the committed file equal to this output.
"""

import argparse
import ast
from pathlib import Path

from vllm_accel import envs

#: the repository's copy (an installed package has no docs/)
DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

#: vLLM flags and variables whose meaning or default the plugin changes, and how
VLLM_SETTINGS = (
    ("`--device {gcu,sophtpu}`",
     "Added by the plugin (vLLM 0.32 has no `--device`): the accelerator to serve on; it "
     "must match the active backend (`ACCEL_BACKEND`). Exported as `ACCEL_DEVICE` to the "
     "spawned EngineCore and workers."),
    ("`--kv-cache-dtype`",
     "Adds `int8` (vLLM's `int8_per_token_head`: int8 K and V with a float32 scale per "
     "token and head, ~1.9x the tokens of a bf16 cache). `fp8`, `fp8_e4m3`, `fp8_e5m2`, "
     "`bfloat16`, `float16` and `auto` work as on stock vLLM CPU; any other value fails at "
     "startup listing these."),
    ("`--block-size`",
     "Default 64 on the GCU (stock CPU: 128); any multiple of 16."),
    ("`--gpu-memory-utilization`",
     "On the simulated GCU a fraction of the **simulated device memory** "
     "(`ACCEL_SIM_DEVICE_MEMORY_GB`), as on a real card, not of host RAM as on stock "
     "vLLM CPU, so a plain `vllm serve MODEL --device gcu` always fits the host. The KV "
     "cache gets capacity x utilization - weights - activation reserve "
     "(`--kv-cache-memory-bytes` sets it exactly); the startup log states each term."),
    ("`--pipeline-parallel-size`",
     "Refused at startup: vLLM 0.32's CPU path loses requests between stages (stock "
     "`CpuPlatform` too). Use `--tensor-parallel-size`."),
    ("`--distributed-executor-backend ray`",
     "Mapped to vLLM's Ray executor V2 with the simulated devices declared to Ray; with "
     "no cluster running, a local Ray instance is started; a cluster with too few device "
     "slots fails at once naming `ray start --num-gpus N`."),
    ("`--nnodes` > 1",
     "A rank waits at most 300 s for its peers unless `--distributed-timeout-seconds` "
     "says otherwise (torch's own default is 30 minutes)."),
    ("torch.compile on a card",
     "Real cards and the virtual card run eagerly (no device graphs wired up yet); the "
     "simulator compiles as stock vLLM CPU does."),
    ("`VLLM_USE_V2_MODEL_RUNNER`",
     "Set to 0 (if unset) in every process, so all of them agree on the V1 runner."),
    ("`VLLM_CPU_NUM_OF_RESERVED_CPU`",
     "Set to 0 for a lone simulated device's engine (see "
     "`ACCEL_SIM_SHARE_SCHEDULER_CORE`); an exported value wins."),
    ("`VLLM_CPU_SIM_MULTI_NUMA`",
     "Set to 1 when `--tensor-parallel-size` exceeds the host's NUMA nodes, so vLLM's CPU "
     "binding gives each simulated device (one worker process per rank) its share of the "
     "cores instead of refusing to start."),
    ("`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`, `MALLOC_TOP_PAD_`",
     "Set (if unset) for EngineCore and the workers: the simulated device's caching "
     "allocator, so per-step buffers are reused instead of page-faulted in again."),
)


def defaults() -> dict[str, object]:
    """Each variable's default, as envs.py's ``TYPE_CHECKING`` block types it."""
    tree = ast.parse(Path(envs.__file__).read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If)
                 and getattr(node.test, "id", None) == "TYPE_CHECKING")
    return {node.target.id: ast.literal_eval(node.value) for node in block.body}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    """The Markdown of docs/configuration.md."""
    values = defaults()
    lines = [
        "# Configuration",
        "",
        "Environment variables the plugin reads (`vllm_accel/envs.py`, read lazily, so a value "
        "exported before `vllm serve` or `LLM(...)` reaches the spawned EngineCore and "
        "workers), then the vLLM flags and variables whose meaning the plugin changes. "
        "vLLM's other flags keep their meaning. This page is generated: "
        "`python -m vllm_accel.tools.configuration --write`.",
        "",
        "## `ACCEL_*` variables",
        "",
        "| Variable | Default | Meaning |",
        "|---|---|---|",
    ]
    for name, (_, doc) in envs.environment_variables.items():
        default = values[name]
        shown = ("`on`" if default else "`off`") if isinstance(default, bool) else (
            f"`{default}`" if default != "" else "(empty)")
        lines.append(f"| `{name}` | {shown} | {_cell(doc)} |")
    lines += ["", "## vLLM settings the plugin changes", "", "| Setting | On the plugin |",
              "|---|---|"]
    lines += [f"| {setting} | {_cell(doc)} |" for setting, doc in VLLM_SETTINGS]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write {DOC_PATH}")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        DOC_PATH.parent.mkdir(exist_ok=True)
        DOC_PATH.write_text(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
