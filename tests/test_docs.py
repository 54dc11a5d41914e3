"""The README and the docs site: every Python block runs, and the site builds.

The rules for a ```python block in ``README.md`` or ``docs/**/*.md``:

- It runs on its own: a fresh namespace (``__name__ == "__main__"``), in a fresh temporary
  working folder, so it imports what it uses and may write files.
- Its closing comment lines (the ``#`` lines after its last line of code) are what it prints:
  ``# `` is taken off each, runs of whitespace compare equal, and ``...`` stands for any text,
  as in doctest. A block without closing comments prints nothing.
- A block that cannot run here (it needs TensorFlow, a GPU, MPI) is preceded by
  ``<!-- not run: the reason -->``; it must still compile. Keep those rare.
"""

from __future__ import annotations

import contextlib
import doctest
import importlib.util
import inspect
import io
import logging
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest

import aioreplica

if TYPE_CHECKING:
    from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
DOCUMENTS = [ROOT / "README.md", *sorted(DOCS.glob("**/*.md"))]

FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.M | re.S
)
NOT_RUN = re.compile(r"^\s*<!--\s*not run:(?P<reason>.*?)-->\s*$")


@dataclass(frozen=True)
class Block:
    """One ```python block of a document."""

    path: Path
    line: int  # of the fence's first line
    code: str
    not_run: str | None  # the reason given, when marked

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The Python blocks of ``path``, dedented to the fence's indentation."""
    text = path.read_text()
    found = []
    for match in FENCE.finditer(text):
        indent = match["indent"]
        lines = match["code"].splitlines()
        code = "\n".join(line.removeprefix(indent) for line in lines) + "\n"
        before = text[: match.start()].rstrip("\n").splitlines()
        marker = NOT_RUN.match(before[-1]) if before else None
        line = text.count("\n", 0, match.start()) + 1
        found.append(Block(path, line, code, None if marker is None else marker["reason"]))
    return found


ALL_BLOCKS = [block for path in DOCUMENTS for block in blocks(path)]


def expected_output(code: str) -> str | None:
    """What a block shows it prints: its closing comment lines, or ``None`` if it has none."""
    lines = code.rstrip().splitlines()
    shown: list[str] = []
    while lines and lines[-1].startswith("#"):
        shown.insert(0, lines.pop().removeprefix("#").removeprefix(" "))
    return "\n".join(shown) + "\n" if shown else None


def run_block(block: Block) -> str:
    """Run ``block`` as its own program in the current folder; what it printed."""
    # Blank lines in front, so that a traceback names the document's own line numbers.
    program = compile("\n" * block.line + block.code, str(block.path), "exec")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(program, {"__name__": "__main__"})
    return out.getvalue()


