"""The README and docs/ stay true: the configuration reference is envs.py's, links
resolve, the commands and files they show exist, and they speak of the project only."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_accel import envs
from vllm_accel.tools import configuration

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
#: a Markdown link's target: [text](target)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
#: work-history wording the documents must not use
DIARY = re.compile(r"\bsessions?\b|this VM's speed moved", re.IGNORECASE)


def test_configuration_page_is_generated_from_envs():
    """docs/configuration.md is exactly what envs.py generates (run
    ``python -m vllm_accel.tools.configuration --write`` after changing a variable)."""
    assert configuration.DOC_PATH.read_text() == configuration.render()
    text = configuration.render()
    assert all(f"| `{name}` |" in text for name in envs.environment_variables)


def test_support_table_is_generated_from_the_engine_tests():
    """docs/supported-models.md's family table is what the engine tests' case lists
    generate (run ``python tests/support_matrix.py --write`` after changing them)."""
    import support_matrix

    text = support_matrix.PAGE.read_text()
    assert support_matrix.page_with(support_matrix.render()) == text
    assert "| deepseek_v2 |" in text and "| gemma2 |" in text


def test_readme_shows_the_two_commands_and_stays_short():
    text = README.read_text()
    assert "make serve" in text and "make test" in text
    assert len(text.splitlines()) <= 300


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_pages_speak_of_the_project_only(page):
    hits = [line for line in page.read_text().splitlines() if DIARY.search(line)]
    assert not hits, hits


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_resolve(page):
    """Relative links point to files that exist (anchors: to a heading of the page)."""
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md":
            slugs = {re.sub(r"[^\w\- ]", "", h.lower()).strip().replace(" ", "-")
                     for h in re.findall(r"^#+ (.+)$", dest.read_text(), re.MULTILINE)}
            if anchor not in slugs:
                broken.append(target)
    assert not broken, broken


def _shown_commands() -> list[str]:
    """The shell commands in the pages' bash blocks."""
    commands = []
    for page in PAGES:
        for block in re.findall(r"```(?:bash|sh)\n(.*?)```", page.read_text(), re.DOTALL):
            for line in block.splitlines():
                line = line.split(" #", 1)[0].strip()
                if line and not line.startswith("#"):
                    commands.append(line)
    return commands


def test_shown_files_and_make_targets_exist():
    """Every ``make`` target, repository script and ``python -m`` module a page shows
    exists."""
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.MULTILINE))
    missing = []
    for command in _shown_commands():
        words = shlex.split(command.replace("\\", ""), posix=True)
        for i, word in enumerate(words):
            if word == "make" and i + 1 < len(words) and not words[i + 1].startswith("-"):
                if "=" not in words[i + 1] and words[i + 1] not in targets:
                    missing.append(command)
            if re.match(r"^(benchmarks|scripts|tests)/[\w/]+\.(py|sh)$", word) \
                    and not (ROOT / word).exists():
                missing.append(word)
            if word == "-m" and i + 1 < len(words) and words[i + 1].startswith("vllm_accel"):
                module = words[i + 1].replace(".", "/")
                if not ((ROOT / f"{module}.py").exists() or (ROOT / module).is_dir()):
                    missing.append(words[i + 1])
    assert not missing, missing


def test_shown_vllm_serve_flags_exist():
    """Every flag a page passes to ``vllm serve`` is one vLLM's serve parser (with the
    plugin's ``--device``) knows."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_accel.platform import AccelPlatform

    parser = make_arg_parser(FlexibleArgumentParser())
    AccelPlatform.pre_register_and_update(parser)
    known = set(parser._option_string_actions)
    text = "\n".join(_shown_commands()).replace("\\\n", " ")
    shown = {flag for line in text.splitlines() if "vllm serve" in line
             for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", line)}
    assert shown and not shown - known, shown - known


def test_cheap_shown_commands_run():
    """The pages' ``python -m vllm_accel...`` commands that print and exit run (the
    scripts' --help for the benchmarks)."""
    runs = [[sys.executable, "-m", "vllm_accel.tools.configuration"],
            [sys.executable, "-m", "vllm_accel.tools.models", "--help"]]
    runs += [[sys.executable, str(ROOT / script), "--help"] for script in sorted(
        {word for c in _shown_commands() for word in shlex.split(c.replace("\\", ""))
         if re.match(r"^benchmarks/\w+\.py$", word)} - {"benchmarks/as_cpu.py"})]
    for cmd in runs:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (cmd, proc.stderr[-2000:])


def test_typed_env_names_match_the_documented_ones():
    """envs.py's TYPE_CHECKING names (what readers and type checkers see) are
    exactly the variables it documents and reads, with the same defaults."""
    import os

    typed = configuration.defaults()
    assert list(typed) == list(envs.environment_variables)
    saved = {name: os.environ.pop(name, None) for name in typed}
    try:
        for name, default in typed.items():
            got = getattr(envs, name)
            want = os.path.expanduser(default) if isinstance(default, str) else default
            assert got == want and type(got) is type(default), name
    finally:
        os.environ.update({k: v for k, v in saved.items() if v is not None})
