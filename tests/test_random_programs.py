"""Randomized differential tests: random step programs against a sequential NumPy model.

A program is a list of operations that every replica makes in the same order, with
replica-dependent values: ``merge_call`` (a merge function recording its arguments, returning a
per-replica or a single value), the collectives (``all_reduce`` over nested structures of
small and large leaves of several dtypes, ``all_gather`` with uneven rows, ``broadcast`` from a
random source, ``reduce_scatter``, ``barrier``), writes of mirrored and sync-on-read variables,
checkpoints and replica-dependent CPU work between them. The expected results come from a plain
sequential NumPy model; the program runs on 1 to 5 host replicas, ordered and random
interleaving, asyncio, uvloop and trio, over several ``run()`` calls, and concurrently from
several tasks. Faults (an exception in a replica or a merge function, the caller's cancellation,
a replica stalled past ``sync_timeout``) are injected at a random operation; the variables must
then be all-or-nothing: each equal to the model's state before or after each write.

Values are small integers in every dtype, so sums, products, maxima and minima are exact in any
order: those compare bit for bit. ``MEAN`` divides an exact sum by the replica count; the
library may multiply by ``1/n`` instead, one rounding apart, so it compares to 4 ulp.

Every failure message prints the seed and the program: ``_case(seed)`` rebuilds it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

from aioreplica import (
    MirroredStrategy,
    PerReplica,
    ReplicaSyncError,
    Variable,
)
from aioreplica.testing import host_devices, replica_context, replica_id

if TYPE_CHECKING:
    from collections.abc import Awaitable

pytestmark = pytest.mark.anyio

DTYPES = ["float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8"]
FLOATS = ["float64", "float32", "float16"]
OPS = ["sum", "mean", "max", "min", "prod"]
KINDS = [
    "merge_pr",
    "merge_one",
    "all_reduce",
    "all_gather",
    "broadcast",
    "reduce_scatter",
    "barrier",
    "mirrored",
    "on_read",
    "sleep",
    "checkpoint",
    "cpu",
]
#: The operations that are one merge round.
ROUNDS = {
    "merge_pr",
    "merge_one",
    "all_reduce",
    "all_gather",
    "broadcast",
    "reduce_scatter",
    "barrier",
    "mirrored",
}


# -- programs ----------------------------------------------------------------------------------


@dataclass
class Op:
    kind: str
    k: int
    params: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        shown = ", ".join(f"{key}={value!r}" for key, value in self.params.items())
        return f"{self.k}:{self.kind}({shown})"


@dataclass
class Program:
    seed: int
    ops: list[Op]
    mirrored: list[tuple[str, str, tuple[int, ...]]]  # (aggregation, dtype, shape)
    on_read: list[tuple[str, str, tuple[int, ...]]]

    def __repr__(self) -> str:
        return (
            f"Program(seed={self.seed}, mirrored={self.mirrored}, on_read={self.on_read},\n  "
            + "\n  ".join(map(repr, self.ops))
            + ")"
        )


def make_program(seed: int, length: int = 10) -> Program:
    rng = random.Random(seed)
    mirrored = [
        (
            rng.choice(["sum", "mean", "only_first_replica"]),
            rng.choice(["float64", "float32", "int64", "int32"]),
            rng.choice([(), (3,), (2, 2)]),
        )
        for _ in range(2)
    ]
    mirrored = [(agg, "float64" if agg == "mean" else dt, sh) for agg, dt, sh in mirrored]
    on_read = [(rng.choice(["sum", "mean"]), "float64", rng.choice([(), (4,)])) for _ in range(2)]
    ops = []
    for k in range(length):
        kind = rng.choice(KINDS)
        params: dict[str, Any] = {}
        if kind == "all_reduce":
            op = rng.choice(OPS)
            choices = FLOATS if op == "mean" else DTYPES
            leaves = {
                "s": (rng.choice(choices), ()),
                "v": (rng.choice(choices), (rng.randint(1, 5),)),
                "l": [(rng.choice(choices), (2, 3))],
            }
            if rng.random() < 0.2:  # a large leaf, reduced on its own
                leaves["big"] = (rng.choice(choices), (rng.choice([40_000, 300_000]),))
            params = {"op": op, "leaves": leaves}
        elif kind == "all_gather":
            params = {"dtype": rng.choice(DTYPES), "cols": rng.randint(1, 3)}
        elif kind == "broadcast":
            params = {"dtype": rng.choice(DTYPES), "source": rng.randrange(5)}
        elif kind == "reduce_scatter":
            params = {
                "op": rng.choice(["sum", "max", "min"]),
                "dtype": rng.choice(DTYPES),
                "rows": rng.randint(1, 9),
            }
        elif kind in ("mirrored", "on_read"):
            params = {"var": rng.randrange(2), "write": rng.choice(["assign", "assign_add"])}
        elif kind == "cpu":
            params = {"size": rng.randint(1, 50)}
        ops.append(Op(kind, k, params))
    return Program(seed, ops, mirrored, on_read)


def value(
    seed: int, k: int, i: int, r: int, dtype: str, shape: tuple[int, ...], lo: int = -3, hi: int = 4
) -> np.ndarray:
    """Replica ``i``'s value at op ``k`` of run ``r``: small integers, exact in any order."""
    rng = np.random.default_rng([seed, k, i, r])
    return rng.integers(lo, hi, size=shape).astype(dtype)


