"""Hypothesis strategies for random nested structures, shared by the tree and values tests."""

from __future__ import annotations

import collections
from typing import Any

from hypothesis import strategies as st

Point = collections.namedtuple("Point", ["x", "y"])

leaves = st.one_of(st.integers(-3, 3), st.text(max_size=3), st.none())


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=2), children, max_size=3),
        st.builds(Point, children, children),
    )


def structures(max_leaves: int) -> st.SearchStrategy[Any]:
    """Lists, tuples, dicts and namedtuples of small ints, short strings and None."""
    return st.recursive(leaves, _containers, max_leaves=max_leaves)
