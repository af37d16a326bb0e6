"""CI runs the README's test command as a user pastes it (.ci/run), and lints before the tests: a lint finding fails
CI in seconds, not after the ~24 minutes of pytest."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def ci_command() -> str:
    """The command of .ci/run: its last line (those above it set up the shell)."""
    lines = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line.strip()]
    return lines[-1]


def test_ci_runs_the_readme_test_command_verbatim():
    command = ci_command()
    readme_lines = [line.split("  #")[0].rstrip() for line in (REPO / "README.md").read_text().splitlines()]
    assert command in readme_lines, f".ci/run's command is not a README line as written:\n{command}"


def test_ci_lints_before_the_tests():
    steps = [step.strip() for step in ci_command().split("&&")]
    lint = next((i for i, step in enumerate(steps) if step.startswith(".venv/bin/ruff check")), None)
    tests = next(i for i, step in enumerate(steps) if "-m pytest" in step)
    assert lint is not None and lint < tests, f"CI runs no `ruff check` before pytest: {steps}"