# -- the sequential model ----------------------------------------------------------------------


def reduce_model(op: str, arrays: list[np.ndarray]) -> np.ndarray:
    stack = np.stack(arrays)
    dtype = arrays[0].dtype
    out: np.ndarray
    if op == "sum":
        out = np.sum(stack, axis=0).astype(dtype)
    elif op == "mean":
        out = (np.sum(stack.astype(np.float64), axis=0) / len(arrays)).astype(dtype)
    elif op == "max":
        out = np.max(stack, axis=0)
    elif op == "min":
        out = np.min(stack, axis=0)
    else:
        out = np.prod(stack, axis=0).astype(dtype)
    return out


def leaf_values(seed: int, op: Op, i: int, r: int) -> dict[str, Any]:
    leaves = op.params["leaves"]
    lo, hi = (1, 3) if op.params["op"] == "prod" else (-3, 4)
    out: dict[str, Any] = {}
    for j, (name, spec) in enumerate(leaves.items()):
        if name == "l":
            dt, sh = spec[0]
            out[name] = [value(seed, op.k * 10 + j, i, r, dt, sh, lo, hi)]
        else:
            dt, sh = spec
            out[name] = value(seed, op.k * 10 + j, i, r, dt, sh, lo, hi)
    return out


def merge_arg(seed: int, op: Op, i: int, r: int) -> int:
    return seed % 97 + 1000 * r + 10 * op.k + i


def cpu_work(size: int, i: int, r: int) -> int:
    return int(np.arange(size * (i + 1) + r, dtype=np.int64).sum())


