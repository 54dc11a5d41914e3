"""Randomized differential tests across workers: random step programs on two MPI ranks against
a sequential NumPy model of the whole job.

Every rank builds the same program from the same seed, so the ranks make the same collectives
in the same order; values depend on the global replica id (worker-major: worker w's local
replica j is ``w * L + j``), L = 1 or 2 local replicas. Operations: ``all_reduce`` (every op,
nested, packed small leaves, sometimes a leaf above 1 MiB, several dtypes), ``all_gather`` with
uneven rows (zero included), ``broadcast`` from a random global source, ``reduce_scatter``,
``barrier``, ``merge_call`` whose merge function reduces with ``strategy.reduce``,
``extended.reduce_to`` or ``batch_reduce_to``, writes of mirrored and sync-on-read variables in
the replicas. Between runs: ``strategy.reduce(axis=None|0)`` and ``strategy.gather`` of a
per-replica result, the cross-replica (global) read of the sync-on-read variables, a
``distribute_dataset`` pass of uneven global batches, and a checkpoint save/restore in a shared
directory. Everything compares exactly with the model: values are small integers, and the
replica count (2 or 4) is a power of two, so even ``MEAN`` (a sum divided by, or multiplied by
the reciprocal of, the count) is exact in every float dtype. Mirrored copies are compared
bitwise across the workers too.

Faults: a replica raising at a random op on one worker (its ``run()`` raises the exception, the
other's ``ReplicaSyncError`` naming the worker and the global replica; both strategies refuse
further calls with ``ClusterBroken``), and one worker stalled at a random op past
``sync_timeout``.

Every failure message prints the seed and the program: ``make_program(seed)`` rebuilds it.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

from aioreplica import (
    Checkpoint,
    CheckpointManager,
    ClusterBroken,
    CommunicationOptions,
    PerReplica,
    ReplicaSyncError,
    Variable,
    batched,
)
from aioreplica.testing import replica_context
from multiworker.mwtools import (
    RANK,
    WORKERS,
    allgather,
    assert_same_on_every_worker,
    each_replica,
    fingerprint,
    global_ids,
    shared_directory,
)

pytestmark = pytest.mark.anyio

DTYPES = ["float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8"]
FLOATS = ["float64", "float32", "float16"]
OPS = ["sum", "mean", "max", "min", "prod"]
KINDS = [
    "merge",
    "all_reduce",
    "all_reduce",
    "all_gather",
    "broadcast",
    "reduce_scatter",
    "barrier",
    "mirrored",
    "on_read",
    "cpu",
]
#: A leaf above 1 MiB (in bytes), reduced on its own rather than packed.
BIG_BYTES = (1 << 20) + 4096


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
    local: int
    ops: list[Op]
    mirrored: list[tuple[str, str, tuple[int, ...]]]  # (aggregation, dtype, shape)
    on_read: list[tuple[str, str, tuple[int, ...]]]

    @property
    def n(self) -> int:
        return WORKERS * self.local

    def __repr__(self) -> str:
        return (
            f"Program(seed={self.seed}, local={self.local}, workers={WORKERS}, "
            f"mirrored={self.mirrored}, on_read={self.on_read},\n  "
            + "\n  ".join(map(repr, self.ops))
            + ")"
        )


def make_program(seed: int, length: int = 10, local: int | None = None) -> Program:
    rng = random.Random(seed)
    if local is None:
        local = rng.choice([1, 2])
    mirrored = []
    for _ in range(2):
        agg = rng.choice(["sum", "mean", "only_first_replica"])
        dt = "float64" if agg == "mean" else rng.choice(["float64", "float32", "int64", "int32"])
        mirrored.append((agg, dt, rng.choice([(), (3,), (2, 2)])))
    on_read = [
        (rng.choice(["sum", "mean", "only_first_replica"]), "float64", rng.choice([(), (4,)]))
        for _ in range(2)
    ]
    ops = []
    n = WORKERS * local
    for k in range(length):
        kind = rng.choice(KINDS)
        params: dict[str, Any] = {}
        if kind == "all_reduce":
            op = rng.choice(OPS)
            choices = FLOATS if op == "mean" else DTYPES
            leaves: dict[str, Any] = {
                "s": (rng.choice(choices), ()),
                "v": (rng.choice(choices), (rng.randint(1, 5),)),
                "l": [(rng.choice(choices), (2, 3))],
                "t": ((rng.choice(choices), (2,)),),
            }
            if op in ("max", "min") and rng.random() < 0.3:
                leaves["b"] = ("bool", (3,))
            if op in ("sum", "mean", "prod") and rng.random() < 0.3:
                leaves["c"] = (rng.choice(["complex64", "complex128"]), (2,))
            if rng.random() < 0.2:
                dt = rng.choice(choices)
                leaves["big"] = (dt, (BIG_BYTES // np.dtype(dt).itemsize,))
            params = {
                "op": op,
                "leaves": leaves,
                "pack": rng.choice([None, 0, 8, 24, 64, 4096]),
                "timeout": rng.choice([None, 30.0]),
            }
        elif kind == "merge":
            params = {
                "how": rng.choice(
                    ["reduce", "reduce_to", "batch_reduce_to", "per_replica", "axis0", "write"]
                ),
                "op": rng.choice(OPS),
                "dtype": rng.choice(["float64", "float32", "int64", "int32"]),
            }
            if params["op"] == "mean":
                params["dtype"] = rng.choice(FLOATS)
            if params["how"] == "axis0":
                params["op"] = rng.choice(["sum", "max", "min"])
            if params["how"] == "write":
                params["var"] = rng.randrange(2)
        elif kind == "all_gather":
            params = {
                "dtype": rng.choice(DTYPES),
                "cols": rng.randint(1, 3),
                "empty": rng.random() < 0.2,
                "axis": rng.choice([0, 0, 1]),
            }
        elif kind == "broadcast":
            params = {
                "dtype": rng.choice(DTYPES),
                "source": rng.randrange(n),
                # the other replicas pass another shape and dtype, which broadcast ignores
                "others": rng.random() < 0.4,
            }
        elif kind == "reduce_scatter":
            params = {
                "op": rng.choice(OPS),
                "dtype": rng.choice(DTYPES),
                "rows": rng.randint(1, 9),
            }
            if params["op"] == "mean":
                params["dtype"] = rng.choice(FLOATS)
        elif kind in ("mirrored", "on_read"):
            params = {
                "var": rng.randrange(2),
                "write": rng.choice(["assign", "assign_add", "assign_sub"]),
            }
        elif kind == "cpu":
            params = {"size": rng.randint(1, 50)}
        ops.append(Op(kind, k, params))
    return Program(seed, local, ops, mirrored, on_read)


def without_call_timeouts(program: Program) -> Program:
    """A call's ``timeout_seconds`` overrides ``sync_timeout`` for that call (documented): the
    stall tests leave them out, so that ``sync_timeout`` bounds every wait."""
    for op in program.ops:
        if "timeout" in op.params:
            op.params["timeout"] = None
    return program


def value(
    seed: int, k: int, g: int, r: int, dtype: str, shape: tuple[int, ...], lo: int = -3, hi: int = 4
) -> np.ndarray:
    """Global replica ``g``'s value at op ``k`` of run ``r``: small integers, exact in any order."""
    rng = np.random.default_rng([seed, k, g, r])
    return rng.integers(lo, hi, size=shape).astype(dtype)


