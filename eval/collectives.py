"""What one collective costs between two ranks on this machine: gloo's all-reduce, broadcast and
send/recv round trip (torch.distributed) against the shared-memory all-reduce the tensor-parallel
target uses (`specdec.parallel.comm`), for 1, 6 and 64 rows of a hidden vector. One process per
rank, one thread each; nothing else should run meanwhile.

    python -m specdec.eval.collectives [--hidden 1536] [--iters 300]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from datetime import timedelta


def _rank(rank: int, world: int, port: int, shm: str, hidden: int, iters: int, out) -> None:
    import torch

    from specdec.parallel.comm import Comm, ShmRegion, process_group

    torch.set_num_threads(1)
    pg = process_group("127.0.0.1", port, rank, world, 60.0)
    comm = Comm(rank, world, pg, ShmRegion(shm, world), 60.0)
    rows_list = (1, 6, 64)
    results = {}

    def timed(name, fn):
        for _ in range(20):
            fn()
        samples = []
        for _ in range(5):
            comm.wait(pg.barrier())
            t = time.perf_counter()
            for _ in range(iters // 5):
                fn()
            samples.append((time.perf_counter() - t) / (iters // 5) * 1e6)
        results[name] = round(statistics.median(samples), 1)

    for rows in rows_list:
        x = torch.ones(rows * hidden)
        timed(f"shm all-reduce, {rows} row(s)", lambda: comm.all_reduce_(x))
        timed(f"gloo all-reduce, {rows} row(s)", lambda: comm.wait(pg.allreduce([x])))
    x = torch.ones(hidden)
    timed("gloo broadcast, 1 row", lambda: comm.wait(pg.broadcast(x, 0)))
    timed("gloo send/recv round trip, 1 row",
          lambda: (comm.send(x, 1), comm.recv(x, 1)) if rank == 0 else (comm.recv(x, 0), comm.send(x, 0)))
    if rank == 0:
        out.send(results)


def main(argv: list[str] | None = None) -> dict:
    import torch.distributed as dist

    from specdec.parallel.comm import ShmRegion, shm_path

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1536, help="floats a row (default: the default target's)")
    p.add_argument("--iters", type=int, default=300)
    args = p.parse_args(argv)
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=60), wait_for_workers=False)
    path = shm_path()
    ShmRegion(path, 2, create=True)
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    procs = [ctx.Process(target=_rank, args=(r, 2, store.port, path, args.hidden, args.iters, child)) for r in (0, 1)]
    for proc in procs:
        proc.start()
    results = parent.recv()
    for proc in procs:
        proc.join()
    import os

    os.unlink(path)
    width = max(map(len, results))
    for name, us in results.items():
        print(f"{name:<{width}}  {us:>8.1f} us")
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
