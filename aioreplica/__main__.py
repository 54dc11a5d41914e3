"""``python -m aioreplica``: ``info``, ``trace-summary RUN.json``, ``--version``, ``--help``.

The commands and their output are described in ``aioreplica._cli``.
"""

from __future__ import annotations

import os
import sys

from ._cli import main


def _run() -> int:
    """``main()``, quiet when the reader of stdout goes away (``python -m aioreplica info |
    head -1``): status 1, and no traceback (the recipe in Python's ``signal`` docs)."""
    try:
        status = main()
        sys.stdout.flush()
    except BrokenPipeError:
        # Point stdout at devnull, so the interpreter's own flush at exit fails no more.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return status


if __name__ == "__main__":
    sys.exit(_run())
