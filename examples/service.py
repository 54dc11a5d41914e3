"""Serve a digits classifier over HTTP while it keeps training, on one event loop.

A Starlette app, run under uvicorn: while it serves, a background task trains the digits model
of ``train_digits.py`` data-parallel on host replicas, step after step, until shutdown. Every
request is served between training steps: the replicas' compute runs on their devices' worker
threads, so the event loop stays free (``/health`` answers in milliseconds while training).

- ``POST /predict`` with JSON ``{"inputs": [[64 floats], ...]}`` (8x8 digit images, row by row,
  values 0-1) answers ``{"predictions": [digit, ...]}``: the rows are split across the replicas
  and classified with the current weights by one ``strategy.run``.
- ``GET /metrics``: Prometheus text: ``aioreplica_loss`` (the mean batch loss over the last
  epoch of steps), ``aioreplica_steps_total``, ``aioreplica_epochs_total``,
  ``aioreplica_test_accuracy`` (after each epoch), and every field of
  ``strategy.statistics()`` as ``aioreplica_strategy_<field>`` (per-replica tuples as series
  labelled ``replica``).
- ``GET /health``: ``{"status": "ok", "steps": ..., "training": ...}``; after a training step
  failed, 503 and ``{"status": "failed", ..., "error": "..."}`` (the error and its replica):
  training stops there, the failure's traceback goes to stderr, and ``/predict`` goes on with
  the last weights.

A ``/predict`` body is parsed on the event loop, so its size is bounded: more than
``MAX_ROWS`` rows is a 400 and a body over ``MAX_BODY`` bytes a 413, refused before it is read
further.

At shutdown (Ctrl-C, SIGTERM) uvicorn finishes the requests in flight, then the app's lifespan
ends: it cancels the training task and closes the strategy (``async with strategy``), which
stops the devices' worker threads; the process exits with code 0.

Run it::

    python examples/service.py --port 8000          # 2 host replicas
    curl localhost:8000/health
    curl localhost:8000/metrics
    curl -X POST localhost:8000/predict -d '{"inputs": [[0.0, 0.5, ...64 values...]]}'
    cd examples && uvicorn service:app --port 8000  # the module-level app, default settings
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import math
import re
import signal
import threading
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import train_digits  # this folder's training example: the model, the data, one training step
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

import aioreplica
from aioreplica.optimizers import SGD

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from numpy.typing import NDArray
    from starlette.requests import Request

FEATURES = 64
#: Rows one /predict request may classify; more is refused (400) rather than stalling others
#: (its JSON is parsed on the event loop: 1024 rows take about 25 ms on a slow core).
MAX_ROWS = 1024
#: Bytes a /predict body may have: MAX_ROWS rows of numbers of up to 30 characters. A longer
#: body is refused (413) as it arrives, before it is parsed.
MAX_BODY = MAX_ROWS * FEATURES * 32


@dataclass(frozen=True)
class Settings:
    """How the service trains. ``max_steps=None`` trains until shutdown."""

    replicas: int = 2
    global_batch: int = 64
    learning_rate: float = 0.1
    momentum: float = 0.9
    seed: int = 0
    max_steps: int | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.global_batch < self.replicas:
            raise ValueError(
                f"global_batch ({self.global_batch}) must be at least replicas ({self.replicas})"
            )
        if self.max_steps is not None and self.max_steps < 0:
            raise ValueError(f"max_steps must be >= 0 or None, got {self.max_steps}")


class BadInput(ValueError):
    """A /predict body that is not ``{"inputs": [[64 numbers], ...]}``."""


class BodyTooLarge(BadInput):
    """A /predict body over ``MAX_BODY`` bytes."""


class Trainer:
    """The model, its strategy and the training loop; what the endpoints read."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.strategy = aioreplica.MirroredStrategy([f"cpu:{i}" for i in range(settings.replicas)])
        self.x_train, self.y_train, self.x_test, self.y_test = train_digits.load_data(settings.seed)
        with self.strategy.scope():
            self.params = {
                name: aioreplica.Variable(value, name=name)
                for name, value in train_digits.init_params(settings.seed).items()
            }
        self.optimizer = SGD(settings.learning_rate, momentum=settings.momentum)
        self.steps_per_epoch = len(self.y_train) // settings.global_batch
        self.recent_losses: collections.deque[float] = collections.deque(
            maxlen=self.steps_per_epoch
        )
        self.steps = 0
        self.epochs = 0
        self.test_accuracy = math.nan
        self.training = False
        self.failure: str | None = None  # the error that ended training, with its replica
        self.stopped = anyio.Event()  # set when training ends (max_steps, cancelled, failed)

    @property
    def loss(self) -> float:
        """The mean batch loss over the last epoch of steps (NaN before the first step)."""
        if not self.recent_losses:
            return math.nan
        return sum(self.recent_losses) / len(self.recent_losses)

    async def train(self) -> None:
        """Train until cancelled (or ``max_steps``): one ``strategy.run`` per step.

        A step that fails ends training, not the service: the error is kept in ``failure``
        (``/health`` reports it) and its traceback printed; the strategy stays open, so
        ``/predict`` goes on with the last weights (a failed step applies no update).
        """
        settings = self.settings
        batches = aioreplica.batched(
            (self.x_train, self.y_train), settings.global_batch, shuffle=True, seed=settings.seed
        )
        dataset = self.strategy.distribute_dataset(batches, drop_remainder=True)
        step_args = (self.params, self.optimizer, settings.global_batch)
        self.training = True
        try:
            while not self._done():
                async with contextlib.aclosing(aiter(dataset)) as epoch:
                    async for batch in epoch:
                        losses = await self.strategy.run(
                            train_digits.train_step, (batch, *step_args)
                        )
                        self.recent_losses.append(float(await self.strategy.reduce("sum", losses)))
                        self.steps += 1
                        if self._done():
                            break
                    else:
                        self.epochs += 1
                        weights = {name: v.numpy() for name, v in self.params.items()}
                        self.test_accuracy = train_digits.accuracy(
                            weights, self.x_test, self.y_test
                        )
        except Exception as exc:
            self.failure = " ".join([f"{type(exc).__name__}: {exc}", *_notes(exc)])
            traceback.print_exception(exc)
        finally:
            self.training = False
            self.stopped.set()

    def _done(self) -> bool:
        return self.settings.max_steps is not None and self.steps >= self.settings.max_steps

    async def predict(self, rows: NDArray[np.float64]) -> list[int]:
        """The digit of each row: the rows split across the replicas, one ``strategy.run``."""
        replicas = self.strategy.num_replicas_in_sync
        parts = aioreplica.PerReplica(np.array_split(rows, replicas))
        result = await self.strategy.run(_predict_step, (parts, self.params))
        return [int(d) for part in self.strategy.experimental_local_results(result) for d in part]


