"""How to move a handoff's KV between two replica processes: Ray's object store (what specdec does:
the decode replica calls the prefill replica's `pull`, whose numpy return travels through the
object store) or a direct TCP socket between the two processes. Same bytes, two Ray actors, one
machine; median of 5 after one warm-up.

    python docs/results/issue36/transport.py [MB]     # default 63 MB: a 1536-token prompt of the
                                                       # default pair, target + draft caches
"""

from __future__ import annotations

import socket
import statistics
import sys
import time

import numpy as np
import ray


@ray.remote(num_cpus=0.5)
class Holder:
    def __init__(self, nbytes: int) -> None:
        self.data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(1)

    def port(self) -> int:
        return self.server.getsockname()[1]

    def pull(self) -> np.ndarray:
        return self.data.copy()  # as export_kv: a copy of the leased blocks

    def serve_socket(self) -> int:
        conn, _ = self.server.accept()
        with conn:
            view = memoryview(self.data.copy())
            conn.sendall(len(view).to_bytes(8, "little"))
            conn.sendall(view)
        return len(view)


@ray.remote(num_cpus=0.5)
class Puller:
    def by_object_store(self, holder) -> float:
        started = time.perf_counter()
        data = ray.get(holder.pull.remote())
        copy = np.array(data)  # written into the pool: one copy
        assert copy.nbytes > 0
        return time.perf_counter() - started

    def by_socket(self, holder, port: int) -> float:
        started = time.perf_counter()
        done = holder.serve_socket.remote()
        with socket.create_connection(("127.0.0.1", port)) as conn:
            size = int.from_bytes(_recv(conn, 8), "little")
            buf = bytearray(size)
            view, got = memoryview(buf), 0
            while got < size:
                got += conn.recv_into(view[got:])
        ray.get(done)
        return time.perf_counter() - started


def _recv(conn: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        out += conn.recv(n - len(out))
    return out


def main() -> None:
    mb = float(sys.argv[1]) if len(sys.argv) > 1 else 63.0
    nbytes = int(mb * 1e6)
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=512 << 20, logging_level="ERROR")
    holder, puller = Holder.remote(nbytes), Puller.remote()
    port = ray.get(holder.port.remote())
    for name, call in (("object store", lambda: puller.by_object_store.remote(holder)),
                       ("socket", lambda: puller.by_socket.remote(holder, port))):
        ray.get(call())  # warm-up
        times = [ray.get(call()) for _ in range(5)]
        median = statistics.median(times)
        print(f"{name:>12}: {mb:.0f} MB in {median * 1000:.0f} ms median ({nbytes / median / 1e9:.2f} GB/s), "
              f"runs {', '.join(f'{t * 1000:.0f}' for t in times)} ms")
    ray.shutdown()


if __name__ == "__main__":
    main()