class Model:
    """The program run one operation at a time, every replica in order."""

    def __init__(self, program: Program, n: int) -> None:
        self.p = program
        self.n = n
        self.mirrored = [np.zeros(sh, dt) for _, dt, sh in program.mirrored]
        self.on_read = [[np.zeros(sh, dt) for _ in range(n)] for _, dt, sh in program.on_read]
        self.merge_log: list[Any] = []
        self.rounds = 0

    def run(self, r: int, stop: int | None = None) -> list[list[Any]]:
        """Run ``r``: each replica's list of results (ops before ``stop`` only)."""
        seed, n = self.p.seed, self.n
        results: list[list[Any]] = [[] for _ in range(n)]
        for op in self.p.ops[:stop]:
            kind, p = op.kind, op.params
            if kind in ROUNDS:
                self.rounds += 1
            if kind in ("merge_pr", "merge_one"):
                args = [merge_arg(seed, op, i, r) for i in range(n)]
                self.merge_log.append((op.k, args if n > 1 else args[0]))
                for i in range(n):
                    results[i].append(sum(args) * 2 + i if kind == "merge_pr" else sum(args))
            elif kind == "all_reduce":
                per = [leaf_values(seed, op, i, r) for i in range(n)]
                out = {
                    name: [reduce_model(p["op"], [x[name][0] for x in per])]
                    if name == "l"
                    else reduce_model(p["op"], [x[name] for x in per])
                    for name in per[0]
                }
                for i in range(n):
                    results[i].append(out)
            elif kind == "all_gather":
                parts = [
                    value(seed, op.k, i, r, p["dtype"], ((i + op.k + r) % 3, p["cols"]))
                    for i in range(n)
                ]
                for i in range(n):
                    results[i].append(np.concatenate(parts))
            elif kind == "broadcast":
                src = p["source"] % n
                for i in range(n):
                    results[i].append(value(seed, op.k, src, r, p["dtype"], (3,)))
            elif kind == "reduce_scatter":
                arrays = [value(seed, op.k, i, r, p["dtype"], (p["rows"], 2)) for i in range(n)]
                chunks = np.array_split(reduce_model(p["op"], arrays), n)
                for i in range(n):
                    results[i].append(chunks[i])
            elif kind == "barrier":
                for i in range(n):
                    results[i].append(None)
            elif kind == "mirrored":
                v = p["var"]
                agg, dt, sh = self.p.mirrored[v]
                vals = [value(seed, op.k, i, r, dt, sh) for i in range(n)]
                if agg == "sum":
                    new = np.sum(np.stack(vals), axis=0).astype(dt)
                elif agg == "mean":
                    new = (np.sum(np.stack(vals), axis=0) / n).astype(dt)
                else:
                    new = vals[0]
                if p["write"] == "assign":
                    self.mirrored[v] = new
                else:
                    self.mirrored[v] = (self.mirrored[v] + new).astype(dt)
                for i in range(n):
                    results[i].append(self.mirrored[v])
            elif kind == "on_read":
                v = p["var"]
                _, dt, sh = self.p.on_read[v]
                for i in range(n):
                    new = value(seed, op.k, i, r, dt, sh)
                    if p["write"] == "assign":
                        self.on_read[v][i] = new
                    else:
                        self.on_read[v][i] = self.on_read[v][i] + new
                    results[i].append(self.on_read[v][i])
            elif kind == "cpu":
                for i in range(n):
                    results[i].append(cpu_work(p["size"], i, r))
            else:
                for i in range(n):
                    results[i].append(None)
        return results


# -- running a program -------------------------------------------------------------------------