def reduce_model(op: str, arrays: list[np.ndarray]) -> Any:
    stack = np.stack(arrays)
    dtype = arrays[0].dtype
    if op == "sum":
        return np.sum(stack, axis=0).astype(dtype)
    if op == "mean":
        wide = np.complex128 if dtype.kind == "c" else np.float64
        return (np.sum(stack.astype(wide), axis=0) / len(arrays)).astype(dtype)
    if op == "max":
        return np.max(stack, axis=0)
    if op == "min":
        return np.min(stack, axis=0)
    return np.prod(stack, axis=0).astype(dtype)


def bounds(op: str) -> tuple[int, int]:
    return (1, 3) if op == "prod" else (-3, 4)


def leaf_values(seed: int, op: Op, g: int, r: int) -> dict[str, Any]:
    lo, hi = bounds(op.params["op"])
    out: dict[str, Any] = {}
    for j, (name, spec) in enumerate(op.params["leaves"].items()):
        if name == "l":
            dt, sh = spec[0]
            out[name] = [value(seed, op.k * 10 + j, g, r, dt, sh, lo, hi)]
        elif name == "t":
            dt, sh = spec[0]
            out[name] = (value(seed, op.k * 10 + j, g, r, dt, sh, lo, hi),)
        else:
            dt, sh = spec
            out[name] = value(seed, op.k * 10 + j, g, r, dt, sh, lo, hi)
    return out


def merge_values(seed: int, op: Op, g: int, r: int) -> tuple[np.ndarray, np.ndarray]:
    lo, hi = bounds(op.params["op"])
    dt = op.params["dtype"]
    return (
        value(seed, op.k * 10, g, r, dt, (3,), lo, hi),
        value(seed, op.k * 10 + 1, g, r, dt, (2, 2), lo, hi),
    )


def merge_rows(seed: int, op: Op, g: int, r: int) -> np.ndarray:
    """Uneven rows (zero included) for a merge reducing along axis 0."""
    return value(seed, op.k * 10 + 2, g, r, op.params["dtype"], ((g + op.k) % 3, 2))


def write_value(seed: int, op: Op, g: int, r: int, program: Program) -> np.ndarray:
    _, dt, sh = program.mirrored[op.params["var"]]
    return value(seed, op.k * 10 + 3, g, r, dt, sh)


def gather_rows(op: Op, g: int, r: int) -> int:
    return 0 if op.params.get("empty") else (g + op.k + r) % 3


def gather_part(seed: int, op: Op, g: int, r: int) -> np.ndarray:
    p = op.params
    shape = (gather_rows(op, g, r), p["cols"])
    if p.get("axis") == 1:
        shape = (p["cols"], gather_rows(op, g, r))
    return value(seed, op.k, g, r, p["dtype"], shape)


def cpu_work(size: int, g: int, r: int) -> int:
    return int(np.arange(size * (g + 1) + r, dtype=np.int64).sum())


def tag_rows(g: int, r: int) -> int:
    return (g + r) % 3  # zero rows included


