"""Recording what the ``aioreplica`` logger logs, shared by the tests of its messages."""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator


class Records(logging.Handler):
    """Keeps the records of the ``aioreplica`` logger at ``level`` and above; ``first`` is set
    by the first one (on whatever thread logs it)."""

    def __init__(self, level: int = logging.DEBUG) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []
        self.first = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.first.set()

    def warnings(self) -> list[logging.LogRecord]:
        return [record for record in self.records if record.levelno == logging.WARNING]


@contextlib.contextmanager
def recorded(level: int = logging.DEBUG) -> Iterator[Records]:
    """The ``aioreplica`` logger's records at ``level`` and above, while the block runs."""
    handler = Records(level)
    logger = logging.getLogger("aioreplica")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
