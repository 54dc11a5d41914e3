"""The documents' claims that tests/test_docs.py and tests/test_readme.py do not pin: the shell
commands (files, extras and flags they name), the multi-worker page's program run as it says
(two workers under mpiexec), and behavioural claims of docs/concepts.md, docs/migration.md and
docs/multi-worker.md, each checked as a user would try it."""

from __future__ import annotations

import contextvars
import copy
import pickle
import re
import sys
import textwrap
import tomllib
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from mpi_jobs import mpiexec, run_job

import aioreplica
from aioreplica import Mirrored, MirroredStrategy, PerReplica, Variable, get_replica_context
from aioreplica.testing import host_devices

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = {path.name: path.read_text() for path in (ROOT / "docs").glob("*.md")}
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def sh_blocks() -> list[tuple[str, str]]:
    """(document, command block) for every ```sh block of the README and docs/*.md."""
    found = [("README.md", block) for block in re.findall(r"```sh\n(.*?)```", README, re.S)]
    for name, text in sorted(DOCS.items()):
        found += [(name, block) for block in re.findall(r"```sh\n(.*?)```", text, re.S)]
    return found


# -- the shell commands ---------------------------------------------------------------------


class TestShellCommands:
    def test_there_are_shell_blocks(self) -> None:
        """The README and the docs show install, launch and development commands."""
        names = [name for name, _ in sh_blocks()]
        assert names.count("README.md") == 5
        assert {"gpu.md", "index.md", "multi-worker.md"} <= set(names)

    def test_every_extra_named_exists(self) -> None:
        """Each ``'.[a,b]'`` or ``'aioreplica[a]'`` of a command names extras of pyproject."""
        named = set()
        for _, block in sh_blocks():
            for group in re.findall(r"'(?:\.|aioreplica)\[([\w,]+)\]'", block):
                named.update(group.split(","))
        assert named == {"examples", "test", "mpi", "cuda"}
        assert named <= set(EXTRAS)

    def test_every_file_named_exists(self) -> None:
        """Each ``examples/...``, ``devices/...`` path a command runs is in the repository."""
        named = set()
        for _, block in sh_blocks():
            named.update(re.findall(r"\b((?:examples|devices)/[\w.]+)", block))
        assert named >= {
            "examples/train_digits.py",
            "examples/service.py",
            "devices/check_gpu.py",
            "devices/run.sh",
            "devices/bench_scheduler.py",
        }
        assert sorted(path for path in named if not (ROOT / path).is_file()) == []

    def test_every_venv_tool_named_exists(self) -> None:
        """``.venv/bin/X`` of a command is installed by the extras (mpiexec, mypy, ruff, ...)."""
        named = set()
        for _, block in sh_blocks():
            named.update(re.findall(r"\.venv/bin/([\w-]+)", block))
        bin_dir = Path(sys.executable).parent
        assert sorted(tool for tool in named if not (bin_dir / tool).exists()) == []

    def test_every_flag_of_the_examples_exists(self) -> None:
        """The flags the README and the docs give the example scripts are theirs."""
        sources = {
            "train_digits.py": (ROOT / "examples" / "train_digits.py").read_text(),
            "service.py": (ROOT / "examples" / "service.py").read_text(),
            "bench_scheduler.py": (ROOT / "devices" / "bench_scheduler.py").read_text()
            + (ROOT / "devices" / "_benchlib.py").read_text(),
        }
        missing = []
        texts = [README, *DOCS.values()]
        for text in texts:
            for script, flag in re.findall(
                r"(train_digits\.py|service\.py|bench_scheduler\.py)"
                r"((?: --[\w-]+(?: [\w.]+)?)+)",
                text,
            ):
                missing += [
                    (script, name)
                    for name in re.findall(r"--[\w-]+", flag)
                    if f'"{name}"' not in sources[script]
                ]
        # The flags the README's prose names for train_digits.py.
        for name in re.findall(r"`(--[\w-]+)", README):
            if name in ("--json", "--aioreplica-replicas", "--quick"):
                continue
            if not any(f'"{name}"' in source for source in sources.values()):
                missing.append(("README", name))
        assert missing == []

    def test_mkdocs_site_dir_is_the_one_the_readme_names(self) -> None:
        """The README's development block says the site goes into build/site."""
        assert "build/site" in README
        assert re.search(r"^site_dir: build/site$", (ROOT / "mkdocs.yml").read_text(), re.M)