def _notes(exc: BaseException) -> list[str]:
    """An exception's notes in parentheses (``run()`` notes the replica that raised)."""
    return [f"({note})" for note in getattr(exc, "__notes__", [])]


async def _predict_step(rows: NDArray[Any], params: dict[str, aioreplica.Variable]) -> Any:
    """One replica's rows classified on its device's worker thread."""
    context = aioreplica.get_replica_context()
    assert context is not None
    device = context.device
    weights = {name: variable.value() for name, variable in params.items()}
    return await device.run(_classify, device.xp, weights, device.asarray(rows))


def _classify(xp: Any, weights: dict[str, Any], rows: Any) -> Any:
    return xp.argmax(train_digits.logits(xp, weights, rows), axis=1)


# -- input -------------------------------------------------------------------------------------


async def read_body(request: Request) -> bytes:
    """The request's body, read no further than ``MAX_BODY`` bytes.

    Raises:
        BodyTooLarge: the body (its declared length, or the bytes arrived so far) is over
            ``MAX_BODY`` bytes.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise _too_large()
    chunks: list[bytes] = []
    size = 0
    async with contextlib.aclosing(request.stream()) as stream:
        async for chunk in stream:
            size += len(chunk)
            if size > MAX_BODY:
                raise _too_large()
            chunks.append(chunk)
    return b"".join(chunks)


def _too_large() -> BodyTooLarge:
    return BodyTooLarge(
        f"the body is over {MAX_BODY} bytes; send at most {MAX_ROWS} rows of {FEATURES} "
        "numbers per request"
    )


def parse_inputs(body: bytes) -> NDArray[np.float64]:
    """The rows of a /predict body as a ``(rows, 64)`` array.

    Raises:
        BadInput: the body is not JSON, or not ``{"inputs": [[64 finite numbers], ...]}`` with
            1 to ``MAX_ROWS`` rows; the message says which part is wrong.
    """
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadInput(f"the body is not valid JSON ({exc})") from None
    if not isinstance(document, dict) or "inputs" not in document:
        raise BadInput('the body must be a JSON object {"inputs": [[64 numbers], ...]}')
    inputs = document["inputs"]
    if not isinstance(inputs, list):
        raise BadInput(f'"inputs" must be a list of rows, got {_json_type(inputs)}')
    if not inputs:
        raise BadInput('"inputs" is empty: send at least one row of 64 numbers')
    if len(inputs) > MAX_ROWS:
        raise BadInput(f'"inputs" has {len(inputs)} rows; send at most {MAX_ROWS} per request')
    if all(isinstance(row, list) and len(row) == FEATURES for row in inputs) and {
        type(value) for row in inputs for value in row
    } <= {int, float}:
        pass  # the common case, checked in one pass; the loop below finds what is wrong
    else:
        _check_rows(inputs)
    rows = np.asarray(inputs, dtype=np.float64)
    if not np.isfinite(rows).all():
        raise BadInput('"inputs" holds a value that is not finite')  # Python's json reads NaN
    return rows


def _check_rows(inputs: list[Any]) -> None:
    """Raise ``BadInput`` naming the first row or value that is not a number."""
    for i, row in enumerate(inputs):
        if not isinstance(row, list):
            raise BadInput(
                f'"inputs"[{i}] must be a list of {FEATURES} numbers, got {_json_type(row)}'
            )
        if len(row) != FEATURES:
            raise BadInput(
                f'"inputs"[{i}] has {len(row)} values; each row is an 8x8 image: {FEATURES} numbers'
            )
        for j, value in enumerate(row):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise BadInput(f'"inputs"[{i}][{j}] must be a number, got {_json_type(value)}')


def _json_type(value: object) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    return names.get(
        type(value), f"the number {value!r}" if isinstance(value, int | float) else "?"
    )


# -- metrics -----------------------------------------------------------------------------------

#: Statistics fields that only grow; every other field is a gauge.
_COUNTER_FIELDS = frozenset({"merge_rounds_completed", "steps", "wait_total"})


def render_metrics(trainer: Trainer) -> str:
    """The Prometheus text exposition (format 0.0.4) of the trainer and its statistics."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: Sequence[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(f"{name}{labels} {_number(value)}" for labels, value in samples)

    metric(
        "aioreplica_loss",
        "gauge",
        "Training cross-entropy: the mean batch loss over the last epoch of steps.",
        [("", trainer.loss)],
    )
    metric("aioreplica_steps_total", "counter", "Training steps completed.", [("", trainer.steps)])
    metric(
        "aioreplica_epochs_total", "counter", "Training epochs completed.", [("", trainer.epochs)]
    )
    metric(
        "aioreplica_test_accuracy",
        "gauge",
        "Fraction of the held-out test set classified right, after the last epoch.",
        [("", trainer.test_accuracy)],
    )
    statistics = trainer.strategy.statistics()
    helps = _attribute_docs(type(statistics))
    for field, value in _fields(statistics):
        samples = _samples(value)
        if samples is None:
            continue  # not a number (None before the first run, say): no sample
        name = f"aioreplica_strategy_{field}"
        kind = "counter" if field in _COUNTER_FIELDS else "gauge"
        help_text = helps.get(field, f"strategy.statistics().{field}")
        metric(name, kind, help_text, samples)
    return "\n".join(lines) + "\n"


