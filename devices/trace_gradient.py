"""Which package modules one gradient passes through, from ``apply_gradients`` to the copies.

Two host replicas each call ``await opt.apply_gradients([(grad, w)])`` once (SGD, a 3x2
float64 variable). A ``sys.setprofile`` hook, switched on by replica 0 just before its call
and off once the last replica's call has returned, records every Python function entered in
between; the script prints the distinct ``aioreplica`` modules among them, with the functions
entered in each, and writes JSON.

Nothing else runs on the loop meanwhile, so what it lists is the path of the gradient: the
replica-side checks, the merge round, the reduction and the commit.

    python devices/trace_gradient.py
    python devices/trace_gradient.py --json bench-results/trace_gradient.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np
from _benchlib import REPO_ROOT

if TYPE_CHECKING:
    from types import FrameType

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import aioreplica
from aioreplica.optimizers import SGD

REPLICAS = 2


def trace_one_step(backend: str) -> dict[str, list[str]]:
    """Run one apply_gradients on 2 replicas; return module -> functions entered."""
    strategy = aioreplica.MirroredStrategy([f"cpu:{i}" for i in range(REPLICAS)])
    with strategy.scope():
        w = aioreplica.Variable(np.zeros((3, 2)), name="w")
    opt = SGD(0.1)
    seen: dict[str, set[str]] = defaultdict(set)
    returned: list[int] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if module == "aioreplica" or module.startswith("aioreplica."):
            seen[module].add(frame.f_code.co_qualname)

    async def step() -> None:
        ctx = aioreplica.get_replica_context()
        assert ctx is not None
        grad = np.full((3, 2), float(ctx.replica_id_in_sync_group + 1))
        if ctx.replica_id_in_sync_group == 0:
            sys.setprofile(profile)
        await opt.apply_gradients([(grad, w)])
        returned.append(ctx.replica_id_in_sync_group)
        if len(returned) == REPLICAS:
            sys.setprofile(None)

    anyio.run(strategy.run, step, backend=backend)
    np.testing.assert_allclose(w.numpy(), np.full((3, 2), -0.3))
    return {module: sorted(functions) for module, functions in sorted(seen.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--json", type=Path, help="write the modules and functions here")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    for backend in ("asyncio", "trio"):
        modules = trace_one_step(backend)
        print(f"\n{backend}:\n{'module':<34} functions entered")
        for module, functions in modules.items():
            print(f"{module:<34} {', '.join(functions)}")
        print(f"{len(modules)} package modules on the path of one gradient ({backend})")
        results[backend] = {"modules": modules, "count": len(modules)}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