class Real:
    """The program's variables, and its step, on a strategy."""

    def __init__(self, program: Program, strategy: MirroredStrategy) -> None:
        self.p = program
        self.strategy = strategy
        self.merge_log: list[Any] = []
        with strategy.scope():
            self.mirrored = [
                Variable(np.zeros(sh, dt), aggregation=agg) for agg, dt, sh in program.mirrored
            ]
            self.on_read = [
                Variable(np.zeros(sh, dt), synchronization="on_read", aggregation=agg)
                for agg, dt, sh in program.on_read
            ]
        self.merge_fns = {op.k: self._merge_fn(op) for op in program.ops}

    def _merge_fn(self, op: Op) -> Any:
        log = self.merge_log

        def merge_fn(strategy: MirroredStrategy, arg: Any) -> Any:
            if isinstance(arg, PerReplica):
                values = [int(x) for x in arg.values]
                log.append((op.k, values))
            else:
                values = [int(arg)]
                log.append((op.k, int(arg)))
            if isinstance(arg, PerReplica) and len(values) != strategy.num_replicas_in_sync:
                raise AssertionError("wrong replica count")
            total = (
                sum(values)
                if isinstance(arg, PerReplica)
                else values[0] * strategy.num_replicas_in_sync
            )
            if op.kind == "merge_pr":
                return PerReplica([total * 2 + i for i in range(strategy.num_replicas_in_sync)])
            return total

        if op.k % 2:  # an async merge function, awaited by the scheduler, with a checkpoint

            async def async_merge_fn(strategy: MirroredStrategy, arg: Any) -> Any:
                await anyio.lowlevel.checkpoint()
                return merge_fn(strategy, arg)

            return async_merge_fn
        return merge_fn

    def step(self, r: int, hooks: dict[int, Any] | None = None) -> Any:
        seed = self.p.seed

        async def step() -> list[Any]:
            ctx = replica_context()
            i = ctx.replica_id_in_sync_group
            n = ctx.num_replicas_in_sync
            out: list[Any] = []
            for op in self.p.ops:
                if hooks and op.k in hooks:
                    await hooks[op.k](i)
                kind, p = op.kind, op.params
                if kind in ("merge_pr", "merge_one"):
                    out.append(
                        await ctx.merge_call(
                            self.merge_fns[op.k], args=(merge_arg(seed, op, i, r),)
                        )
                    )
                elif kind == "all_reduce":
                    out.append(await ctx.all_reduce(p["op"], leaf_values(seed, op, i, r)))
                elif kind == "all_gather":
                    rows = (i + op.k + r) % 3
                    out.append(
                        await ctx.all_gather(value(seed, op.k, i, r, p["dtype"], (rows, p["cols"])))
                    )
                elif kind == "broadcast":
                    mine = value(seed, op.k, i, r, p["dtype"], (3,))
                    out.append(await ctx.broadcast(mine, source_replica=p["source"] % n))
                elif kind == "reduce_scatter":
                    mine = value(seed, op.k, i, r, p["dtype"], (p["rows"], 2))
                    out.append(await ctx.reduce_scatter(p["op"], mine))
                elif kind == "barrier":
                    # barrier() is typed to return None: await it as an object, so that the
                    # result (checked to be None against the model) is still recorded
                    barrier: Awaitable[object] = ctx.barrier()
                    out.append(await barrier)
                elif kind == "mirrored":
                    var = self.mirrored[p["var"]]
                    _, dt, sh = self.p.mirrored[p["var"]]
                    await getattr(var, p["write"])(value(seed, op.k, i, r, dt, sh))
                    out.append(np.array(var.value()))
                elif kind == "on_read":
                    var = self.on_read[p["var"]]
                    _, dt, sh = self.p.on_read[p["var"]]
                    await getattr(var, p["write"])(value(seed, op.k, i, r, dt, sh))
                    out.append(np.array(var.value()))
                elif kind == "sleep":
                    # the "sleep" op is user code yielding with anyio.sleep(0), kept apart
                    # from the "checkpoint" op below
                    await anyio.sleep(0)  # noqa: ASYNC115
                    out.append(None)
                elif kind == "checkpoint":
                    await anyio.lowlevel.checkpoint()
                    out.append(None)
                else:
                    for _ in range(i % 3):
                        await anyio.lowlevel.checkpoint()
                    out.append(cpu_work(p["size"], i, r))
            return out

        return step


def same(got: Any, want: Any, where: str, mean: bool = False) -> None:
    if want is None:
        assert got is None, where
        return
    if isinstance(want, dict):
        assert isinstance(got, dict), where
        assert sorted(got) == sorted(want), where
        for key in want:
            same(got[key], want[key], f"{where}[{key!r}]", mean)
        return
    if isinstance(want, list):
        assert isinstance(got, list), where
        assert len(got) == len(want), where
        for j, (g, w) in enumerate(zip(got, want, strict=True)):
            same(g, w, f"{where}[{j}]", mean)
        return
    if isinstance(want, int):
        assert type(got) is int, f"{where}: {got!r} != {want!r}"
        assert got == want, f"{where}: {got!r} != {want!r}"
        return
    got = np.asarray(got)
    assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{where}: shape {got.shape} != {want.shape}"
    if mean and want.dtype.kind == "f":
        np.testing.assert_array_max_ulp(got, want, maxulp=4)
    else:
        assert np.array_equal(got, want), f"{where}: {got!r} != {want!r}"


def check_results(
    program: Program, model: Model, results: tuple[Any, ...], n: int, wanted: list[list[Any]]
) -> None:
    assert len(results) == n
    for i in range(n):
        got = results[i]
        assert isinstance(got, list), f"replica {i}"
        assert len(got) == len(program.ops), f"replica {i}"
        for op, g, w in zip(program.ops, got, wanted[i], strict=True):
            mean = op.kind == "mirrored" or (op.kind == "all_reduce" and op.params["op"] == "mean")
            same(g, w, f"replica {i} op {op!r}", mean)