class Model:
    """The whole job's program, one operation at a time, every global replica in order."""

    def __init__(self, program: Program) -> None:
        self.p = program
        self.n = program.n
        self.mirrored = [np.zeros(sh, dt) for _, dt, sh in program.mirrored]
        self.on_read: list[list[Any]] = [
            [np.zeros(sh, dt) for _ in range(self.n)] for _, dt, sh in program.on_read
        ]

    def run(self, r: int, stop: int | None = None) -> list[list[Any]]:
        seed, n = self.p.seed, self.n
        results: list[list[Any]] = [[] for _ in range(n)]
        for op in self.p.ops[:stop]:
            kind, p = op.kind, op.params
            if kind == "merge":
                per = [merge_values(seed, op, g, r) for g in range(n)]
                a = reduce_model(p["op"], [x[0] for x in per])
                b = reduce_model(p["op"], [x[1] for x in per])
                out: Any = a
                if p["how"] == "batch_reduce_to":
                    out = [a, b]
                elif p["how"] == "axis0":
                    rows = np.concatenate([merge_rows(seed, op, g, r) for g in range(n)])
                    out = reduce_model(p["op"], list(rows)) if len(rows) else None
                elif p["how"] == "write":
                    v = p["var"]
                    _, dt, _ = self.p.mirrored[v]
                    vals = [write_value(seed, op, g, r, self.p) for g in range(n)]
                    self.mirrored[v] = (self.mirrored[v] + np.sum(np.stack(vals), axis=0)).astype(
                        dt
                    )
                    out = self.mirrored[v]
                for g in range(n):
                    if p["how"] == "per_replica":
                        results[g].append((a + g).astype(a.dtype))
                    else:
                        results[g].append(out)
            elif kind == "all_reduce":
                leaves = [leaf_values(seed, op, g, r) for g in range(n)]
                red = {
                    name: type(leaves[0][name])(
                        [reduce_model(p["op"], [x[name][0] for x in leaves])]
                    )
                    if name in ("l", "t")
                    else reduce_model(p["op"], [x[name] for x in leaves])
                    for name in leaves[0]
                }
                for g in range(n):
                    results[g].append(red)
            elif kind == "all_gather":
                parts = [gather_part(seed, op, g, r) for g in range(n)]
                for g in range(n):
                    results[g].append(np.concatenate(parts, axis=p["axis"]))
            elif kind == "broadcast":
                for g in range(n):
                    results[g].append(value(seed, op.k, p["source"], r, p["dtype"], (3,)))
            elif kind == "reduce_scatter":
                arrays = [
                    value(seed, op.k, g, r, p["dtype"], (p["rows"], 2), *bounds(p["op"]))
                    for g in range(n)
                ]
                chunks = np.array_split(reduce_model(p["op"], arrays), n)
                for g in range(n):
                    results[g].append(chunks[g])
            elif kind == "barrier":
                for g in range(n):
                    results[g].append(None)
            elif kind == "mirrored":
                v = p["var"]
                agg, dt, sh = self.p.mirrored[v]
                vals = [value(seed, op.k, g, r, dt, sh) for g in range(n)]
                if agg == "sum":
                    new = np.sum(np.stack(vals), axis=0).astype(dt)
                elif agg == "mean":
                    new = (np.sum(np.stack(vals), axis=0) / n).astype(dt)
                else:
                    new = vals[0]
                if p["write"] == "assign":
                    self.mirrored[v] = new
                elif p["write"] == "assign_add":
                    self.mirrored[v] = (self.mirrored[v] + new).astype(dt)
                else:
                    self.mirrored[v] = (self.mirrored[v] - new).astype(dt)
                for g in range(n):
                    results[g].append(self.mirrored[v])
            elif kind == "on_read":
                v = p["var"]
                _, dt, sh = self.p.on_read[v]
                for g in range(n):
                    new = value(seed, op.k, g, r, dt, sh)
                    if p["write"] == "assign":
                        self.on_read[v][g] = new
                    elif p["write"] == "assign_add":
                        self.on_read[v][g] = self.on_read[v][g] + new
                    else:
                        self.on_read[v][g] = self.on_read[v][g] - new
                    results[g].append(self.on_read[v][g])
            else:
                for g in range(n):
                    results[g].append(cpu_work(p["size"], g, r))
        return results

    def on_read_global(self, j: int) -> Any:
        agg = self.p.on_read[j][0]
        total = np.sum(np.stack(self.on_read[j]), axis=0)
        if agg == "only_first_replica":
            return self.on_read[j][0]
        return total if agg == "sum" else total / self.n


# -- running a program -------------------------------------------------------------------------


class Real:
    """The program's variables and step on a multi-worker strategy."""

    def __init__(self, program: Program, strategy: Any) -> None:
        self.p = program
        self.strategy = strategy
        with strategy.scope():
            self.mirrored = [
                Variable(np.zeros(sh, dt), aggregation=agg, name=f"m{j}")
                for j, (agg, dt, sh) in enumerate(program.mirrored)
            ]
            self.on_read = [
                Variable(np.zeros(sh, dt), synchronization="on_read", aggregation=agg, name=f"o{j}")
                for j, (agg, dt, sh) in enumerate(program.on_read)
            ]

    def _merge_fn(self, op: Op, r: int) -> Any:
        p = op.params

        program, real = self.p, self

        async def merge_fn(strategy: Any, a: Any, b: Any, rows: Any, w: Any) -> Any:
            if p["how"] == "per_replica":
                total = await strategy.reduce(p["op"], a, axis=None)
                ids = global_ids(program.local)
                if len(ids) == 1:
                    return (total + ids[0]).astype(total.dtype)
                return PerReplica([(total + g).astype(total.dtype) for g in ids])
            if p["how"] == "axis0":
                if sum(len(merge_rows(program.seed, op, g, r)) for g in range(program.n)) == 0:
                    return None
                return await strategy.reduce(p["op"], rows, axis=0)
            if p["how"] == "write":
                var = real.mirrored[p["var"]]
                total = await strategy.reduce("sum", w, axis=None)
                await var.assign_add(total)
                return np.array(var.value())
            if p["how"] == "reduce":
                return await strategy.reduce(p["op"], a, axis=None)
            if p["how"] == "reduce_to":
                return await strategy.extended.reduce_to(p["op"], a, "cpu:0")
            got = await strategy.extended.batch_reduce_to(p["op"], [(a, "cpu:0"), (b, "cpu:0")])
            return list(got)

        return merge_fn

    def step(self, r: int, hooks: dict[int, Any] | None = None) -> Any:
        seed = self.p.seed

        async def step() -> tuple[list[Any], Any, Any]:
            ctx = replica_context()
            g = ctx.replica_id_in_sync_group
            out: list[Any] = []
            for op in self.p.ops:
                if hooks and op.k in hooks:
                    await hooks[op.k](g)
                kind, p = op.kind, op.params
                if kind == "merge":
                    a, b = merge_values(seed, op, g, r)
                    rows = merge_rows(seed, op, g, r)
                    w = write_value(seed, op, g, r, self.p) if p["how"] == "write" else None
                    got = await ctx.merge_call(self._merge_fn(op, r), args=(a, b, rows, w))
                    out.append(got)
                elif kind == "all_reduce":
                    options = None
                    if p["pack"] is not None or p["timeout"] is not None:
                        options = CommunicationOptions(
                            bytes_per_pack=p["pack"] or 0, timeout_seconds=p["timeout"]
                        )
                    got = await ctx.all_reduce(p["op"], leaf_values(seed, op, g, r), options)
                    out.append(got)
                elif kind == "all_gather":
                    mine = gather_part(seed, op, g, r)
                    out.append(await ctx.all_gather(mine, axis=p["axis"]))
                elif kind == "broadcast":
                    mine = value(seed, op.k, g, r, p["dtype"], (3,))
                    if p["others"] and g != p["source"]:
                        mine = value(seed, op.k, g, r, "int16", (g % 3 + 1, 2))
                    out.append(await ctx.broadcast(mine, source_replica=p["source"]))
                elif kind == "reduce_scatter":
                    mine = value(seed, op.k, g, r, p["dtype"], (p["rows"], 2), *bounds(p["op"]))
                    out.append(await ctx.reduce_scatter(p["op"], mine))
                elif kind == "barrier":
                    barrier: Any = ctx.barrier()
                    out.append(await barrier)
                elif kind in ("mirrored", "on_read"):
                    var = getattr(self, kind)[p["var"]]
                    _, dt, sh = getattr(self.p, kind)[p["var"]]
                    await getattr(var, p["write"])(value(seed, op.k, g, r, dt, sh))
                    out.append(np.array(var.value()))
                else:
                    for _ in range(g % 3):
                        await anyio.lowlevel.checkpoint()
                    out.append(cpu_work(p["size"], g, r))
            if hooks and len(self.p.ops) in hooks:  # after the last op
                await hooks[len(self.p.ops)](g)
            # per-replica results for the cross-replica reductions between runs
            fixed = value(seed, 990, g, r, "int64", (2, 3))
            uneven = value(seed, 991, g, r, "int32", (tag_rows(g, r), 2))
            return out, fixed, uneven

        return step


