"""Where a group's ranks 1..N-1 run: processes spawned on this machine (`spawn_local`) or Ray
actors in a placement group, on this machine or others (`spawn_ray`). Either way each is a
handle with a control connection (`conn`: multiprocessing's `Connection`, a pipe or an
authenticated socket) and its liveness, so `RankGroup` drives both alike.

On Ray the ranks go into the placement group this process runs in (a Serve replica deployed with
one bundle per rank: bundle 0 the replica's, bundle i rank i's) or, outside one, into a placement
group of their own, which the group removes when it ends. The actors are owned by this process:
if it dies, Ray ends them too.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import secrets
import threading
import time
from multiprocessing.connection import Client, Listener

from specdec.parallel.worker import RankSpec, main

PLACEMENT_TIMEOUT_S = 120.0  # Ray reserving the ranks' CPUs (more: the cluster lacks them)
PLACEMENTS = ("pack", "spread")


class LocalRank:
    """Rank `rank` as a spawned process on this machine, its control channel a pipe."""

    settle_s = 0.5  # how long a process that just ended may take to be seen ended

    def __init__(self, spec: RankSpec, rank: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=main, args=(spec, rank, child, "127.0.0.1"),
                                       name=f"specdec-rank{rank}", daemon=True)
        self.process.start()
        child.close()
        self.name = f"rank {rank} (pid {self.process.pid})"

    def alive(self) -> bool:
        return self.process.is_alive()

    def join(self, timeout_s: float) -> None:
        self.process.join(timeout_s)

    def kill(self) -> None:
        self.process.kill()

    def end(self) -> None:
        """After `stop`: nothing of it left running."""
        if self.process.is_alive():
            self.kill()
            self.join(5)

    def how_it_ended(self) -> str:
        return f"exited with code {self.process.exitcode}"


class RayRank:
    """Rank `rank` as a Ray actor; it connects back to the driver's listener (`_Listener`)."""

    settle_s = 3.0  # Ray learns of an actor's death from its node: later than a parent of its child
    def __init__(self, actor, ref, listener: "_Listener", rank: int) -> None:
        self.actor, self.ref, self.listener, self.rank = actor, ref, listener, rank
        self.name = f"rank {rank} (Ray actor {actor._actor_id.hex()[:12]})"

    @property
    def conn(self):
        return self.listener.conns.get(self.rank)

    def alive(self) -> bool:
        import ray

        return ray.is_initialized() and not ray.wait([self.ref], timeout=0)[0]

    def join(self, timeout_s: float) -> None:
        import ray

        if ray.is_initialized():  # (at exit Ray may be shut down first: its actors went with it)
            ray.wait([self.ref], timeout=timeout_s)

    def kill(self) -> None:
        import ray

        if ray.is_initialized():
            ray.kill(self.actor, no_restart=True)

    def end(self) -> None:
        """After `stop`: the actor (idle once its rank returned) killed, its CPUs free."""
        try:
            self.kill()
        except Exception:  # noqa: BLE001 - already gone, or Ray shut down
            pass

    def how_it_ended(self) -> str:
        import ray

        try:
            ray.get(self.ref, timeout=0)
            return "returned"
        except Exception as e:  # noqa: BLE001 - RayActorError and kin: their first line says why
            return "ended: " + (str(e).strip().splitlines() or [type(e).__name__])[0]


def spawn_local(spec: RankSpec) -> list[LocalRank]:
    ranks: list[LocalRank] = []
    try:
        for rank in range(1, spec.world):
            ranks.append(LocalRank(spec, rank))
    except BaseException:
        stop(ranks)
        raise
    return ranks


# ---- Ray ---------------------------------------------------------------------------------------

