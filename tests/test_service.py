"""examples/service.py: training in the background while it serves HTTP."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import math
import re
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
import pytest

if TYPE_CHECKING:
    from collections.abc import Iterator

    import httpx

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture
def service(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """examples/service.py loaded as a module (it imports train_digits from its folder)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    spec = importlib.util.spec_from_file_location("examples_service", EXAMPLES / "service.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as ``{name{labels}: value}``, checking every line's syntax: each sample
    follows a ``# HELP`` and a ``# TYPE`` line of its own metric."""
    samples: dict[str, float] = {}
    declared: dict[str, list[str]] = {}
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# "):
            match = re.fullmatch(r"# (HELP|TYPE) (aioreplica_\w+) (.+)", line)
            assert match, line
            declared.setdefault(match.group(2), []).append(match.group(1))
            if match.group(1) == "TYPE":
                assert match.group(3) in ("gauge", "counter"), line
            continue
        match = re.fullmatch(r'(aioreplica_\w+)((?:\{replica="\d+"\})?) (\S+)', line)
        assert match, line
        assert declared.get(match.group(1)) == ["HELP", "TYPE"], line
        samples[match.group(1) + match.group(2)] = float(match.group(3))
    return samples


def p99(latencies: list[float]) -> float:
    """The 99th percentile by nearest rank."""
    ordered = sorted(latencies)
    return ordered[math.ceil(0.99 * len(ordered)) - 1]


class TestOverHTTP:
    @pytest.mark.timeout(60)
    def test_serves_while_training_and_shuts_down_on_sigint(
        self, service: types.ModuleType, tmp_path: Path
    ) -> None:
        """The real server on loopback: /predict classifies, /health stays fast while training
        (p99 under 250 ms, which only a blocked loop breaks), the loss falls, and SIGINT ends
        training and the device threads and exits with code 0 within 5 s."""
        _, _, x_test, y_test = service.train_digits.load_data(0)
        log = tmp_path / "service.log"
        with serving(log) as (process, client):
            first = parse_metrics(client.get("/metrics").text)
            while first["aioreplica_steps_total"] == 0:  # the loss is NaN before a step
                first = parse_metrics(client.get("/metrics").text)
            health = client.get("/health").json()
            assert health["status"] == "ok"
            assert health["training"] is True

            latencies = []
            for _ in range(100):
                start = time.perf_counter()
                response = client.get("/health")
                latencies.append(time.perf_counter() - start)
                assert response.status_code == 200
            middle = parse_metrics(client.get("/metrics").text)
            assert middle["aioreplica_steps_total"] > first["aioreplica_steps_total"]
            assert p99(latencies) < 0.25, sorted(latencies)[-5:]

            rows = x_test[:50]
            answer = client.post("/predict", json={"inputs": rows.tolist()})
            assert answer.status_code == 200
            predictions = answer.json()["predictions"]
            assert len(predictions) == 50
            assert set(predictions) <= set(range(10))
            bad = client.post("/predict", json={"inputs": [[0.5] * 63]})
            assert bad.status_code == 400
            assert "has 63 values" in bad.json()["error"]

            # Ten epochs later the loss (a mean over the last epoch) is lower.
            last = middle
            target = first["aioreplica_steps_total"] + 10 * 22
            while last["aioreplica_steps_total"] < target:
                last = parse_metrics(client.get("/metrics").text)
            assert last["aioreplica_loss"] < first["aioreplica_loss"]
            assert last["aioreplica_strategy_merge_rounds_completed"] >= target
            later = client.post("/predict", json={"inputs": rows.tolist()}).json()
            accuracy = np.mean(np.array(later["predictions"]) == y_test[:50])
            assert accuracy >= 0.9

            process.send_signal(signal.SIGINT)
            code = process.wait(timeout=5)
        text = log.read_text()
        assert code == 0, text
        match = re.search(r"training stopped after (\d+) steps \(loss [\d.]+\); (\d+) device", text)
        assert match, text
        assert int(match.group(1)) >= target
        assert match.group(2) == "0"  # no device worker thread outlived the lifespan
        assert "Traceback" not in text

    @pytest.mark.timeout(60)
    def test_sigterm_is_a_clean_exit_like_ctrl_c(
        self, service: types.ModuleType, tmp_path: Path
    ) -> None:
        """SIGTERM (what process managers send) ends the lifespan, the training and the device
        threads and exits with code 0, as Ctrl-C does; uvicorn re-raises the signal it caught."""
        log = tmp_path / "service.log"
        with serving(log) as (process, _):
            process.send_signal(signal.SIGTERM)
            code = process.wait(timeout=5)
        text = log.read_text()
        assert code == 0, text
        assert re.search(r"training stopped after \d+ steps .*; 0 device threads left", text), text
        assert "Traceback" not in text


@contextlib.contextmanager
def serving(log: Path) -> Iterator[tuple[subprocess.Popen[bytes], httpx.Client]]:
    """The example service on a free loopback port, its output in ``log``, once it answers;
    with a client of it. Killed on the way out if it is still running."""
    import httpx

    port = free_port()
    with log.open("w") as output:
        process = subprocess.Popen(
            [sys.executable, str(EXAMPLES / "service.py"), "--port", str(port)],
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            wait_until_up(client, process, log)
            yield process, client
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def wait_until_up(client: httpx.Client, process: subprocess.Popen[bytes], log: Path) -> None:
    """Poll /health until the server answers (it imports, loads data, binds: a few seconds)."""
    import httpx

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the service exited with {process.returncode}:\n{log.read_text()}")
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)  # the server is starting: nothing to wait on but the port
    pytest.fail(f"the service did not answer within 30 s:\n{log.read_text()}")


async def run_app(service: types.ModuleType, settings: Any, requests: Any) -> tuple[Any, Any]:
    """Run the app's lifespan with ``settings``; call ``requests(client, trainer)`` inside."""
    import httpx

    app = service.create_app(settings)
    async with app.router.lifespan_context(app):
        trainer = app.state.trainer
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:
            result = await requests(client, trainer)
    return result, trainer


@pytest.mark.anyio
class TestInProcess:
    async def test_predictions_are_the_models_over_any_split(
        self, service: types.ModuleType
    ) -> None:
        """Rows split across 3 replicas (7 rows, and 1 row: empty replicas) come back in order,
        each the argmax of the trained weights' scores computed in one piece."""
        digits = service.train_digits
        _, _, x_test, _ = digits.load_data(0)

        async def requests(client: httpx.AsyncClient, trainer: Any) -> list[list[int]]:
            await trainer.stopped.wait()  # after 30 steps
            answers = []
            for rows in (x_test[:7], x_test[7:8]):
                response = await client.post("/predict", json={"inputs": rows.tolist()})
                assert response.status_code == 200
                answers.append(response.json()["predictions"])
            return answers

        settings = service.Settings(replicas=3, max_steps=30)
        answers, trainer = await run_app(service, settings, requests)
        assert trainer.steps == 30
        weights = {name: v.numpy() for name, v in trainer.params.items()}
        expected = np.argmax(digits.logits(np, weights, x_test[:8]), axis=1).tolist()
        assert answers == [expected[:7], expected[7:]]

    @pytest.mark.parametrize(
        ("body", "message"),
        [
            (b"{not json", "the body is not valid JSON"),
            (b"[1, 2]", 'the body must be a JSON object {"inputs"'),
            (b'{"rows": []}', 'the body must be a JSON object {"inputs"'),
            (b'{"inputs": "0.5"}', '"inputs" must be a list of rows, got a string'),
            (b'{"inputs": []}', '"inputs" is empty: send at least one row'),
            (b'{"inputs": [5]}', '"inputs"[0] must be a list of 64 numbers, got the number 5'),
            (b'{"inputs": [[1, 2]]}', '"inputs"[0] has 2 values; each row is an 8x8 image'),
            (
                json.dumps({"inputs": [[0.0] * 64, [0.0] * 63 + ["x"]]}).encode(),
                '"inputs"[1][63] must be a number, got a string',
            ),
            (
                json.dumps({"inputs": [[True] + [0.0] * 63]}).encode(),
                '"inputs"[0][0] must be a number, got a boolean',
            ),
            (
                json.dumps({"inputs": [[None] * 64]}).encode(),
                '"inputs"[0][0] must be a number, got null',
            ),
            (b'{"inputs": [[NaN' + b", 0" * 63 + b"]]}", "a value that is not finite"),
            (
                json.dumps({"inputs": [[0.0] * 64] * 1025}).encode(),
                '"inputs" has 1025 rows; send at most 1024',
            ),
        ],
    )
    async def test_bad_input_is_a_400_saying_what_is_wrong(
        self, service: types.ModuleType, body: bytes, message: str
    ) -> None:
        """A /predict body that is not {"inputs": [[64 numbers], ...]} gets 400 and a JSON
        error naming the part that is wrong."""

        async def requests(client: httpx.AsyncClient, trainer: Any) -> httpx.Response:
            return await client.post("/predict", content=body)

        response, _ = await run_app(service, service.Settings(max_steps=0), requests)
        assert response.status_code == 400
        assert response.headers["content-type"] == "application/json"
        assert message in response.json()["error"]

    @pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
    async def test_a_body_past_the_limit_is_a_413_and_is_not_parsed(
        self, service: types.ModuleType, monkeypatch: pytest.MonkeyPatch, declared: bool
    ) -> None:
        """A /predict body over MAX_BODY bytes (declared, or streamed without a length) is
        refused with 413 before it is parsed: parsing a huge body would stall the event loop
        that training and every other request share."""
        parsed: list[int] = []
        parse = service.parse_inputs

        def recording_parse(body: bytes) -> Any:
            parsed.append(len(body))
            return parse(body)

        monkeypatch.setattr(service, "parse_inputs", recording_parse)
        chunk = b" " * 65536
        chunks = service.MAX_BODY // len(chunk) + 2
        pulled: list[bool] = []
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:  # a body without a length, chunk by chunk
            pulled.append(True)
            return {"type": "http.request", "body": chunk, "more_body": len(pulled) < chunks}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        import httpx

        app = service.create_app(service.Settings(max_steps=0))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://s") as client:
                if declared:
                    big = await client.post("/predict", content=chunk * chunks)
                    status, body = big.status_code, big.content
                else:
                    scope = {
                        "type": "http",
                        "asgi": {"version": "3.0"},
                        "http_version": "1.1",
                        "method": "POST",
                        "scheme": "http",
                        "path": "/predict",
                        "raw_path": b"/predict",
                        "query_string": b"",
                        "headers": [(b"host", b"s"), (b"transfer-encoding", b"chunked")],
                        "server": ("s", 80),
                        "client": ("test", 1),
                    }
                    await app(scope, receive, send)
                    status = sent[0]["status"]
                    body = b"".join(m.get("body", b"") for m in sent[1:])
                fits = await client.post("/predict", json={"inputs": [[0.0] * 64]})
        assert status == 413
        assert json.loads(body) == {
            "error": f"the body is over {service.MAX_BODY} bytes; send at most 1024 rows of "
            "64 numbers per request"
        }
        assert fits.status_code == 200
        assert parsed == [len(fits.request.content)]
        if not declared:  # it stopped reading at the first chunk past the limit
            assert len(pulled) == service.MAX_BODY // len(chunk) + 1

    async def test_a_training_failure_is_reported_and_predictions_go_on(
        self, service: types.ModuleType, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A replica failing in a training step ends training, not the service: /health says
        so (503, the error and its replica), /predict answers with the last weights, and the
        lifespan still ends cleanly, closing the strategy."""
        step = service.train_digits.train_step
        calls: list[int] = []

        async def failing_step(*args: Any) -> Any:
            context = service.aioreplica.get_replica_context()
            calls.append(context.replica_id_in_sync_group)
            if len(calls) > 6 and context.replica_id_in_sync_group == 1:
                raise RuntimeError("the step broke")
            return await step(*args)

        monkeypatch.setattr(service.train_digits, "train_step", failing_step)

        async def requests(client: httpx.AsyncClient, trainer: Any) -> list[Any]:
            await trainer.stopped.wait()
            health = await client.get("/health")
            answer = await client.post("/predict", json={"inputs": [[0.5] * 64] * 3})
            return [health.status_code, health.json(), answer.status_code, answer.json()]

        settings = service.Settings(replicas=2)
        answers, trainer = await run_app(service, settings, requests)
        assert trainer.steps == 3
        assert answers[:2] == [
            503,
            {
                "status": "failed",
                "steps": 3,
                "training": False,
                "error": "RuntimeError: the step broke (raised in replica 1 of 2 (device cpu:1))",
            },
        ]
        assert answers[2] == 200
        assert len(answers[3]["predictions"]) == 3
        assert trainer.strategy.closed

    async def test_metrics_and_health(self, service: types.ModuleType) -> None:
        """/metrics is Prometheus text with the loss, the counters and the statistics; /health
        reports the steps; both after training stopped at max_steps."""

        async def requests(client: httpx.AsyncClient, trainer: Any) -> tuple[Any, Any]:
            await trainer.stopped.wait()
            metrics = await client.get("/metrics")
            health = await client.get("/health")
            return metrics, health

        settings = service.Settings(replicas=2, max_steps=25)
        (metrics, health), trainer = await run_app(service, settings, requests)
        assert metrics.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        samples = parse_metrics(metrics.text)
        assert samples["aioreplica_steps_total"] == 25
        assert samples["aioreplica_epochs_total"] == 1  # 22 steps an epoch
        assert samples["aioreplica_loss"] == pytest.approx(sum(trainer.recent_losses) / 22)
        assert 0.5 < samples["aioreplica_test_accuracy"] <= 1
        assert samples["aioreplica_strategy_runs_active"] == 0
        assert samples["aioreplica_strategy_merge_rounds_completed"] >= 25
        assert "# TYPE aioreplica_steps_total counter" in metrics.text
        assert "# TYPE aioreplica_loss gauge" in metrics.text
        assert health.json() == {"status": "ok", "steps": 25, "training": False}

    async def test_lifespan_end_cancels_training_and_closes_the_strategy(
        self, service: types.ModuleType
    ) -> None:
        """Ending the lifespan while training runs stops it and closes the strategy."""

        async def requests(client: httpx.AsyncClient, trainer: Any) -> int:
            while trainer.steps < 3:
                await anyio.lowlevel.checkpoint()  # training runs on this loop
            steps: int = trainer.steps
            return steps

        steps, trainer = await run_app(service, service.Settings(replicas=2), requests)
        assert steps >= 3
        assert trainer.training is False
        assert trainer.strategy.closed


class TestMetricsText:
    def test_statistics_fields_render_generically(self, service: types.ModuleType) -> None:
        """Every numeric field of the statistics object is a series: a tuple one per replica
        (labelled), ``None`` skipped, help text from its docstring's Attributes section."""

        @dataclasses.dataclass(frozen=True)
        class Statistics:
            """Test statistics.

            Attributes:
                steps: completed ``run()`` calls.
                wait_total: seconds waited,
                    per replica.
                slowest_replica: the id that arrived last most often.
            """

            steps: int
            wait_total: tuple[float, ...]
            slowest_replica: int | None
            label: str

        def trainer(slowest: int | None) -> Any:
            strategy = types.SimpleNamespace(
                statistics=lambda: Statistics(3, (0.5, 1.25), slowest, "x")
            )
            return types.SimpleNamespace(
                loss=math.nan, steps=3, epochs=0, test_accuracy=math.nan, strategy=strategy
            )

        text = service.render_metrics(trainer(None))
        samples = parse_metrics(text)
        assert {k: v for k, v in samples.items() if "strategy" in k} == {
            "aioreplica_strategy_steps": 3,
            'aioreplica_strategy_wait_total{replica="0"}': 0.5,
            'aioreplica_strategy_wait_total{replica="1"}': 1.25,
        }
        assert math.isnan(samples["aioreplica_loss"])
        assert "# HELP aioreplica_strategy_steps completed run() calls." in text
        assert "# HELP aioreplica_strategy_wait_total seconds waited, per replica." in text
        assert "# TYPE aioreplica_strategy_wait_total counter" in text
        with_slowest = parse_metrics(service.render_metrics(trainer(1)))
        assert with_slowest["aioreplica_strategy_slowest_replica"] == 1
        assert "# TYPE aioreplica_strategy_slowest_replica gauge" in service.render_metrics(
            trainer(1)
        )