def same(got: Any, want: Any, where: str) -> None:
    if want is None:
        assert got is None, where
        return
    if isinstance(want, dict):
        assert isinstance(got, dict), f"{where}: {type(got)}"
        assert sorted(got) == sorted(want), where
        for key in want:
            same(got[key], want[key], f"{where}[{key!r}]")
        return
    if isinstance(want, tuple):
        assert type(got) is tuple, f"{where}: {type(got)} for a tuple"
        want = list(want)
        got = list(got)
    if isinstance(want, list):
        assert isinstance(got, (list, tuple)), f"{where}: {type(got)}"
        assert len(got) == len(want), where
        for j, (g, w) in enumerate(zip(got, want, strict=True)):
            same(g, w, f"{where}[{j}]")
        return
    if isinstance(want, int):
        assert type(got) is int, f"{where}: {got!r} != {want!r}"
        assert got == want, f"{where}: {got!r} != {want!r}"
        return
    got = np.asarray(got)
    assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{where}: shape {got.shape} != {want.shape}"
    assert np.array_equal(got, want), f"{where}: {got!r} != {want!r}"


def agreed(check: Any, *args: Any) -> None:
    """Run a local check on every rank, then fail on every rank if it failed on any: a rank
    failing alone would leave its peer waiting in the next collective (a hang, not a report)."""
    try:
        check(*args)
        mine = None
    except AssertionError as exc:
        mine = f"worker {RANK}: {exc}"
    failures = [f for f in allgather(mine) if f is not None]
    if failures:
        raise AssertionError("\n".join(failures))


def mirrored_are(real: Real, model: Model) -> None:
    for j, var in enumerate(real.mirrored):
        for c in real.strategy.experimental_local_results(var):
            same(np.asarray(c), model.mirrored[j], f"worker {RANK} mirrored {j}")


def whole_ops_held(real: Real, program: Program, ops: range) -> list[int]:
    """Each ``j`` in ``ops`` such that every copy of this worker's mirrored variables holds the
    values of the second run stopped after ``j`` ops (several, where ops write nothing)."""
    mine = [
        [np.asarray(c) for c in real.strategy.experimental_local_results(var)]
        for var in real.mirrored
    ]
    held = []
    for stop in ops:
        model = Model(program)
        model.run(0)
        model.run(1, stop)
        if all(
            c.dtype == m.dtype and c.shape == m.shape and np.array_equal(c, m)
            for copies, m in zip(mine, model.mirrored, strict=True)
            for c in copies
        ):
            held.append(stop)
    return held


def mirrored_after_whole_ops(real: Real, program: Program, ops: range) -> None:
    """Every copy of this worker's mirrored variables holds the values of the second run
    stopped after ``j`` ops, for one ``j`` in ``ops``."""
    if not whole_ops_held(real, program, ops):
        mine = [
            [np.asarray(c).tolist() for c in real.strategy.experimental_local_results(v)]
            for v in real.mirrored
        ]
        raise AssertionError(
            f"worker {RANK}: mirrored copies {mine} are those of no whole number of ops in {ops}"
        )


def local(strategy: Any, result: Any) -> tuple[Any, ...]:
    return tuple(strategy.experimental_local_results(result))


def check_results(program: Program, results: tuple[Any, ...], wanted: list[list[Any]]) -> None:
    assert len(results) == program.local
    for j, g in enumerate(global_ids(program.local)):
        got = results[j]
        assert isinstance(got, list), f"replica {g}"
        assert len(got) == len(program.ops), f"replica {g}"
        for op, x, w in zip(program.ops, got, wanted[g], strict=True):
            same(x, w, f"worker {RANK} replica {g} op {op!r}")


def check_variables(real: Real, model: Model) -> None:
    agreed(check_variables_here, real, model)
    assert_same_on_every_worker(
        *[np.asarray(c) for v in real.mirrored for c in real.strategy.experimental_local_results(v)]
    )


def check_variables_here(real: Real, model: Model) -> None:
    program = real.p
    for j, var in enumerate(real.mirrored):
        copies = list(real.strategy.experimental_local_results(var))
        assert len(copies) == program.local
        for c, copy in enumerate(copies):
            same(np.asarray(copy), model.mirrored[j], f"worker {RANK} mirrored {j} copy {c}")
    for j, var in enumerate(real.on_read):
        copies = list(real.strategy.experimental_local_results(var))
        for c, g in enumerate(global_ids(program.local)):
            same(np.asarray(copies[c]), model.on_read[j][g], f"worker {RANK} on_read {j} copy {g}")