# -- the multi-worker page, run as it says --------------------------------------------------


def multi_worker_program() -> str:
    code: str = re.findall(r"```python\n(.*?)```", DOCS["multi-worker.md"], re.S)[0]
    return code


class TestMultiWorkerPage:
    @pytest.mark.timeout(150)
    def test_the_first_program_prints_once_on_two_workers(self, tmp_path: Path) -> None:
        """Saved as fit.py and started on 2 workers, "it prints the same line once"."""
        (tmp_path / "fit.py").write_text(multi_worker_program())
        job = run_job(
            [*mpiexec(2), sys.executable, "-m", "mpi4py", "fit.py"], timeout=120, cwd=tmp_path
        )
        assert job.returncode == 0, job.log
        assert job.stdout == "[ 1.  -2.   0.5]\n", job.log

    @pytest.mark.timeout(90)
    def test_the_launch_check_of_the_page(self, tmp_path: Path) -> None:
        """``mpiexec -n 2 python -m mpi4py.bench helloworld`` shows 2 processes of one job."""
        job = run_job(
            [*mpiexec(2), sys.executable, "-m", "mpi4py.bench", "helloworld"],
            timeout=60,
            cwd=tmp_path,
        )
        assert job.returncode == 0, job.log
        assert sorted(re.findall(r"I am process (\d) of (\d)", job.stdout)) == [
            ("0", "2"),
            ("1", "2"),
        ]

    @pytest.mark.timeout(150)
    def test_the_tables_claims_on_two_workers(self, tmp_path: Path) -> None:
        """The page's "What is global, what is local" table and collectives paragraph, on 2
        workers of 2 replicas: TF's resolver names, the ClusterSpec equal to its dict, the
        chief-only flags, the chief's initial value, global worker-major replica ids,
        reduce_scatter's array_split chunks, all_gather in global order with uneven rows, bool
        MAX/MIN as any/all, a global source_replica, MEAN along an axis weighted by rows, a
        plain value counted per replica, dtype object refused with TypeError, the InputContext
        of distribute_datasets_from_function, and a ValueError for workers of other L."""
        script = textwrap.dedent(
            """\
            import anyio, numpy as np
            import aioreplica as ar

            async def main():
                out = []
                s = ar.MultiWorkerMirroredStrategy(["cpu:0", "cpu:1"])
                w = s.cluster.worker_index
                r = s.cluster_resolver
                out.append(("resolver", r.task_type, r.task_id, r.master(), r.rpc_layer,
                            r.environment))
                spec = r.cluster_spec()
                out.append(("spec", spec.jobs, spec.num_tasks("worker"),
                            spec.task_indices("worker"), spec == spec.as_dict()))
                e = s.extended
                out.append(("ext", e.should_checkpoint, e.should_save_summary,
                            e.experimental_between_graph, e.experimental_should_init,
                            e.worker_devices, s.num_replicas_in_sync))
                with s.scope():
                    v = ar.Variable(np.full(2, float(w + 10)), name="v")
                out.append(("chief value", [x.tolist() for x in v.values]))

                async def step():
                    ctx = ar.get_replica_context()
                    g = ctx.replica_id_in_sync_group
                    rs = await ctx.reduce_scatter("sum", np.zeros(10) + g + 1)
                    ag = await ctx.all_gather(np.full(g + 1, float(g)))
                    bmax = await ctx.all_reduce("max", np.array(g == 3))
                    bmin = await ctx.all_reduce("min", np.array(g == 3))
                    bc = await ctx.broadcast(np.full(2, float(g)), source_replica=2)
                    return g, rs.tolist(), ag.tolist(), bool(bmax), bool(bmin), bc.tolist()

                out.append(("step", s.experimental_local_results(await s.run(step))))
                pr = ar.PerReplica([np.ones(3) * (2 * w), np.ones(1) * (2 * w + 1)])
                out.append(("mean axis", float(await s.reduce("mean", pr, axis=0))))
                out.append(("gather", (await s.gather(pr)).tolist()))
                out.append(("plain", float(await s.reduce("sum", 2.0))))
                try:
                    await s.gather(ar.PerReplica([np.array([object()])] * 2))
                except Exception as exc:
                    out.append(("object", type(exc).__name__))
                seen = []

                def dataset_fn(ic):
                    seen.append((ic.num_input_pipelines, ic.input_pipeline_id,
                                 ic.num_replicas_in_sync))
                    return ar.batched(np.arange(8.0), 4)

                async for _ in s.distribute_datasets_from_function(dataset_fn):
                    pass
                out.append(("input", seen))
                try:
                    ar.MultiWorkerMirroredStrategy(["cpu:0"] if w == 0 else ["cpu:0", "cpu:1"])
                except ValueError as exc:
                    out.append(("L", "worker 0 has 1, worker 1 has 2" in str(exc)))
                with open(f"result-{w}.txt", "w") as f:  # a file each: no mixed lines
                    f.write(repr(out))

            anyio.run(main)
            """
        )
        (tmp_path / "claims.py").write_text(script)
        job = run_job(
            [*mpiexec(2), sys.executable, "-m", "mpi4py", "claims.py"], timeout=120, cwd=tmp_path
        )
        assert job.returncode == 0, job.log
        results = {w: eval((tmp_path / f"result-{w}.txt").read_text()) for w in (0, 1)}
        gathered = [0.0, 1.0, 1.0, 2.0, 2.0, 2.0, 3.0, 3.0, 3.0, 3.0]
        for w in (0, 1):
            chief = w == 0
            assert results[w] == [
                ("resolver", "worker", w, "", None, ""),
                ("spec", ["worker"], 2, [0, 1], True),
                ("ext", chief, chief, True, True, ("cpu:0", "cpu:1"), 4),
                ("chief value", [[10.0, 10.0], [10.0, 10.0]]),
                (
                    "step",
                    tuple(
                        (
                            g,
                            [10.0] * len(np.array_split(np.zeros(10), 4)[g]),
                            gathered,
                            True,
                            False,
                            [2.0, 2.0],
                        )
                        for g in (2 * w, 2 * w + 1)
                    ),
                ),
                ("mean axis", 1.25),
                ("gather", [0.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 3.0]),
                ("plain", 8.0),
                ("object", "TypeError"),
                ("input", [(2, w, 4)]),
                ("L", True),
            ], job.log


