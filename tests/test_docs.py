"""The README stays true about configuration and commands."""

from pathlib import Path

from vllm_accel import envs

README = (Path(__file__).parents[1] / "README.md").read_text()


def test_every_env_var_is_documented():
    missing = [name for name in envs.environment_variables if f"`{name}`" not in README]
    assert not missing, f"README's Configuration table lacks {missing}"


def test_readme_shows_the_two_commands():
    assert "make serve" in README and "make test" in README


def test_typed_env_names_match_the_documented_ones():
    """envs.py's TYPE_CHECKING names (what readers and type checkers see) are
    exactly the variables it documents and reads, with the same defaults."""
    import ast
    import os

    tree = ast.parse(Path(envs.__file__).read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If)
                 and getattr(node.test, "id", None) == "TYPE_CHECKING")
    typed = {node.target.id: ast.literal_eval(node.value) for node in block.body}
    assert list(typed) == list(envs.environment_variables)
    saved = {name: os.environ.pop(name, None) for name in typed}
    try:
        for name, default in typed.items():
            got = getattr(envs, name)
            want = os.path.expanduser(default) if isinstance(default, str) else default
            assert got == want and type(got) is type(default), name
    finally:
        os.environ.update({k: v for k, v in saved.items() if v is not None})