async def check_between_runs(real: Real, model: Model, result: Any, r: int) -> None:
    """strategy.reduce (axis None and 0) and gather of per-replica results; the global read of
    the sync-on-read variables. Every collective first, then the comparisons (on every rank)."""
    strategy, seed, n = real.strategy, real.p.seed, real.p.n
    _, fixed, uneven = result
    fixed_all = [value(seed, 990, g, r, "int64", (2, 3)) for g in range(n)]
    uneven_all = [value(seed, 991, g, r, "int32", (tag_rows(g, r), 2)) for g in range(n)]
    floats = nest_map(lambda x: x.astype(np.float64), uneven)
    got = {
        "reduce": await strategy.reduce("sum", fixed, axis=None),
        "max": await strategy.reduce("max", fixed, axis=None),
        "reduce axis=0": await strategy.reduce("sum", uneven, axis=0),
        "gather": await strategy.gather(uneven, axis=0),
        "mean axis=0": await strategy.reduce("mean", floats, axis=0),
        "mean axis=None": await strategy.reduce("mean", nest_map(lambda x: x * 1.0, fixed), None),
        "gather fixed": await strategy.gather(fixed, axis=0),
    }
    reads = [np.asarray(var.read_value()) for var in real.on_read]

    def compare() -> None:
        same(got["reduce"], reduce_model("sum", fixed_all), "reduce")
        same(got["max"], reduce_model("max", fixed_all), "max")
        same(
            got["reduce axis=0"],
            np.concatenate(uneven_all).sum(axis=0).astype(np.int32),
            "reduce axis=0",
        )
        same(got["gather"], np.concatenate(uneven_all), "gather")
        # a mean over a row count that is no power of two: one rounding, to 2 ulp
        mean = np.asarray(got["mean axis=0"])
        want = np.concatenate(uneven_all).astype(np.float64).mean(axis=0)
        assert mean.dtype == want.dtype, (mean, want)
        assert mean.shape == want.shape, (mean, want)
        np.testing.assert_array_max_ulp(mean, want, maxulp=2)
        same(
            np.asarray(got["mean axis=None"]),
            np.mean(np.stack(fixed_all).astype(np.float64), axis=0),
            "mean axis=None",
        )
        same(got["gather fixed"], np.concatenate(fixed_all), "gather fixed")
        for j, read in enumerate(reads):
            same(read, model.on_read_global(j), f"on_read {j} global read")

    agreed(compare)


async def writes_outside_run(real: Real, model: Model, r: int) -> None:
    """Writes outside run(), each worker passing its own value: a mirrored variable takes the
    chief's on every worker (documented); a sync-on-read one's global read is then the value
    written (as TF spreads a SUM over the copies), and the model takes the copies."""
    strategy, seed = real.strategy, real.p.seed
    for j, var in enumerate(real.mirrored):
        _, dt, sh = real.p.mirrored[j]
        mine = value(seed, 800 + j, 100 + RANK, r, dt, sh)
        chief = value(seed, 800 + j, 100, r, dt, sh)
        await var.assign(mine)
        model.mirrored[j] = chief
    for j, var in enumerate(real.on_read):
        _, dt, sh = real.p.on_read[j]
        written = value(seed, 850 + j, 100, r, dt, sh) * 4  # divisible by n: exact when spread
        await var.assign(written)
        read = np.asarray(var.read_value())
        agreed(same, read, written, f"on_read {j} read after assign outside run")
        copies = [np.asarray(c) for c in strategy.experimental_local_results(var)]
        model.on_read[j] = [c for rank in allgather(copies) for c in rank]
    check_variables(real, model)


def nest_map(fn: Any, value: Any) -> Any:
    if isinstance(value, PerReplica):
        return PerReplica([fn(v) for v in value.values])
    return fn(value)


async def dataset_pass(strategy: Any, program: Program, r: int) -> None:
    """A distribute_dataset pass of uneven global batches: replica g sees slice g of each."""
    n = program.n
    rng = np.random.default_rng([program.seed, 77, r])
    sizes = [int(s) for s in rng.integers(0, 2 * n + 2, size=4)] + [1]
    start = 0
    batches = []
    for s in sizes:
        batches.append(np.arange(start, start + s, dtype=np.int64).reshape(s, 1) * 3)
        start += s

    async def step(x: Any) -> Any:
        total = await replica_context().all_reduce("sum", np.int64(x.shape[0]))
        return np.array(x), total

    seen = 0
    prefetch = int(rng.integers(0, 3))
    async for element in strategy.distribute_dataset(batches, prefetch=prefetch):
        want = np.array_split(batches[seen], n)
        result = await strategy.run(step, args=(element,))

        def compare(result: Any = result, want: Any = want, seen: int = seen) -> None:
            for j, g in enumerate(global_ids(program.local)):
                x, total = each_replica(strategy, result)[j]
                same(x, want[g], f"batch {seen} replica {g}")
                assert int(total) == len(batches[seen]), f"batch {seen} of {sizes}"

        agreed(compare)
        seen += 1
    assert seen == len(batches)


async def checkpoint_round_trip(real: Real, model: Model, directory: str, r: int) -> None:
    """Save, clobber every variable, restore: the mirrored copies and the global reads of the
    sync-on-read variables are back; the model takes the restored sync-on-read copies (the
    library may spread a restored total over them)."""
    strategy = real.strategy
    objects = {f"m{j}": v for j, v in enumerate(real.mirrored)}
    objects.update({f"o{j}": v for j, v in enumerate(real.on_read)})
    checkpoint = Checkpoint(**objects)
    path = await checkpoint.save(os.path.join(directory, f"ckpt-{r}"))
    assert allgather(path) == [path] * WORKERS
    for var in real.mirrored:
        await var.assign(np.full(var.shape, 9, var.dtype))
    for var in real.on_read:
        await var.assign(np.full(var.shape, 9.0, var.dtype))
    await checkpoint.restore(path)
    reads = [np.asarray(var.read_value()) for var in real.on_read]
    for j, read in enumerate(reads):
        agreed(same, read, model.on_read_global(j), f"restored on_read {j}")
    # the model takes the restored copies of every worker (their aggregate was checked)
    for j, var in enumerate(real.on_read):
        mine = [np.asarray(c) for c in strategy.experimental_local_results(var)]
        everyone = [c for rank in allgather(mine) for c in rank]
        model.on_read[j] = everyone
    check_variables(real, model)