def check_variables(real: Real, model: Model, n: int) -> None:
    for j, var in enumerate(real.mirrored):
        copies = var.values
        assert len(copies) == n
        for c, copy in enumerate(copies):
            same(np.asarray(copy), model.mirrored[j], f"mirrored {j} copy {c}", mean=True)
    for j, var in enumerate(real.on_read):
        copies = var.values
        for c, copy in enumerate(copies):
            same(np.asarray(copy), model.on_read[j][c], f"on_read {j} copy {c}")


def local(strategy: MirroredStrategy, result: Any) -> tuple[Any, ...]:
    return strategy.experimental_local_results(result)


# -- the differential tests --------------------------------------------------------------------

CASES = [(seed, seed % 5 + 1, ["ordered", "random"][seed % 2]) for seed in range(30)]


@pytest.mark.parametrize(("seed", "n", "interleave"), CASES, ids=lambda x: str(x))
async def test_random_program_matches_the_model(seed: int, n: int, interleave: str) -> None:
    """Several runs of one random program: every result, variable, merge argument and
    counter equals the sequential model's."""
    for sub in range(3):
        program = make_program(seed * 7 + sub)
        kwargs: dict[str, Any] = {"interleave": interleave}
        if interleave == "random":
            kwargs["seed"] = seed * 131 + sub
        strategy = MirroredStrategy(host_devices(n), **kwargs)
        real = Real(program, strategy)
        model = Model(program, n)
        history: list[Any] = []
        try:
            with anyio.fail_after(20):
                for r in range(3):
                    before = strategy.statistics()
                    result = await strategy.run(real.step(r))
                    wanted = model.run(r)
                    check_results(program, model, local(strategy, result), n, wanted)
                    history.append((local(strategy, result), wanted))
                    check_variables(real, model, n)
                    after = strategy.statistics()
                    rounds = sum(op.kind in ROUNDS for op in program.ops)
                    assert after.steps - before.steps == 1
                    assert after.merge_rounds_completed - before.merge_rounds_completed == rounds
                    assert (after.runs_active, after.replicas_waiting) == (0, 0)
                    assert len(after.wait_total) == n
                assert real.merge_log == model.merge_log
                # results held by the caller are never reused for later results
                for results, wanted in history:
                    check_results(program, model, results, n, wanted)
        except BaseException as exc:
            exc.add_note(f"reproduce: {program!r}, n={n}, {kwargs}")
            raise


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
async def test_random_interleavings_agree(n: int) -> None:
    """One program, many interleave seeds: every run gives the ordered run's results."""
    program = make_program(1000 + n, length=12)
    for interleave_seed in range(8):
        strategy = MirroredStrategy(host_devices(n), interleave="random", seed=interleave_seed)
        real, model = Real(program, strategy), Model(program, n)
        try:
            with anyio.fail_after(10):
                for r in range(2):
                    result = await strategy.run(real.step(r))
                    check_results(program, model, local(strategy, result), n, model.run(r))
                    check_variables(real, model, n)
            assert real.merge_log == model.merge_log
        except BaseException as exc:
            exc.add_note(f"reproduce: {program!r}, n={n}, interleave seed {interleave_seed}")
            raise


@pytest.mark.parametrize("seed", [3, 4, 7])
async def test_concurrent_runs_of_independent_programs(seed: int) -> None:
    """Several tasks run their own programs (own variables) on one strategy at once: each
    matches its model, and the counters add up."""
    n = seed % 4 + 2
    strategy = MirroredStrategy(host_devices(n), interleave="random", seed=seed)
    programs = [make_program(seed * 100 + t) for t in range(4)]
    reals = [Real(p, strategy) for p in programs]
    models = [Model(p, n) for p in programs]
    errors: list[str] = []

    async def caller(t: int) -> None:
        for r in range(2):
            result = await strategy.run(reals[t].step(r))
            try:
                check_results(programs[t], models[t], local(strategy, result), n, models[t].run(r))
            except AssertionError as exc:
                errors.append(f"task {t} run {r}: {exc}\n{programs[t]!r}")

    before = strategy.statistics()
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            for t in range(4):
                tg.start_soon(caller, t)
    assert errors == []
    for t in range(4):
        check_variables(reals[t], models[t], n)
        assert reals[t].merge_log == models[t].merge_log, programs[t]
    after = strategy.statistics()
    rounds = 2 * sum(op.kind in ROUNDS for p in programs for op in p.ops)
    assert after.steps - before.steps == 8
    assert after.merge_rounds_completed - before.merge_rounds_completed == rounds
    assert (after.runs_active, after.replicas_waiting) == (0, 0)