def _fields(statistics: Any) -> list[tuple[str, Any]]:
    """The fields of a statistics snapshot (a dataclass or a NamedTuple), in order."""
    if dataclasses.is_dataclass(statistics):
        return [(f.name, getattr(statistics, f.name)) for f in dataclasses.fields(statistics)]
    if hasattr(statistics, "_asdict"):
        return list(statistics._asdict().items())
    return list(vars(statistics).items())


def _samples(value: Any) -> list[tuple[str, float]] | None:
    """One unlabelled sample for a number; one per replica for a tuple; ``None`` otherwise."""
    if _is_number(value):
        return [("", value)]
    if isinstance(value, tuple | list) and value and all(_is_number(v) for v in value):
        return [(f'{{replica="{i}"}}', v) for i, v in enumerate(value)]
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)


def _number(value: float) -> str:
    if isinstance(value, int | np.integer):
        return str(int(value))
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def _attribute_docs(cls: type) -> dict[str, str]:
    """``field: text`` lines of the ``Attributes:`` section of a class docstring, one line each."""
    docs: dict[str, str] = {}
    section = (cls.__doc__ or "").partition("Attributes:")[2]
    current = None
    for line in section.splitlines():
        match = re.match(r"\s+(\w+):\s*(.*)", line)
        if match and match.group(1) != "Example":
            current = match.group(1)
            docs[current] = match.group(2).strip()
        elif current is not None and line.strip():
            docs[current] += " " + line.strip()
        elif current is not None:
            break  # a blank line ends the section
    # One line each, without reST markup; HELP text escapes backslashes.
    return {
        name: " ".join(text.replace("``", "").replace("\\", "\\\\").split())
        for name, text in docs.items()
    }


