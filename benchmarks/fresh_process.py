"""One engine of a benchmark in a fresh interpreter: the script again with ``--worker
SPEC``, which prints ``BENCH_RESULT <json>``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run(script: str, name: str, spec: dict, env: dict | None = None) -> dict:
    """``script --worker`` on ``spec`` (with ``env`` added); its result, printed and
    returned; the process's output tail on failure."""
    path = Path(f"/tmp/{Path(script).stem}-{name}.json")
    path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, script, "--worker", str(path)],
                          capture_output=True, text=True, timeout=1800,
                          env={**os.environ, **(env or {})})
    line = next((x for x in proc.stdout.splitlines() if x.startswith("BENCH_RESULT ")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    result = json.loads(line.split(" ", 1)[1])
    print(f"{name}: {result}", flush=True)
    return result