# -- faults ------------------------------------------------------------------------------------


def states_between(model: Model, r: int, lo: int, hi: int) -> tuple[list[Any], list[Any]]:
    """Each variable's possible states if run ``r`` stopped anywhere from op ``lo`` to ``hi``
    (a copy of the model per stop): the mirrored values, and each on-read copy's."""
    import copy

    mirrored: list[list[np.ndarray]] = [[] for _ in model.mirrored]
    on_read: list[list[list[np.ndarray]]] = [[[] for _ in range(model.n)] for _ in model.on_read]
    for stop in range(lo, hi + 1):
        m = copy.deepcopy(model)
        m.run(r, stop)
        for j, v in enumerate(m.mirrored):
            mirrored[j].append(v)
        for j, copies in enumerate(m.on_read):
            for c, v in enumerate(copies):
                on_read[j][c].append(v)
    return mirrored, on_read


def check_one_of(real: Real, mirrored: list[Any], on_read: list[Any], where: str) -> None:
    for j, var in enumerate(real.mirrored):
        copies = [np.asarray(c) for c in var.values]
        for other in copies[1:]:
            assert np.array_equal(other, copies[0]), (
                f"{where}: mirrored {j} copies differ: {copies}"
            )
        assert any(np.allclose(copies[0], s, rtol=1e-15, atol=0) for s in mirrored[j]), (
            f"{where}: mirrored {j} = {copies[0]!r}, not one of {mirrored[j]!r}"
        )
    for j, var in enumerate(real.on_read):
        for c, copy in enumerate(var.values):
            assert any(np.array_equal(np.asarray(copy), s) for s in on_read[j][c]), (
                f"{where}: on_read {j} copy {c} = {copy!r}, not one of {on_read[j][c]!r}"
            )


def after_last_round(program: Program, k: int) -> int:
    """One past the last merge round before op ``k`` (0 if none): a replica other than the
    one that fails or cancels at ``k`` may still be anywhere from there on."""
    for op in reversed(program.ops[:k]):
        if op.kind in ROUNDS:
            return op.k + 1
    return 0


def next_round(program: Program, k: int) -> int:
    """The index of the first merge round at or after op ``k`` (or the program's length)."""
    for op in program.ops[k:]:
        if op.kind in ROUNDS:
            return op.k
    return len(program.ops)


async def reset_and_rerun(
    real: Real, model: Model, strategy: MirroredStrategy, n: int, r: int
) -> None:
    """The strategy still works: put the model's state back and run the program again."""
    for j, var in enumerate(real.mirrored):
        await var.assign(model.mirrored[j])
    for j, _var in enumerate(real.on_read):

        async def put(j: int = j) -> None:
            await real.on_read[j].assign(model.on_read[j][replica_id()])

        await strategy.run(put)
    check_variables(real, model, n)
    result = await strategy.run(real.step(r))
    check_results(real.p, model, local(strategy, result), n, model.run(r))
    check_variables(real, model, n)


class Boom(Exception):
    pass