def ray_placement(world: int, cpus: float, strategy: str, timeout_s: float | None = None):
    """(placement group, first rank bundle, whether this process made it): the one this process
    runs in where it has a bundle per rank, else a new one of `world - 1` bundles of `cpus` CPUs."""
    import ray
    from ray.util.placement_group import get_current_placement_group, placement_group

    if not ray.is_initialized():  # RAY_ADDRESS names a cluster; without it Ray starts a local one
        ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False,
                 logging_level=logging.WARNING)
    current = get_current_placement_group()
    if current is not None and len(current.bundle_specs) >= world:
        return current, 1, False
    if strategy not in PLACEMENTS:
        raise ValueError(f"parallel placement must be one of {PLACEMENTS}, got {strategy!r}")
    timeout_s = PLACEMENT_TIMEOUT_S if timeout_s is None else timeout_s
    group = placement_group([{"CPU": cpus}] * (world - 1), strategy=strategy.upper())
    if not ray.wait([group.ready()], timeout=timeout_s)[0]:
        remove_placement(group)
        free = ray.available_resources().get("CPU", 0)
        raise RuntimeError(f"Ray could not place {world - 1} rank(s) of {cpus:g} CPU each within {timeout_s:g} s "
                           f"({free:g} CPUs free on the cluster)")
    return group, 0, True


def remove_placement(group) -> None:
    import ray

    if ray.is_initialized():
        ray.util.remove_placement_group(group)


def all_on_this_node(group, first: int, world: int) -> bool:
    """Whether every rank's bundle is on this process's node (then the all-reduce goes through memory)."""
    import ray
    from ray.util.placement_group import placement_group_table

    nodes = placement_group_table(group)["bundles_to_node_id"]
    here = ray.get_runtime_context().get_node_id()
    return all(nodes.get(first + i) == here for i in range(world - 1))


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


class _Listener:
    """The driver's socket the Ray ranks connect to (authenticated by a per-group key); each says
    its rank first."""

    def __init__(self, host: str, expected: int) -> None:
        self.key = secrets.token_bytes(32)
        self.listener = Listener((host, 0), family="AF_INET", authkey=self.key)
        self.address = self.listener.address
        self.conns: dict = {}
        self.expected = expected
        threading.Thread(target=self._accept, name="specdec-rank-listener", daemon=True).start()

    def _accept(self) -> None:
        while len(self.conns) < self.expected:
            try:
                conn = self.listener.accept()
                self.conns[int(conn.recv())] = conn
            except Exception:  # noqa: BLE001 - closed, or a stranger without the key (AuthenticationError)
                if self.listener._listener is None:
                    return
        self.close()

    def close(self) -> None:
        try:
            self.listener.close()
        except OSError:
            pass


def _run_rank(spec: RankSpec, rank: int, address, key: bytes) -> None:
    """The body of a rank's actor: connect to the driver, then be the rank until told to stop."""
    conn = Client(address, family="AF_INET", authkey=key)
    conn.send(rank)
    main(spec, rank, conn, node_ip())


def spawn_ray(spec: RankSpec, group, first: int, driver_ip: str) -> tuple[list[RayRank], _Listener]:
    import ray
    from ray.util.placement_group import placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundles = placement_group_table(group)["bundles"]
    listener = _Listener(driver_ip, spec.world - 1)
    actor_class = ray.remote(_RankActor)
    ranks: list[RayRank] = []
    try:
        for rank in range(1, spec.world):
            index = first + rank - 1
            actor = actor_class.options(
                num_cpus=bundles[index].get("CPU", 0), name=None, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
                runtime_env={"env_vars": {"OMP_NUM_THREADS": str(spec.threads)}},
            ).remote()
            ranks.append(RayRank(actor, actor.run.remote(spec, rank, listener.address, listener.key), listener, rank))
    except BaseException:
        stop(ranks)
        listener.close()
        raise
    return ranks, listener


class _RankActor:
    def run(self, spec: RankSpec, rank: int, address, key: bytes) -> None:
        _run_rank(spec, rank, address, key)


def wait_connected(ranks, timeout_s: float) -> str | None:
    """Wait until every rank has its control connection; what went wrong, or None."""
    deadline = time.monotonic() + timeout_s
    for handle in ranks:
        while handle.conn is None:
            if not handle.alive():
                return f"{handle.name} {handle.how_it_ended()} before it connected"
            if time.monotonic() > deadline:
                return f"{handle.name} did not connect within {timeout_s:g} s"
            time.sleep(0.05)
    return None


def stop(ranks) -> None:
    """Tell each rank to stop; end those that do not within 5 s."""
    for handle in ranks:
        try:
            if handle.conn is not None:
                handle.conn.send(("stop",))
        except (OSError, ValueError):
            pass
    for handle in ranks:
        handle.join(5)
        handle.end()
    for handle in ranks:
        if handle.conn is not None:
            handle.conn.close()
