"""The README stays true about configuration and commands."""

from pathlib import Path

from vllm_accel import envs

README = (Path(__file__).parents[1] / "README.md").read_text()


def test_every_env_var_is_documented():
    missing = [name for name in envs.environment_variables if f"`{name}`" not in README]
    assert not missing, f"README's Configuration table lacks {missing}"


def test_readme_shows_the_two_commands():
    assert "make serve" in README and "make test" in README