# -- concepts.md and migration.md, in one process -------------------------------------------


@pytest.mark.anyio
class TestMigrationClaims:
    async def test_a_plain_value_counts_once_per_replica(self) -> None:
        """ "``await strategy.reduce("sum", 2.0)`` on 4 replicas is ``8.0``"."""
        strategy = MirroredStrategy(host_devices(4))
        assert await strategy.reduce("sum", 2.0) == 8.0

    async def test_op_names_in_any_case(self) -> None:
        """Ops are accepted as names "in any case"; ``ReduceOp("SUM")`` is ``ReduceOp.SUM``."""
        strategy = MirroredStrategy(host_devices(2))
        assert aioreplica.ReduceOp("SUM") is aioreplica.ReduceOp.SUM
        assert [await strategy.reduce(op, 3.0) for op in ("Sum", "MEAN", "max")] == [6.0, 3.0, 3.0]

    def test_mirrored_computes_as_its_value_but_forwards_no_attribute(self) -> None:
        """``m + 1``, ``pow(m, 3, 10)``, ``m[1]``, ``float(m)``, ``f"{m:.3f}"``, ``np.mean(m)``
        work; ``==`` is identity; ``m.shape`` is an ``AttributeError``; NumPy refuses a
        PerReplica and a write into a Mirrored with ``TypeError``."""
        m = Mirrored([np.float64(2.5)] * 2)
        assert [m + 1, float(m), f"{m:.3f}", float(np.mean(m))] == [3.5, 2.5, "2.500", 2.5]
        assert pow(Mirrored([7, 7]), 3, 10) == 3
        assert Mirrored([np.arange(3)] * 2)[1] == 1
        assert (m == m, m == Mirrored([np.float64(2.5)] * 2)) == (True, False)
        with pytest.raises(AttributeError):
            _ = m.shape  # type: ignore[attr-defined]
        with pytest.raises(TypeError):
            np.asarray(PerReplica([1.0, 2.0]))
        with pytest.raises(TypeError):
            np.copyto(m, 1.0)  # type: ignore[arg-type]
        assert PerReplica[float]([1.0, 2.0]).values == (1.0, 2.0)

    def test_variables_are_not_distributed_values(self) -> None:
        """``isinstance(v, aioreplica.DistributedValues)`` (or ``Mirrored``) is false for a
        distributed variable; ``isinstance(v, aioreplica.Variable)`` is true."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            v = Variable(0.0)
            s = Variable(0.0, synchronization="on_read", aggregation="sum")
        for variable in (v, s):
            assert not isinstance(variable, aioreplica.DistributedValues)
            assert not isinstance(variable, Mirrored)
            assert isinstance(variable, Variable)

    def test_copy_and_pickle(self) -> None:
        """``copy.copy(v)`` is ``v``; pickling a variable, and copying or pickling a strategy,
        its ``extended``, are ``TypeError``."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            v = Variable(np.zeros(2), name="v")
        assert copy.copy(v) is v
        for action in (
            lambda: pickle.dumps(v),
            lambda: copy.copy(strategy),
            lambda: copy.deepcopy(strategy),
            lambda: pickle.dumps(strategy.extended),
        ):
            with pytest.raises(TypeError):
                action()

    async def test_writes_broadcast_and_read_value_false(self) -> None:
        """``await v.assign(0.0)`` zeroes a vector; with ``read_value=False`` a write returns
        ``None``; a bool variable has no ``assign_add`` (``TypeError``)."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            v = Variable(np.arange(3.0))
            b = Variable(True)
        await v.assign(0.0)
        assert v.numpy().tolist() == [0.0, 0.0, 0.0]
        assert await v.assign_add(np.ones(3), read_value=False) is None
        with pytest.raises(TypeError, match="bool"):
            await b.assign_add(True)

    @pytest.mark.parametrize(
        ("value", "dtype"),
        [(2**63, None), (2**64, None), (-(2**63) - 1, None), (2**64, "uint64"), (300, "uint8")],
    )
    def test_an_integer_the_dtype_cannot_hold_is_a_value_error(
        self, value: int, dtype: str | None
    ) -> None:
        """migration.md: "A Python int beyond int64 with no ``dtype`` is a ``ValueError``, as
        TF's "out-of-range integer"" and "``dtype=`` casts the initial value ...; an integer
        the dtype cannot hold a ``ValueError``"."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope(), pytest.raises(ValueError, match=r"hold|fit"):
            Variable(value, dtype=dtype)

    @pytest.mark.parametrize(
        ("value", "dtype"), [(2**63, "int64"), (2**64, "uint64"), (-1, "uint8")]
    )
    async def test_a_written_int_the_variable_cannot_hold_is_a_value_error(
        self, value: int, dtype: str
    ) -> None:
        """migration.md: "A Python int written to an unsigned or bool variable takes its dtype,
        as TF converts a Python number (one it cannot hold is a ``ValueError``...)"; the
        variable keeps its value."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            v = Variable(np.zeros((), dtype=dtype))
        with pytest.raises(ValueError, match=r"hold|fit"):
            await v.assign(value)
        assert int(v.numpy()) == 0

    def test_integer_sync_on_read_mean_is_refused_at_creation(self) -> None:
        """An integer sync-on-read variable with aggregation MEAN is a ``TypeError``."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope(), pytest.raises(TypeError, match="MEAN"):
            Variable(1, synchronization="on_read", aggregation="mean")

    def test_variable_dtype_casts(self) -> None:
        """``Variable(1, dtype="float32")`` works; ``[1.5, 2**63]`` is float64; a float for
        an integer dtype is a ``TypeError``; ``shape=`` other than the value's a ``ValueError``."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            assert Variable(1, dtype="float32").dtype == np.float32
            assert Variable([1.5, 2**63]).dtype == np.float64
            with pytest.raises(TypeError):
                Variable(1.5, dtype="int32")
            with pytest.raises(ValueError, match="shape"):
                Variable(np.zeros(3), shape=(4,))

    def test_device_spellings(self) -> None:
        """TF's ``"/device:CPU:1"`` spellings are accepted, ``"/cpu"`` is device 0, and the
        ``"*"`` index is refused."""
        assert MirroredStrategy(["/device:CPU:0", "/device:CPU:1"]).extended.worker_devices == (
            "cpu:0",
            "cpu:1",
        )
        assert MirroredStrategy(["/cpu"]).extended.worker_devices == ("cpu:0",)
        with pytest.raises(ValueError, match=r"\*"):
            MirroredStrategy(["/device:CPU:*"])

    def test_plain_value_local_results_and_no_resolver(self) -> None:
        """A plain value's local results come once per replica; a one-process strategy's
        ``cluster_resolver`` is ``None``, as in TF."""
        strategy = MirroredStrategy(host_devices(2))
        assert strategy.experimental_local_results(5) == (5, 5)
        assert strategy.cluster_resolver is None

    def test_infinite_timeouts_are_refused(self) -> None:
        """ "An infinite timeout, or an int too large for a float, is a ``ValueError``"."""
        with pytest.raises(ValueError, match="infinite or too large"):
            MirroredStrategy(host_devices(1), sync_timeout=float("inf"))
        with pytest.raises(ValueError, match="infinite or too large"):
            aioreplica.CommunicationOptions(timeout_seconds=float("inf"))
        with pytest.raises(ValueError, match="infinite or too large"):
            aioreplica.CommunicationOptions(timeout_seconds=10**400)

    def test_communication_options_override_and_nccl(self) -> None:
        """``options.merge`` is also named ``override``; ``implementation="nccl"`` is taken."""
        merged = aioreplica.CommunicationOptions().override(
            aioreplica.CommunicationOptions(bytes_per_pack=8)
        )
        assert merged.bytes_per_pack == 8
        options = aioreplica.CommunicationOptions(implementation="nccl")
        assert options.implementation is aioreplica.CommunicationImplementation.NCCL

    async def test_integer_means(self) -> None:
        """Cross-replica ``MEAN`` of integers is a float64 mean; ``MAX`` along an axis every
        replica's batch is empty along is a ``ValueError``; ``MEAN`` along an axis counts
        rows; a gather takes uneven lengths."""
        strategy = MirroredStrategy(host_devices(2))
        mean = await strategy.reduce("mean", PerReplica([np.int64(1), np.int64(2)]))
        assert np.asarray(mean).dtype == np.float64
        assert float(mean) == 1.5
        with pytest.raises(ValueError, match="empty"):
            await strategy.reduce("max", PerReplica([np.zeros((0, 2))] * 2), axis=0)
        short = PerReplica([np.array([1.0, 2.0, 3.0]), np.array([6.0])])
        assert await strategy.reduce("mean", short, axis=0) == 3.0
        assert (await strategy.gather(short)).tolist() == [1.0, 2.0, 3.0, 6.0]

    async def test_integer_mean_in_a_replica_is_a_type_error(self) -> None:
        """In replica context ``MEAN`` of integers is a ``TypeError`` saying to cast first."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> None:
            await get_replica_context().all_reduce("mean", np.int64(1))  # type: ignore[union-attr]

        with pytest.raises(TypeError, match="cast"):
            await strategy.run(step)

    async def test_the_same_object_to_a_sum_variable(self) -> None:
        """The same object from every replica to a ``SUM`` variable is refused with
        ``ValueError``; values made in each replica as new objects are summed, even equal."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope():
            v = Variable(0.0, aggregation="sum")

        async def same() -> None:
            await v.assign_add(1.0)

        async def new() -> None:
            await v.assign_add(np.float64(1.0) + 0)

        with pytest.raises(ValueError, match="same object"):
            await strategy.run(same)
        assert float(v.numpy()) == 0.0
        await strategy.run(new)
        assert float(v.numpy()) == 2.0

    def test_scale_regularization_loss_in_cross_replica_context(self) -> None:
        """Refused in a strategy's cross-replica context, as in TF."""
        strategy = MirroredStrategy(host_devices(2))
        with strategy.scope(), pytest.raises(RuntimeError):
            aioreplica.scale_regularization_loss(1.0)

    def test_compute_average_loss_of_an_empty_global_batch(self) -> None:
        """0 for a global batch size of 0."""
        assert aioreplica.compute_average_loss(np.ones(0), global_batch_size=0) == 0.0

    def test_batched_batches_are_read_only(self) -> None:
        """``x /= 2`` on a batch raises NumPy's ``ValueError: output array is read-only``."""
        batch = next(iter(aioreplica.batched(np.arange(8.0), 4)))
        with pytest.raises(ValueError, match="output array is read-only"):
            batch /= 2

    async def test_an_unawaited_collective_is_a_runtime_error(self) -> None:
        """A replica that ends with a collective it never awaited makes ``run()`` raise a
        ``RuntimeError`` naming the call."""
        strategy = MirroredStrategy(host_devices(2))

        async def step() -> None:
            get_replica_context().all_reduce("sum", 1.0)  # type: ignore[union-attr]

        with pytest.raises(RuntimeError, match=r"never awaited"):
            await strategy.run(step)

    def test_leaving_a_scope_out_of_order_keeps_the_open_ones(self) -> None:
        """migration.md, ``strategy.scope()``: scopes may be left out of order; a scope entered
        after the one left, still open, keeps its strategy current until it is left itself.
        Here: the default strategy's scope, then another strategy's (allowed inside it), and
        the default one left first."""
        strategy = MirroredStrategy(host_devices(2))
        outer = aioreplica.get_strategy().scope()
        inner = strategy.scope()
        outer.__enter__()
        inner.__enter__()
        outer.__exit__(None, None, None)
        assert aioreplica.get_strategy() is strategy
        inner.__exit__(None, None, None)
        assert not aioreplica.has_strategy()
        with pytest.raises(RuntimeError, match="holds no entry of it"):
            outer.__exit__(None, None, None)  # left once already