CASES = [(seed, local) for seed in range(16) for local in (1, 2)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("seed", "local_replicas"), CASES, ids=lambda x: str(x))
async def test_random_program_matches_the_model(
    make_strategy: Any, seed: int, local_replicas: int
) -> None:
    """Three runs of a random program, with cross-replica reductions, a dataset pass and a
    checkpoint round trip between them: every result and variable copy equals the model's,
    and the mirrored copies are bitwise identical on every worker."""
    program = make_program(seed * 11 + 3, length=16, local=local_replicas)
    kwargs: dict[str, Any] = {}
    if seed % 2:
        kwargs = {"interleave": "random", "seed": seed}
    if seed % 3 == 1:  # not the fast path: every wait bounded
        kwargs["sync_timeout"] = 30.0
    strategy = make_strategy(local_replicas, **kwargs)
    real, model = Real(program, strategy), Model(program)
    try:
        with shared_directory() as directory, anyio.fail_after(50):
            for r in range(3):
                result = await strategy.run(real.step(r))
                wanted = model.run(r)
                parts = each_replica(strategy, result)
                results: tuple[Any, ...] = tuple(part[0] for part in parts)
                if local_replicas == 1:
                    fixed, uneven = parts[0][1], parts[0][2]
                else:
                    fixed = PerReplica([part[1] for part in parts])
                    uneven = PerReplica([part[2] for part in parts])
                agreed(check_results, program, results, wanted)
                check_variables(real, model)
                await check_between_runs(real, model, (None, fixed, uneven), r)
                if r == 0:
                    await dataset_pass(strategy, program, r)
                if r == 1:
                    await checkpoint_round_trip(real, model, directory, r)
                if r == 0 or seed % 2:
                    await writes_outside_run(real, model, r)
    except BaseException as exc:
        exc.add_note(f"reproduce: {program!r} (worker {RANK}, {kwargs})")
        raise


# -- faults ------------------------------------------------------------------------------------


class Boom(Exception):
    pass


async def assert_refused(strategy: Any) -> str:
    """Every later call is refused with ClusterBroken, saying why."""
    with pytest.raises(ClusterBroken) as caught:
        await strategy.run(lambda: None)
    with pytest.raises(ClusterBroken):
        await strategy.reduce("sum", np.ones(1), axis=None)
    return str(caught.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(10))
