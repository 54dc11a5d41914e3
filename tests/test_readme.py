"""The README's promises: its example prints what it says, CI runs its test command and builds
the docs, and its links lead somewhere. (tests/test_docs.py runs every Python block.)"""

from __future__ import annotations

import contextlib
import io
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def shell_commands() -> list[str]:
    return [block.strip() for block in re.findall(r"```sh\n(.*?)```", README, re.S)]


def slug(heading: str) -> str:
    """The anchor a Markdown heading gets (GitHub's and MkDocs' rule for plain words)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


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

    def test_ci_builds_the_docs_strictly(self) -> None:
        """.ci/run builds the docs site with warnings as errors, after the suite."""
        ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
        builds = [line for line in ci_lines if "mkdocs build" in line]
        assert len(builds) == 1
        assert builds[0].endswith(".venv/bin/mkdocs build --strict")
        assert ci_lines.index(builds[0]) > ci_lines.index(shell_commands()[1])

    def test_the_test_extra_brings_the_docs_tools(self) -> None:
        """The README's single install (``.[test]``) includes the ``docs`` extra, which holds
        MkDocs, the Material theme and mkdocstrings."""
        project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        extras = project["optional-dependencies"]
        assert "aioreplica[docs]" in extras["test"]
        assert [re.split(r"[<>=\[]", requirement)[0] for requirement in extras["docs"]] == [
            "mkdocs",
            "mkdocs-material",
            "mkdocstrings",
        ]
        assert "mkdocstrings[python]" in extras["docs"][2]

    def test_relative_links_lead_somewhere(self) -> None:
        """Every relative link names a file of the repository, and an anchor into a Markdown
        file names one of its headings."""
        links = re.findall(r"\]\(((?![a-z]+:)[^)\s]+)\)", README)
        assert len(links) >= 8
        for link in links:
            path, _, anchor = link.partition("#")
            target = ROOT / path
            assert target.exists(), link
            if anchor:
                headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
                assert anchor in {slug(heading) for heading in headings}, link
