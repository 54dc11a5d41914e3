"""MkDocs hook: links from a docs page to a repository file outside ``docs/``.

The pages are read in two places. On the repository's host, ``[check_gpu.py](../devices/
check_gpu.py)`` opens the file; in the built site there is no such file. So before MkDocs
checks the links, this hook turns each link that leaves ``docs/`` into a link to the file in
the repository (``repo_url`` in ``mkdocs.yml``, when it is set) or else into its plain text.
A link to a path that does not exist in the repository is a warning, which ``mkdocs build
--strict`` turns into an error, as it does for a broken link between pages.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mkdocs.config.defaults import MkDocsConfig
    from mkdocs.structure.files import Files
    from mkdocs.structure.pages import Page

log = logging.getLogger("mkdocs.hooks.repo_links")

#: ``[text](target)`` (not an image), the target relative and without a scheme.
INLINE = re.compile(r"(?<!!)\[(?P<text>[^\]]+)\]\((?P<target>(?![a-z]+:|#|/)[^)\s]+)\)")
#: ``[label]: target`` on a line of its own.
DEFINITION = re.compile(r"^\[(?P<label>[^\]]+)\]:[ \t]*(?P<target>(?![a-z]+:|#|/)\S+)[ \t]*$", re.M)
#: ``[text][label]``.
REFERENCE = re.compile(r"(?<!!)\[(?P<text>[^\]]+)\]\[(?P<label>[^\]]+)\]")


def _outside(page: Page, config: MkDocsConfig, target: str) -> str | None:
    """The repository path ``target`` (relative to ``page``) names, if it leaves ``docs/``."""
    docs = Path(config.docs_dir).resolve()
    root = Path(config.config_file_path).resolve().parent
    path, _, _ = target.partition("#")
    resolved = (docs / PurePosixPath(page.file.src_uri).parent / path).resolve()
    if resolved == docs or docs in resolved.parents:
        return None
    if not resolved.exists():
        log.warning("%s: link %r names %s, which does not exist", page.file.src_uri, target, path)
    relative = resolved.relative_to(root).as_posix() if root in resolved.parents else path
    return relative + ("/" if path.endswith("/") else "")


def _replacement(text: str, path: str, config: MkDocsConfig) -> str:
    if config.repo_url:
        kind = "tree" if path.endswith("/") else "blob"
        return f"[{text}]({config.repo_url.rstrip('/')}/{kind}/HEAD/{path})"
    return text


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Rewrite the page's links that leave ``docs/`` before MkDocs validates them."""
    outside: dict[str, str] = {}

    def definition(match: re.Match[str]) -> str:
        path = _outside(page, config, match["target"])
        if path is None:
            return match[0]
        outside[match["label"].lower()] = path
        return ""

    def reference(match: re.Match[str]) -> str:
        path = outside.get(match["label"].lower())
        return match[0] if path is None else _replacement(match["text"], path, config)

    def inline(match: re.Match[str]) -> str:
        path = _outside(page, config, match["target"])
        return match[0] if path is None else _replacement(match["text"], path, config)

    markdown = DEFINITION.sub(definition, markdown)
    markdown = REFERENCE.sub(reference, markdown)
    return INLINE.sub(inline, markdown)