async def test_exception_in_one_replica_of_one_worker(make_strategy: Any, seed: int) -> None:
    """A replica of one worker raises before op k: that worker's run() raises it, the other's a
    ReplicaSyncError naming the worker and the global replica; both refuse later calls."""
    rng = random.Random(seed)
    local_replicas = rng.choice([1, 2])
    program = make_program(500 + seed, local=local_replicas)
    k = rng.randrange(len(program.ops) + 1)
    bad_worker = rng.randrange(WORKERS)
    bad = bad_worker * local_replicas + rng.randrange(local_replicas)
    strategy = make_strategy(local_replicas, **({"sync_timeout": 30.0} if seed % 2 else {}))
    real, model = Real(program, strategy), Model(program)

    async def hook(g: int) -> None:
        if g == bad:
            raise Boom(f"boom {seed}")

    try:
        with anyio.fail_after(20):
            result = await strategy.run(real.step(0))
            wanted = model.run(0)
            results = tuple(p[0] for p in each_replica(strategy, result))
            agreed(check_results, program, results, wanted)
            outcome: tuple[Any, ...]
            try:
                await strategy.run(real.step(1, {k: hook}))
            except Boom as exc:
                outcome = ("Boom", str(exc))
            except ReplicaSyncError as exc:
                message = str(exc)
                outcome = (
                    "ReplicaSyncError",
                    exc.workers,
                    f"worker {bad_worker} failed" in message,
                    f"raised in replica {bad}" in message,
                    "Boom" in message,
                )
            else:
                outcome = ("returned",)
            refused = await assert_refused(strategy)
            everyone = allgather((outcome, bool(refused)))
            want = [
                (("Boom", f"boom {seed}"), True)
                if w == bad_worker
                else (("ReplicaSyncError", (bad_worker,), True, True, True), True)
                for w in range(WORKERS)
            ]
            assert everyone == want
            # whatever was written, the mirrored copies agree on every worker
            mine = [
                fingerprint(c)
                for v in real.mirrored
                for c in strategy.experimental_local_results(v)
            ]
            assert len({tuple(x) for x in allgather(mine)}) == 1
            # no write at or after op k happened anywhere; every one before it did
            model.run(1, k)
            agreed(mirrored_are, real, model)
    except BaseException as exc:
        exc.add_note(
            f"reproduce: {program!r}, replica {bad} (worker {bad_worker}) raises before op {k}"
        )
        raise


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(4))
async def test_a_stalled_worker_times_out(make_strategy: Any, seed: int) -> None:
    """Every replica of one worker stalls before op k, past sync_timeout: the waiting worker's
    run() raises ReplicaSyncError naming the stalled worker; the stalled one raises too when it
    gets there, never going on alone; the mirrored copies stay bitwise identical; both refuse
    later calls."""
    rng = random.Random(seed)
    local_replicas = rng.choice([1, 2])
    program = without_call_timeouts(make_program(900 + seed, local=local_replicas))
    k = rng.randrange(len(program.ops) + 1)
    slow = rng.randrange(WORKERS)
    timeout = 0.3
    strategy = make_strategy(local_replicas, sync_timeout=timeout)
    real, model = Real(program, strategy), Model(program)

    async def hook(g: int) -> None:
        if slow == RANK:
            await anyio.sleep(4 * timeout)

    try:
        with anyio.fail_after(20):
            await strategy.run(real.step(0))
            model.run(0)
            outcome: tuple[Any, ...]
            try:
                await strategy.run(real.step(1, {k: hook}))
            except ReplicaSyncError as exc:
                outcome = ("ReplicaSyncError", exc.workers if slow != RANK else "-")
            except BaseException as exc:
                outcome = ("other", repr(exc))
            else:
                outcome = ("returned",)
            refused = await assert_refused(strategy)
            everyone = allgather((outcome, bool(refused)))
            want = [
                (("ReplicaSyncError", "-" if w == slow else (slow,)), True) for w in range(WORKERS)
            ]
            assert everyone == want
            # whatever was written, the mirrored copies agree on every worker
            mine = [
                fingerprint(c)
                for v in real.mirrored
                for c in strategy.experimental_local_results(v)
            ]
            assert len({tuple(x) for x in allgather(mine)}) == 1
            # the late worker never goes on alone: no mirrored write at or after op k
            model.run(1, k)
            agreed(mirrored_are, real, model)
    except BaseException as exc:
        exc.add_note(f"reproduce: {program!r}, worker {slow} stalls before op {k}")
        raise


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(6))
async def test_a_run_cancelled_on_one_worker(make_strategy: Any, seed: int) -> None:
    """A replica of one worker cancels that worker's scope around run() before op k: that
    run() is cancelled; the other worker's raises ReplicaSyncError naming the cancelled worker
    (a cancelled run counts as that worker failing); both refuse later calls. Each worker's
    mirrored variables hold the values of a whole number of ops, k or more, every copy alike:
    a write is all or nothing on each worker. The workers may stop one write apart, no more: a
    write whose collective the cancelled worker had posted completes on the others, as
    docs/multi-worker.md says, while the cancelled worker stops before applying it."""
    rng = random.Random(seed)
    local_replicas = rng.choice([1, 2])
    program = make_program(1300 + seed, local=local_replicas)
    k = rng.randrange(len(program.ops) + 1)
    who_worker = rng.randrange(WORKERS)
    who = who_worker * local_replicas + rng.randrange(local_replicas)
    strategy = make_strategy(local_replicas)
    real = Real(program, strategy)
    try:
        with anyio.fail_after(20):
            await strategy.run(real.step(0))
            outcome: tuple[Any, ...]
            with anyio.CancelScope() as scope:

                async def hook(g: int) -> None:
                    if g == who:
                        scope.cancel()

                try:
                    await strategy.run(real.step(1, {k: hook}))
                except ReplicaSyncError as exc:
                    outcome = ("ReplicaSyncError", exc.workers)
                except Exception as exc:
                    outcome = ("other", repr(exc))
                else:
                    outcome = ("returned",)
            if scope.cancelled_caught:
                outcome = ("cancelled",)
            refused = await assert_refused(strategy)
            everyone = allgather((outcome, bool(refused)))
            want = [
                (("cancelled",) if w == who_worker else ("ReplicaSyncError", (who_worker,)), True)
                for w in range(WORKERS)
            ]
            assert everyone == want
            ops = range(k, len(program.ops) + 1)
            agreed(mirrored_after_whole_ops, real, program, ops)
            # At most one write apart: the one whose collective the cancelled worker posted.
            held = allgather(whole_ops_held(real, program, ops))
            gap = max(min(abs(a - b) for a in x for b in y) for x in held for y in held)
            assert gap <= 1, f"the workers hold the values after ops {held}"
    except BaseException as exc:
        exc.add_note(f"reproduce: {program!r}, replica {who} cancels before op {k}")
        raise


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(6))
async def test_a_merge_function_failing_on_one_worker(make_strategy: Any, seed: int) -> None:
    """The merge function of a random merge op raises on one worker only: that worker's run()
    raises it, the other's ReplicaSyncError naming the worker; the mirrored copies stay
    bitwise identical and equal to the model's before that op; both refuse later calls."""
    rng = random.Random(seed)
    local_replicas = rng.choice([1, 2])
    program = make_program(1500 + seed, local=local_replicas)
    merges = [op.k for op in program.ops if op.kind == "merge"]
    if not merges:
        program.ops[3] = Op("merge", 3, {"how": "reduce", "op": "sum", "dtype": "int64"})
        merges = [3]
    k = rng.choice(merges)
    bad_worker = rng.randrange(WORKERS)
    strategy = make_strategy(local_replicas, **({"sync_timeout": 30.0} if seed % 2 else {}))
    real, model = Real(program, strategy), Model(program)
    original = real._merge_fn

    def patched(op: Op, r: int) -> Any:
        if op.k == k and r == 1 and bad_worker == RANK:

            async def failing(strategy: Any, *args: Any) -> Any:
                raise Boom(f"merge {seed}")

            return failing
        return original(op, r)

    real._merge_fn = patched  # type: ignore[method-assign]
    try:
        with anyio.fail_after(20):
            await strategy.run(real.step(0))
            model.run(0)
            outcome: tuple[Any, ...]
            try:
                await strategy.run(real.step(1))
            except Boom as exc:
                outcome = ("Boom", str(exc))
            except ReplicaSyncError as exc:
                outcome = ("ReplicaSyncError", exc.workers, "Boom" in str(exc))
            else:
                outcome = ("returned",)
            refused = await assert_refused(strategy)
            everyone = allgather((outcome, bool(refused)))
            want = [
                (
                    ("Boom", f"merge {seed}")
                    if w == bad_worker
                    else ("ReplicaSyncError", (bad_worker,), True),
                    True,
                )
                for w in range(WORKERS)
            ]
            assert everyone == want
            mine = [
                fingerprint(c)
                for v in real.mirrored
                for c in strategy.experimental_local_results(v)
            ]
            assert len({tuple(x) for x in allgather(mine)}) == 1
            model.run(1, k)
            agreed(mirrored_are, real, model)
    except BaseException as exc:
        exc.add_note(f"reproduce: {program!r}, merge_fn of op {k} fails on worker {bad_worker}")
        raise


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(3))
async def test_one_local_replica_stalled_on_one_worker(make_strategy: Any, seed: int) -> None:
    """Two local replicas; one replica of one worker stalls before a random op past
    sync_timeout: every worker's run() raises ReplicaSyncError (the stalled worker's names its
    own late replica, or itself as the worker the other gave up on; the other's names the
    stalled worker); the mirrored copies stay bitwise
    identical across workers; both refuse later calls."""
    rng = random.Random(seed)
    program = without_call_timeouts(make_program(1700 + seed, local=2))
    k = rng.randrange(len(program.ops) + 1)
    slow_worker = rng.randrange(WORKERS)
    slow = slow_worker * 2 + rng.randrange(2)
    timeout = 0.3
    strategy = make_strategy(2, sync_timeout=timeout)
    real = Real(program, strategy)

    async def hook(g: int) -> None:
        if g == slow:
            await anyio.sleep(4 * timeout)

    try:
        with anyio.fail_after(20):
            await strategy.run(real.step(0))
            outcome: tuple[Any, ...]
            try:
                await strategy.run(real.step(1, {k: hook}))
            except ReplicaSyncError as exc:
                outcome = ("ReplicaSyncError", exc.workers, exc.replicas)
            except BaseException as exc:
                outcome = ("other", repr(exc))
            else:
                outcome = ("returned",)
            refused = await assert_refused(strategy)
            everyone = allgather((outcome, bool(refused)))
            for w, (got, was_refused) in enumerate(everyone):
                assert was_refused, everyone
                assert got[0] == "ReplicaSyncError", everyone
                if w == slow_worker:
                    # its own replica's merge timeout, or the other worker's notice that it
                    # gave up waiting for this one (both timeouts are sync_timeout: a race)
                    assert got[1:] in [((), (slow,)), ((slow_worker,), ())], everyone
                else:
                    assert got[1] == (slow_worker,), everyone
            mine = [
                fingerprint(c)
                for v in real.mirrored
                for c in strategy.experimental_local_results(v)
            ]
            assert len({tuple(x) for x in allgather(mine)}) == 1
    except BaseException as exc:
        exc.add_note(f"reproduce: {program!r}, replica {slow} stalls before op {k}")
        raise


