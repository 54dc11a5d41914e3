"""The README's promises: its example prints what it says, and CI runs its test command."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def shell_commands() -> list[str]:
    return [block.strip() for block in re.findall(r"```sh\n(.*?)```", README, re.S)]


class TestReadme:
    def test_example_prints_what_it_claims(self) -> None:
        """The first Python block prints the line its last comment shows."""
        code = re.findall(r"```python\n(.*?)```", README, re.S)[0]
        expected = code.rstrip().splitlines()[-1].removeprefix("# ")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
        assert out.getvalue().strip() == expected

    def test_two_start_commands(self) -> None:
        """The first two commands install and run the example, then install and run tests."""
        run_example, run_tests = shell_commands()[:2]
        assert "'.[examples]'" in run_example
        assert run_example.endswith("examples/train_digits.py")
        assert "'.[test]'" in run_tests
        assert run_tests.endswith("-m pytest")

    def test_ci_runs_the_readme_test_command(self) -> None:
        """.ci/run contains the README's test command verbatim."""
        ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
        assert shell_commands()[1] in ci_lines