def load_file(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"docs_{path.stem}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TestSnippets:
    @pytest.mark.timeout(60)
    @pytest.mark.parametrize("block", ALL_BLOCKS, ids=[block.name for block in ALL_BLOCKS])
    def test_block_runs_and_prints_what_it_shows(
        self, block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The block runs in a fresh namespace and prints exactly its closing comments."""
        if block.not_run is not None:
            assert block.not_run.strip(), f"{block.name}: `<!-- not run: -->` needs a reason"
            compile(block.code, block.name, "exec")
            return
        monkeypatch.chdir(tmp_path)
        printed = run_block(block)
        expected = expected_output(block.code)
        if expected is None:
            assert printed == "", f"{block.name} prints; show what as closing comments"
            return
        flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
        assert doctest.OutputChecker().check_output(expected, printed, flags), (
            f"{block.name} printed\n{printed}but its closing comments show\n{expected}"
        )

    def test_the_documents_hold_blocks(self) -> None:
        """The README and the concepts, migration and GPU pages each hold a runnable block."""
        runnable = {block.path.name for block in ALL_BLOCKS if block.not_run is None}
        assert {"README.md", "concepts.md", "migration.md", "gpu.md"} <= runnable
        assert sum(block.path.name == "README.md" for block in ALL_BLOCKS) >= 6

    def test_blocks_not_run_are_rare_and_say_why(self) -> None:
        """Only the TensorFlow side of the migration page's comparison is not run."""
        not_run = [(block.path.name, block.not_run) for block in ALL_BLOCKS if block.not_run]
        assert not_run == [
            (
                "migration.md",
                " TensorFlow code, shown for comparison (aioreplica does not need TensorFlow) ",
            )
        ]

    def test_closing_comments_are_the_expected_output(self) -> None:
        """The rule: ``# `` lines after the last code line, with the ``# `` taken off."""
        code = 'print("a")\nx = 1  # not output\n# a\n#\n#   b\n'
        assert expected_output(code) == "a\n\n  b\n"
        assert expected_output("print(1)\n") is None
        assert expected_output("    # indented: code, not output\n") is None

    def test_indented_blocks_and_markers_are_found(self, tmp_path: Path) -> None:
        """A block inside a list item is dedented; a marker applies to the next block only."""
        document = tmp_path / "page.md"
        document.write_text(
            "- item\n\n  ```python\n  print(1)\n  # 1\n  ```\n\n"
            "<!-- not run: needs a GPU -->\n```python\nimport cupy\n```\n"
            "```python\npass\n```\n"
        )
        found = blocks(document)
        assert [(b.line, b.code, b.not_run) for b in found] == [
            (3, "print(1)\n# 1\n", None),
            (9, "import cupy\n", " needs a GPU "),
            (12, "pass\n", None),
        ]

    def test_a_failing_block_names_its_own_line(self, tmp_path: Path) -> None:
        """A block's traceback points at the document's line, not the block's."""
        block = Block(tmp_path / "page.md", 40, "x = 1\nraise ValueError(x)\n", None)
        with pytest.raises(ValueError, match="1") as excinfo:
            run_block(block)
        assert excinfo.traceback[-1].lineno + 1 == 42


# -- the site ------------------------------------------------------------------------------

MKDOCS = (ROOT / "mkdocs.yml").read_text()


def directives() -> dict[str, Path]:
    """Each ``::: aioreplica.name`` of the API reference, and the page it is on."""
    found = {}
    for page in sorted((DOCS / "api").glob("*.md")):
        for name in re.findall(r"^::: aioreplica\.(\w+)$", page.read_text(), re.M):
            assert name not in found, f"{name} is documented twice"
            found[name] = page
    return found


def nav_pages() -> list[str]:
    return re.findall(r"^\s+- (?:[^:\n]+: )?(\S+\.md)$", MKDOCS, re.M)


class TestSite:
    @pytest.mark.timeout(180)
    def test_builds_with_no_warning(self, tmp_path: Path) -> None:
        """``mkdocs build --strict`` (as .ci/run runs it) succeeds: no broken link, no
        docstring griffe cannot read, no missing include."""
        completed = subprocess.run(
            [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=170,
            check=False,
            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        )
        assert completed.returncode == 0, completed.stderr
        assert "WARNING" not in completed.stderr
        benchmarks = (tmp_path / "benchmarks" / "index.html").read_text()
        assert "devices/bench_scheduler.py" in benchmarks  # the README's tables, included
        assert 'class="mermaid"' in (tmp_path / "concepts" / "index.html").read_text()

    def test_every_page_is_in_the_nav(self) -> None:
        """The nav of mkdocs.yml lists every page of docs/, once."""
        pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.glob("**/*.md"))
        assert sorted(nav_pages()) == pages

    def test_the_api_reference_covers_the_public_surface(self) -> None:
        """Every name of ``aioreplica.__all__`` has its ``::: aioreplica.name``, and so does
        the pytest plugin ``aioreplica.testing`` (public, but not imported by ``import
        aioreplica``); nothing else does."""
        assert sorted(directives()) == sorted([*aioreplica.__all__, "testing"])

    def test_every_readme_section_included_exists(self) -> None:
        """Each ``--8<-- "README.md:name"`` names a section the README marks, around text."""
        readme = (ROOT / "README.md").read_text()
        included = {
            name
            for page in DOCS.glob("**/*.md")
            for name in re.findall(r'^--8<-- "README\.md:([\w-]+)"$', page.read_text(), re.M)
        }
        assert included == {"first-step", "platforms", "performance"}
        for name in included:
            section = re.search(
                rf"<!-- --8<-- \[start:{name}\] -->\n(.+?)<!-- --8<-- \[end:{name}\] -->",
                readme,
                re.S,
            )
            assert section is not None, name
            assert len(section[1]) > 500, name

    def test_platform_notes(self) -> None:
        """The README says what is tested (Linux) and what to expect elsewhere."""
        readme = (ROOT / "README.md").read_text()
        section = readme.split("## Platforms", 1)[1].split("\n## ", 1)[0]
        for words in ("Linux", "macOS", "Windows", "uvloop", "CuPy", "MPI", "tested"):
            assert words in section, words


# -- the migration table -------------------------------------------------------------------

#: What each receiver in the table's aioreplica column is.
RECEIVERS: dict[str, Any] = {
    "aioreplica": aioreplica,
    "strategy": aioreplica.MirroredStrategy,
    "strategy.extended": aioreplica.StrategyExtended,
    "ctx": aioreplica.ReplicaContext,
    "v": aioreplica.MirroredVariable,
    "optimizer": aioreplica.optimizers.Optimizer,
    "checkpoint": aioreplica.Checkpoint,
    "manager": aioreplica.CheckpointManager,
    "iterator": aioreplica.DistributedIterator,
}

#: The TensorFlow calls the table must cover.
TF_CALLS = [
    "tf.distribute.MirroredStrategy",
    "strategy.run",
    "strategy.experimental_local_results",
    "strategy.reduce",
    "strategy.gather",
    "strategy.scope",
    "strategy.extended.reduce_to",
    "strategy.extended.batch_reduce_to",
    "strategy.extended.broadcast_to",
    "tf.distribute.ReplicaContext",
    "ctx.merge_call",
    "ctx.all_reduce",
    "ctx.all_gather",
    "ctx.replica_id_in_sync_group",
    "ctx.num_replicas_in_sync",
    "tf.distribute.get_replica_context",
    "tf.distribute.get_strategy",
    "tf.distribute.in_cross_replica_context",
    "tf.Variable",
    "MirroredVariable",
    "SyncOnReadVariable",
    "tf.keras.optimizers.SGD",
    "optimizer.apply_gradients",
    "tf.train.Checkpoint",
    "tf.train.CheckpointManager",
    "strategy.experimental_distribute_dataset",
    "strategy.distribute_datasets_from_function",
    "tf.distribute.InputContext",
    "tf.distribute.experimental.CommunicationOptions",
    "tf.nest",
]


def migration_rows() -> list[tuple[str, str]]:
    """The (TensorFlow, aioreplica) cells of the migration table."""
    text = (DOCS / "migration.md").read_text()
    rows = re.findall(r"^\| (.+?) \| (.+?) \| .+ \|$", text, re.M)
    return [(tf, ours) for tf, ours in rows if tf not in ("TensorFlow", "---")]


def resolve(dotted: str) -> object:
    """The object ``dotted`` (``strategy.extended.reduce_to``) names in the table."""
    for receiver in sorted(RECEIVERS, key=len, reverse=True):
        if dotted == receiver or dotted.startswith(receiver + "."):
            obj: object = RECEIVERS[receiver]
            for name in dotted.removeprefix(receiver).split(".")[1:]:
                obj = inspect.getattr_static(obj, name)
            return obj
    raise LookupError(dotted)


class TestMigrationTable:
    def test_every_aioreplica_name_exists(self) -> None:
        """Each call in the aioreplica column resolves: ``aioreplica.X`` is public, and a
        method or property named on ``strategy``, ``ctx``, ``v``, ... exists."""
        checked = []
        for _, ours in migration_rows():
            for span in re.findall(r"`([^`]+)`", ours):
                match = re.match(r"(?:await )?([a-z_]+(?:\.\w+)+)", span)
                if match is None or match[1].split(".")[0] not in RECEIVERS:
                    continue
                dotted = match[1]
                if dotted.startswith("aioreplica."):
                    public = dotted.split(".")[1]
                    assert public in aioreplica.__all__, dotted
                try:
                    resolve(dotted)
                except (AttributeError, LookupError) as exc:
                    raise AssertionError(f"the migration table names {dotted}: {exc}") from exc
                checked.append(dotted)
        assert len(checked) >= 40

    def test_the_tensorflow_calls_are_all_there(self) -> None:
        """The table has a row for each of TF's calls a migrating program meets."""
        tf_cells = " ".join(tf for tf, _ in migration_rows())
        missing = [call for call in TF_CALLS if f"`{call}" not in tf_cells]
        assert missing == []

    def test_awaited_calls_are_shown_awaited(self) -> None:
        """A method in the aioreplica column that returns an awaitable is written ``await ...``,
        and no other is."""
        for _, ours in migration_rows():
            for span in re.findall(r"`([^`]+\))`", ours):
                match = re.match(r"(await )?([a-z_]+(?:\.\w+)+)\(", span)
                if match is None or match[2].split(".")[0] not in RECEIVERS:
                    continue
                function: Any = resolve(match[2])
                function = getattr(function, "__func__", function)
                signature = inspect.signature(function) if callable(function) else None
                returns = "" if signature is None else str(signature.return_annotation)
                awaitable = inspect.iscoroutinefunction(function) or any(
                    kind in returns for kind in ("Awaitable", "Coroutine")
                )
                assert awaitable == bool(match[1]), span


# -- the hooks of the site -----------------------------------------------------------------


def page_and_config(repo_url: str | None = None) -> tuple[SimpleNamespace, SimpleNamespace]:
    page = SimpleNamespace(file=SimpleNamespace(src_uri="guide/page.md"))
    config = SimpleNamespace(
        docs_dir=str(DOCS), config_file_path=str(ROOT / "mkdocs.yml"), repo_url=repo_url
    )
    return page, config


class TestRepoLinksHook:
    def test_links_out_of_docs_become_text(self, caplog: pytest.LogCaptureFixture) -> None:
        """Inline and reference links to repository files become their text; links between
        pages stay as they are."""
        hook = load_file(DOCS / "_hooks" / "repo_links.py")
        page, config = page_and_config()
        markdown = (
            "See [the check](../../devices/check_gpu.py), [concepts](../concepts.md) and "
            "[the stand-in][sim].\n\n[sim]: ../../tests/cupy_sim/\n"
        )
        with caplog.at_level(logging.WARNING):
            out = hook.on_page_markdown(markdown, page, config, None)
        assert out == "See the check, [concepts](../concepts.md) and the stand-in.\n\n\n"
        assert caplog.records == []

    def test_links_out_of_docs_go_to_the_repository_when_it_is_known(self) -> None:
        """With ``repo_url`` set, such a link points at the file in the repository."""
        hook = load_file(DOCS / "_hooks" / "repo_links.py")
        page, config = page_and_config("https://example.org/aioreplica/")
        out = hook.on_page_markdown("[run.sh](../../devices/run.sh#L3)", page, config, None)
        assert out == "[run.sh](https://example.org/aioreplica/blob/HEAD/devices/run.sh)"

    def test_a_link_to_a_missing_file_is_a_warning(self, caplog: pytest.LogCaptureFixture) -> None:
        """A link to a file the repository lacks is logged as a warning (an error under
        ``--strict``)."""
        hook = load_file(DOCS / "_hooks" / "repo_links.py")
        page, config = page_and_config()
        with caplog.at_level(logging.WARNING):
            hook.on_page_markdown("[gone](../../devices/gone.py)", page, config, None)
        assert [r.getMessage() for r in caplog.records] == [
            "guide/page.md: link '../../devices/gone.py' names ../../devices/gone.py, which "
            "does not exist"
        ]


class TestDocstringExtension:
    def test_habits_become_google_sections(self) -> None:
        """``Example:`` becomes ``Examples:``, grouped arguments are split, a Raises entry
        without a class reads as ``Exception``, and ``Nothing.`` drops the section."""
        normalise = load_file(DOCS / "_hooks" / "griffe_docstrings.py").normalise
        docstring = textwrap.dedent(
            """\
            Summary.

            Args:
                a, b: both.
                    More.
                c: one.

            Raises:
                Whatever ``fn`` raises.

            Example:
                >>> f()
                1
            """
        )
        assert normalise(docstring) == textwrap.dedent(
            """\
            Summary.

            Args:
                a: both.
                    More.
                b: both.
                    More.
                c: one.

            Raises:
                Exception: Whatever ``fn`` raises.

            Examples:
                >>> f()
                1
            """
        ).rstrip("\n")
        assert normalise("Summary.\n\nRaises:\n    Nothing.\n\nReturns:\n    x.") == (
            "Summary.\n\nReturns:\n    x."
        )