@pytest.mark.parametrize("seed", range(8))
async def test_exception_in_one_replica(seed: int) -> None:
    """A replica raising before op k: run() raises it with a note naming the replica; every
    merge round before k happened, none after; the strategy still works."""
    rng = random.Random(seed)
    n = rng.randint(2, 5)
    program = make_program(500 + seed)
    k = rng.randrange(len(program.ops))
    bad = rng.randrange(n)
    strategy = MirroredStrategy(host_devices(n), interleave=rng.choice(["ordered", "random"]))
    real, model = Real(program, strategy), Model(program, n)
    try:
        with anyio.fail_after(10):
            await strategy.run(real.step(0))
            model.run(0)

            async def hook(i: int) -> None:
                if i == bad:
                    raise Boom(f"boom {seed}")

            before = strategy.statistics()
            with pytest.raises(Boom) as info:
                await strategy.run(real.step(1, {k: hook}))
            note = f"raised in replica {bad} of {n} (device cpu:{bad})"
            assert note in (info.value.__notes__ or []), info.value.__notes__
            after = strategy.statistics()
            assert (after.runs_active, after.replicas_waiting) == (0, 0)
            assert after.steps == before.steps
            assert after.merge_rounds_completed - before.merge_rounds_completed == sum(
                op.kind in ROUNDS for op in program.ops[:k]
            )
            mirrored, _ = states_between(model, 1, k, k)
            _, on_read = states_between(
                model, 1, after_last_round(program, k), next_round(program, k)
            )
            check_one_of(real, mirrored, on_read, "after the failure")
            model.run(1, k)
            # replica bad's own on-read copies stop exactly at k
            await reset_and_rerun(real, model, strategy, n, 2)
    except BaseException as exc:
        exc.add_note(f"reproduce: {program!r}, n={n}, fault before op {k} in replica {bad}")
        raise


@pytest.mark.parametrize("seed", range(6))
async def test_exception_in_a_merge_function(seed: int) -> None:
    """A merge function raising at op k: run() raises it once, the rounds before k happened."""
    rng = random.Random(seed)
    n = rng.randint(1, 5)
    program = make_program(600 + seed)
    merges = [op.k for op in program.ops if op.kind in ("merge_pr", "merge_one")]
    if not merges:
        program.ops[3] = Op("merge_one", 3)
        merges = [3]
    k = rng.choice(merges)
    strategy = MirroredStrategy(host_devices(n), interleave=rng.choice(["ordered", "random"]))
    real, model = Real(program, strategy), Model(program, n)

    def failing(strategy: MirroredStrategy, arg: Any) -> Any:
        raise Boom("merge")

    real.merge_fns[k] = failing
    try:
        with anyio.fail_after(10):
            with pytest.raises(Boom) as info:
                await strategy.run(real.step(0))
            assert any("in cross-replica context" in note for note in info.value.__notes__)
            mirrored, on_read = states_between(model, 0, k, next_round(program, k + 1))
            check_one_of(real, [m[:1] for m in mirrored], on_read, "after the failure")
            model.run(0, k)
            real.merge_fns[k] = real._merge_fn(program.ops[k])
            real.merge_log.clear()
            model.merge_log.clear()
            await reset_and_rerun(real, model, strategy, n, 1)
    except BaseException as exc:
        exc.add_note(f"reproduce: {program!r}, n={n}, merge_fn fails at op {k}")
        raise


@pytest.mark.parametrize("seed", range(8))
async def test_caller_cancelled_at_a_random_operation(seed: int) -> None:
    """A replica cancels the caller's scope before op k: run() is cancelled; every variable is
    all-or-nothing (a write at k may or may not have committed); the strategy still works."""
    rng = random.Random(seed)
    n = rng.randint(1, 5)
    program = make_program(700 + seed)
    k = rng.randrange(len(program.ops))
    who = rng.randrange(n)
    strategy = MirroredStrategy(host_devices(n), interleave=rng.choice(["ordered", "random"]))
    real, model = Real(program, strategy), Model(program, n)
    try:
        with anyio.fail_after(10):
            with anyio.CancelScope() as scope:

                async def hook(i: int) -> None:
                    if i == who:
                        scope.cancel()

                await strategy.run(real.step(0, {k: hook}))
            assert scope.cancelled_caught
            stats = strategy.statistics()
            assert (stats.runs_active, stats.replicas_waiting, stats.steps) == (0, 0, 0)
            # round k may still complete (the cancellation fires at the next await), no later
            # one; another replica's on-read write may commit before its next merge point
            r1 = next_round(program, k)
            mirrored, _ = states_between(model, 0, k, min(r1 + 1, len(program.ops)))
            _, on_read = states_between(
                model, 0, after_last_round(program, k), next_round(program, r1 + 1)
            )
            check_one_of(real, mirrored, on_read, "after the cancellation")
            # put the model's state back as before op k, and run again
            model.run(0, k)
            real.merge_log.clear()
            model.merge_log.clear()
            await reset_and_rerun(real, model, strategy, n, 1)
    except BaseException as exc:
        exc.add_note(f"reproduce: {program!r}, n={n}, replica {who} cancels before op {k}")
        raise