# -- the app -----------------------------------------------------------------------------------


def create_app(settings: Settings | None = None) -> Starlette:
    """The Starlette app: training starts with its lifespan and stops when it ends."""
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        trainer = Trainer(settings)
        app.state.trainer = trainer
        async with trainer.strategy, anyio.create_task_group() as group:
            group.start_soon(trainer.train)
            print(
                f"training on {trainer.strategy.num_replicas_in_sync} replicas "
                f"({', '.join(trainer.strategy.devices)})",
                flush=True,
            )
            yield
            group.cancel_scope.cancel()  # the end of the lifespan ends training
        left = [t.name for t in threading.enumerate() if t.name.startswith("aioreplica cpu:")]
        print(
            f"training stopped after {trainer.steps} steps (loss {trainer.loss:.4f}); "
            f"{len(left)} device threads left",
            flush=True,
        )

    async def predict(request: Request) -> JSONResponse:
        try:
            rows = parse_inputs(await read_body(request))
        except BadInput as exc:
            status = 413 if isinstance(exc, BodyTooLarge) else 400
            return JSONResponse({"error": str(exc)}, status_code=status)
        predictions = await request.app.state.trainer.predict(rows)
        return JSONResponse({"predictions": predictions})

    async def metrics(request: Request) -> PlainTextResponse:
        return PlainTextResponse(
            render_metrics(request.app.state.trainer),
            media_type="text/plain; version=0.0.4; charset=utf-8",
        )

    async def health(request: Request) -> JSONResponse:
        trainer: Trainer = request.app.state.trainer
        state = {"steps": trainer.steps, "training": trainer.training}
        if trainer.failure is not None:
            return JSONResponse(
                {"status": "failed", **state, "error": trainer.failure}, status_code=503
            )
        return JSONResponse({"status": "ok", **state})

    routes = [
        Route("/predict", predict, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


app = create_app()


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and serve until interrupted; the exit code (0 on Ctrl-C)."""
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--replicas", type=int, default=2, help="host replicas (default 2)")
    parser.add_argument("--batch-size", type=int, default=64, help="the global batch size")
    parser.add_argument("--learning-rate", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--max-steps", type=int, help="stop training after this many steps")
    parser.add_argument("--log-level", default="info", help="uvicorn's log level")
    options = parser.parse_args(argv)
    try:
        settings = Settings(
            replicas=options.replicas,
            global_batch=options.batch_size,
            learning_rate=options.learning_rate,
            momentum=options.momentum,
            max_steps=options.max_steps,
        )
    except ValueError as exc:
        parser.error(str(exc))
    config = uvicorn.Config(
        create_app(settings),
        host=options.host,
        port=options.port,
        log_level=options.log_level,
        access_log=False,  # a line per request would drown the rest
    )
    # On SIGINT or SIGTERM uvicorn shuts down gracefully (the lifespan ends), then raises the
    # signal it caught again under the handler that was there before: KeyboardInterrupt for
    # both here (SIGTERM's default would kill the process with -15), then a clean exit.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            uvicorn.Server(config).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