@pytest.mark.anyio
class TestConceptsClaims:
    async def test_merge_fn_context(self) -> None:
        """``merge_fn`` runs with ``get_replica_context()`` returning ``None``, in the task of
        the replica that completed the round (the last to arrive): a ``ContextVar.set()`` in
        it is seen by that replica alone, and never by the caller of ``run()``."""
        strategy = MirroredStrategy(host_devices(2))
        var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")
        events: list[Any] = []

        def merge_fn(_: Any) -> None:
            events.append(("merge", get_replica_context()))
            var.set("set in merge_fn")

        async def step() -> None:
            ctx = get_replica_context()
            assert ctx is not None
            events.append(("arrives", ctx.replica_id_in_sync_group))
            await ctx.merge_call(merge_fn)
            events.append((ctx.replica_id_in_sync_group, var.get()))

        await strategy.run(step)
        # On trio the replicas start in an order trio chooses: the last to arrive is the one.
        first, last = events[0][1], events[1][1]
        assert events == [
            ("arrives", first),
            ("arrives", last),
            ("merge", None),
            (last, "set in merge_fn"),
            (first, "unset"),
        ]
        assert var.get() == "unset"

    async def test_collectives_from_a_child_task_raise(self) -> None:
        """``merge_call`` and the collectives must be awaited by the replica's own coroutine:
        from a child task they raise ``RuntimeError``."""
        strategy = MirroredStrategy(host_devices(2))
        caught: list[str] = []

        async def step() -> None:
            ctx = get_replica_context()
            assert ctx is not None

            async def child() -> None:
                try:
                    await ctx.all_reduce("sum", 1.0)
                except RuntimeError as exc:
                    caught.append(type(exc).__name__)

            async with anyio.create_task_group() as tg:
                tg.start_soon(child)

        await strategy.run(step)
        assert caught == ["RuntimeError", "RuntimeError"]

    async def test_default_replica_context_outside_any_strategy(self) -> None:
        """Outside any strategy, ``get_replica_context()`` is a default single-replica one."""
        ctx = get_replica_context()
        assert ctx is not None
        assert (ctx.num_replicas_in_sync, ctx.replica_id_in_sync_group) == (1, 0)