@pytest.mark.parametrize("seed", range(6))
async def test_move_on_after_at_a_random_time(seed: int) -> None:
    """``move_on_after`` around runs of a longer program, timed at random: whatever finished,
    each variable is in one of the model's states, its copies equal, and the strategy works."""
    rng = random.Random(seed)
    n = rng.randint(2, 4)
    program = make_program(800 + seed, length=30)
    strategy = MirroredStrategy(host_devices(n), interleave="random", seed=seed)
    real, model = Real(program, strategy), Model(program, n)
    try:
        with anyio.fail_after(10):
            with anyio.move_on_after(rng.uniform(0.0, 0.01)) as scope:
                await strategy.run(real.step(0))
            if scope.cancelled_caught:
                mirrored, on_read = states_between(model, 0, 0, len(program.ops))
                check_one_of(real, mirrored, on_read, "after move_on_after")
                model.run(0, 0)
                real.merge_log.clear()
            else:
                model.run(0)
                check_variables(real, model, n)
            model.merge_log.clear()
            real.merge_log.clear()
            await reset_and_rerun(real, model, strategy, n, 1)
    except BaseException as exc:
        exc.add_note(f"reproduce: {program!r}, n={n}")
        raise


@pytest.mark.parametrize("seed", range(3))
async def test_a_stalled_replica_times_out(seed: int) -> None:
    """One replica stalls before a merge round at op k: run() raises ReplicaSyncError naming it,
    detected by a merge timeout; the rounds before k happened; the strategy works after."""
    rng = random.Random(seed)
    n = rng.randint(2, 5)
    program = make_program(900 + seed)
    rounds = [op.k for op in program.ops if op.kind in ROUNDS]
    k = rng.choice(rounds)
    slow = rng.randrange(n)
    strategy = MirroredStrategy(
        host_devices(n), sync_timeout=0.05, interleave=rng.choice(["ordered", "random"])
    )
    real, model = Real(program, strategy), Model(program, n)

    async def hook(i: int) -> None:
        if i == slow:
            await anyio.sleep(30)

    try:
        with anyio.fail_after(10):
            with pytest.raises(ReplicaSyncError) as info:
                await strategy.run(real.step(0, {k: hook}))
            message = str(info.value)
            assert f"for replica {slow}, which did not arrive" in message, message
            assert any("detected by a merge timeout" in note for note in info.value.__notes__)
            mirrored, on_read = states_between(model, 0, k, k)
            check_one_of(real, mirrored, on_read, "after the timeout")
            model.run(0, k)
            real.merge_log.clear()
            model.merge_log.clear()
            await reset_and_rerun(real, model, strategy, n, 1)
    except BaseException as exc:
        exc.add_note(f"reproduce: {program!r}, n={n}, replica {slow} stalls before op {k}")
        raise


@pytest.mark.parametrize("seed", range(4))
async def test_a_kept_leaf_survives_later_collectives(seed: int) -> None:
    """Keeping one leaf (or a view of it) of a packed or large result and dropping the rest:
    later collectives of the same shapes never write into it."""
    rng = random.Random(seed)
    n = rng.randint(1, 4)
    strategy = MirroredStrategy(host_devices(n), interleave="random", seed=seed)
    size = rng.choice([3, 40_000, 300_000])
    kept: list[tuple[Any, np.ndarray]] = []

    async def step(r: int) -> Any:
        i = replica_id()
        value = {"a": np.full(size, float(r + i)), "b": [np.full(4, r * 10.0 + i)]}
        out = await replica_context().all_reduce("sum", value)
        view = out["b"][0][1:] if r % 2 else out["a"][::2]
        want = np.array(view, copy=True)
        return view, want

    with anyio.fail_after(10):
        for r in range(6):
            result = await strategy.run(step, args=(r,))
            view, want = local(strategy, result)[0]
            kept.append((view, want))
            del result
            for j, (v, w) in enumerate(kept):
                assert np.array_equal(v, w), (
                    f"seed {seed} size {size}: run {j}'s kept view changed after run {r}"
                )