@pytest.mark.timeout(60)
@pytest.mark.parametrize("seed", range(4))
async def test_dataset_place_survives_a_checkpoint(make_strategy: Any, seed: int) -> None:
    """A distribute_dataset pass of ``batched`` global batches of a random size (uneven splits,
    a partial last one; only iterators over ``batched`` can be saved), stopped after a random
    number of steps of the random program, saved with a CheckpointManager in a shared
    directory with the program's variables; a fresh iterator
    restored from it hands out exactly the batches the first one did after the save, and the
    variables are back."""
    rng = random.Random(seed)
    local_replicas = rng.choice([1, 2])
    program = make_program(1900 + seed, local=local_replicas)
    strategy = make_strategy(local_replicas)
    real, model = Real(program, strategy), Model(program)
    n = program.n
    total, size = rng.randint(1, 6 * n + 3), rng.randint(1, 2 * n + 1)
    data = np.arange(total, dtype=np.int64).reshape(total, 1) * 5
    batches = [data[i : i + size] for i in range(0, total, size)]
    sizes = (total, size)
    prefetch = rng.randint(0, 2)
    stop = rng.randint(0, min(len(batches) - 1, len(program.ops)))

    async def rows_of(iterator: Any) -> list[list[Any]]:
        return [
            [np.asarray(x).ravel().tolist() for x in each_replica(strategy, element)]
            async for element in iterator
        ]

    try:
        with shared_directory() as directory, anyio.fail_after(30):
            dataset = strategy.distribute_dataset(batched(data, size), prefetch=prefetch)
            iterator = aiter(dataset)
            objects: dict[str, Any] = {f"m{j}": v for j, v in enumerate(real.mirrored)}
            manager = CheckpointManager(Checkpoint(data=iterator, **objects), directory)
            for r in range(stop):
                element = await iterator.get_next()
                result = await strategy.run(real.step(r))
                wanted = model.run(r)
                results = tuple(p[0] for p in each_replica(strategy, result))
                agreed(check_results, program, results, wanted)
                want = np.array_split(batches[r], n)

                def compare(element: Any = element, want: Any = want, r: int = r) -> None:
                    mine = each_replica(strategy, element)
                    for x, g in zip(mine, global_ids(local_replicas), strict=True):
                        same(np.asarray(x), want[g], f"batch {r} replica {g}")

                agreed(compare)
            saved = [
                np.array(c) for v in real.mirrored for c in strategy.experimental_local_results(v)
            ]
            path = await manager.save()
            assert allgather(path) == [path] * WORKERS
            expected = await rows_of(iterator)

            def left() -> None:
                assert len(expected) == len(batches) - stop, (len(expected), len(batches), stop)

            agreed(left)
            for var in real.mirrored:
                await var.assign(np.full(var.shape, 7, var.dtype))
            resumed = aiter(dataset)
            objects = {f"m{j}": v for j, v in enumerate(real.mirrored)}
            restarted = CheckpointManager(Checkpoint(data=resumed, **objects), directory)
            assert await restarted.restore_or_initialize() == path
            resumed_rows = await rows_of(resumed)
            back = [
                np.array(c) for v in real.mirrored for c in strategy.experimental_local_results(v)
            ]

            def compare_restored() -> None:
                assert resumed_rows == expected
                for a, b in zip(saved, back, strict=True):
                    same(b, a, "restored mirrored copy")

            agreed(compare_restored)
            assert_same_on_every_worker(*back)
    except BaseException as exc:
        exc.add_note(
            f"reproduce: {program!r}, (rows, batch size) {sizes}, prefetch {prefetch}, "
            f"saved after {stop}"
        )
        raise
