"""Griffe extension: read aioreplica's docstring habits as the Google style griffe parses.

The docstrings are Google style with three habits griffe does not know, each rewritten here
before griffe parses the docstring (the source is not touched):

- ``Example:`` (one example section) is read as ``Examples:``, so its ``>>>`` lines render as
  code instead of as a paragraph.
- An ``Args:`` entry may document several parameters at once (``clipnorm, global_clipnorm:
  ...``): it becomes one entry per parameter.
- A ``Raises:`` section may say that nothing is raised (``Nothing.``), which is dropped, or
  describe what may be raised without naming a class (``Whatever a registered flatten_fn
  raises.``), which is read as ``Exception: ...``.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

#: A section entry: four spaces, then ``name:`` (a parameter, or an exception class).
ENTRY = re.compile(r"^    (?P<names>[A-Za-z_][\w.]*(?:, [A-Za-z_][\w.]*)*):(?P<rest>.*)$")


def _sections(lines: list[str]) -> list[tuple[str | None, list[str]]]:
    """The docstring cut at its section headers (``Title:`` alone on a line, column 0)."""
    parts: list[tuple[str | None, list[str]]] = [(None, [])]
    for line in lines:
        if re.fullmatch(r"[A-Z][A-Za-z ]*:", line):
            parts.append((line[:-1], []))
        else:
            parts[-1][1].append(line)
    return parts


def _entries(body: list[str]) -> list[list[str]]:
    """A section's body cut into entries: an entry line and its deeper-indented lines."""
    entries: list[list[str]] = []
    for line in body:
        if (line.startswith("    ") and not line.startswith("     ")) or not entries:
            entries.append([line])
        else:
            entries[-1].append(line)
    return entries


def _args(body: list[str]) -> list[str]:
    out: list[str] = []
    for entry in _entries(body):
        match = ENTRY.match(entry[0])
        if match is None or ", " not in match["names"]:
            out.extend(entry)
            continue
        for name in match["names"].split(", "):
            out.extend([f"    {name}:{match['rest']}", *entry[1:]])
    return out


def _raises(body: list[str]) -> list[str] | None:
    out: list[str] = []
    for entry in _entries(body):
        text = entry[0].strip()
        if not text or ENTRY.match(entry[0]):
            out.extend(entry)
        elif not text.startswith("Nothing"):
            out.extend([f"    Exception: {text}", *entry[1:]])
    return out if any(line.strip() for line in out) else None


def normalise(docstring: str) -> str:
    """The docstring with the habits above rewritten."""
    lines: list[str] = []
    for title, body in _sections(docstring.splitlines()):
        if title == "Example":
            title = "Examples"
        if title == "Args":
            body = _args(body)
        if title == "Raises":
            raises = _raises(body)
            if raises is None:
                continue
            body = raises
        if title is not None:
            lines.append(f"{title}:")
        lines.extend(body)
    return "\n".join(lines)


class AioreplicaDocstrings(griffe.Extension):
    """Rewrite each docstring's habits as it is loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = normalise(obj.docstring.value)
