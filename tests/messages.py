"""Matching error messages by what they say, shared by the tests of those messages."""

from __future__ import annotations


def mentions(*patterns: str) -> str:
    """A regex matching a message that contains every pattern, in any order."""
    return "(?s)" + "".join(f"(?=.*{pattern})" for pattern in patterns)
