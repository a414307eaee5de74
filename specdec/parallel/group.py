"""The driver's side of a parallel target: `RankGroup` starts ranks 1..N-1 (processes on this
machine, or Ray actors on a cluster: `launch.py`) and runs each step over them; `ParallelRunner`
is the target's `ModelRunner` whose forward does so.

    group = RankGroup.start(config, model_dir)      # ranks load while the driver loads its part
    model = load_model(..., part=group.load_part())  # the driver (rank 0) reads its part only
    group.shard(model)                               # and finishes it (the LM head's vocabulary)
    runner = ParallelRunner(model, cache, vocab, backend, group)   # joins, sizes the ranks' caches

A step: the driver sends its tensors (as host lists) to every rank over its control connection, then runs its own
part; the ranks meet in the all-reduces (tensor) or pass the hidden states on (pipeline). A rank
that dies, hangs past `timeout_s` or fails ends the group: the step raises `RankFailure` naming
it, and so does every later one.
"""

from __future__ import annotations

import os
import time
import weakref
from contextlib import contextmanager
from datetime import timedelta

import torch

from specdec.cache import PagedKVCache
from specdec.parallel import launch, shard
from specdec.parallel.comm import Comm, RankFailure, ShmRegion, process_group, shm_path
from specdec.parallel.worker import RankSpec, step_to_wire
from specdec.target.runner import ModelRunner, Step

LOAD_TIMEOUT_S = 3600.0  # a rank's first load may quantize a large model


class RankGroup:
    """Ranks 1..N-1 of a tensor- or pipeline-parallel target: local processes (`ranks="local"`)
    or Ray actors (`"ray"`)."""

    def __init__(self, spec: RankSpec, store, region: ShmRegion | None, bind: str) -> None:
        self.spec, self.store, self.region, self.bind = spec, store, region, bind
        self.mode, self.world = spec.mode, spec.world
        self.comm = Comm(0, spec.world, None, region, spec.timeout_s)
        self.comm.describe_failure = self.describe_failure
        self.ranks: list = []  # launch.LocalRank / launch.RayRank, rank i+1 at i
        self.infos: list[dict] = []
        self.failed: str | None = None
        self.threads = spec.threads
        self._owned: list = []  # what ends with the group: a Ray listener, a placement group it made
        self._finalizer = weakref.finalize(self, _stop, self.ranks, spec.shm, self._owned)

    @classmethod
    def start(cls, model_dir: str, dtype: str, quant: str, tensor: int, pipeline: int,
              timeout_s: float = 60.0, threads: int | None = None, ranks: str = "local",
              placement: str = "pack", exact: bool = True) -> "RankGroup":
        """Start the ranks; they begin loading at once (`shard` and `join` follow on the driver).
        `ranks`: "local" (spawned processes) or "ray" (actors in a placement group, `placement`
        "pack" or "spread" where the group makes its own). `exact`: tensor parallel split so
        that every value is one process's (`shard.tensor_parallel`)."""
        import torch.distributed as dist

        if tensor > 1 and pipeline > 1:
            raise shard.ParallelConfigError("tensor and pipeline parallelism together are not supported yet: "
                                            "choose one")
        mode, world = ("tensor", tensor) if tensor > 1 else ("pipeline", pipeline)
        from specdec.target.model_weights import load_config

        config = load_config(model_dir)
        if mode == "tensor":  # refused before any process starts
            shard.check_tensor_parallel(config, world)
        elif config.num_layers < world:
            raise shard.ParallelConfigError(f"{config.num_layers} layers cannot fill {world} pipeline stages")
        cores = threads or torch.get_num_threads()
        # tensor ranks run at once: the cores split between them; pipeline stages take turns
        per_rank = max(1, cores // world) if mode == "tensor" else cores
        if ranks not in ("local", "ray"):
            raise ValueError(f"ranks must be 'local' or 'ray', got {ranks!r}")
        host, local_memory, placed = "127.0.0.1", True, None
        if ranks == "ray":
            placed = launch.ray_placement(world, per_rank, placement)
        try:
            if placed is not None:
                host = launch.node_ip()
                local_memory = launch.all_on_this_node(placed[0], placed[1], world)
            store = dist.TCPStore(host, 0, world, True, timedelta(seconds=timeout_s), wait_for_workers=False)
            # the all-reduce through memory where every rank is on this machine (SPECDEC_PARALLEL_SHM=0: gloo's)
            shared = mode == "tensor" and local_memory and os.environ.get("SPECDEC_PARALLEL_SHM", "1") != "0"
            path = shm_path() if shared else None
            region = ShmRegion(path, world, create=True) if path else None
        except BaseException:
            if placed is not None and placed[2]:  # a placement group made for ranks that never started
                launch.remove_placement(placed[0])
            raise
        spec = RankSpec(str(model_dir), dtype, quant, mode, world, per_rank, timeout_s, host, store.port, path, exact)
        group = cls(spec, store, region, host)
        group.config = config
        try:
            if placed is None:
                group.ranks.extend(launch.spawn_local(spec))
            else:
                pg, first, made = placed
                if made:
                    group._owned.append(pg)
                handles, listener = launch.spawn_ray(spec, pg, first, host)
                group._owned.append(listener)
                group.ranks.extend(handles)
        except BaseException:
            group.close()
            raise
        return group

    # ---- set-up --------------------------------------------------------------------------------

    def load_part(self):
        """What the driver (rank 0) loads of the target (`model_weights.LoadPart`); `shard` then
        finishes its part."""
        return shard.load_part(self.mode, self.config, 0, self.world, self.comm, self.spec.exact)

    def shard(self, model) -> None:
        """Keep rank 0's part of `model` (the driver's)."""
        if self.mode == "tensor":
            shard.tensor_parallel(model, 0, self.world, self.comm, self.spec.exact)
        else:
            shard.pipeline_stage(model, 0, self.world)

    def join(self) -> None:
        """Wait until every rank loaded its part, then form the gloo group."""
        if (why := launch.wait_connected(self.ranks, LOAD_TIMEOUT_S)) is not None:
            self._fail(f"{self.mode}-parallel group of {self.world}: {why}")
        self.infos = [self._expect(i, "loaded", LOAD_TIMEOUT_S) for i in range(len(self.ranks))]
        self.comm.pg = process_group(self.bind, self.spec.port, 0, self.world, self.spec.timeout_s, self.store,
                                     bind=self.bind)
        if self.spec.shm:  # every rank has it mapped: the name can go (the memory stays until the last unmaps)
            os.unlink(self.spec.shm)

    def build_caches(self, num_blocks: int, block_size: int, kv_dtype: str, backend: str) -> None:
        for handle in self.ranks:
            handle.conn.send(("cache", num_blocks, block_size, kv_dtype, backend))
        for i in range(len(self.ranks)):
            self.infos[i].update(self._expect(i, "ready", LOAD_TIMEOUT_S))

    def _expect(self, i: int, what: str, timeout_s: float) -> dict:
        handle = self.ranks[i]
        conn = handle.conn
        deadline = time.monotonic() + timeout_s
        while not conn.poll(0.2):
            if not handle.alive():
                break
            if time.monotonic() > deadline:
                self._fail(f"{handle.name} did not report '{what}' within {timeout_s:g} s")
        try:
            message = conn.recv()
        except (EOFError, OSError):
            handle.join(5)
            self._fail(f"{handle.name} {handle.how_it_ended()} before '{what}'")
        if message[0] == "error":
            self._fail(message[1].strip())
        assert message[0] == what, message
        return message[1]

    # ---- steps ---------------------------------------------------------------------------------

    @contextmanager
    def _threads(self):
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    @torch.inference_mode()
    def run_step(self, model, kv_cache: PagedKVCache, step: Step) -> torch.Tensor:
        """Logits `[R, V]` of one step over every rank."""
        if self.failed:
            raise RankFailure(self.failed)
        wire = step_to_wire(step)
        try:
            for handle in self.ranks:
                handle.conn.send(("step", wire))
        except (BrokenPipeError, OSError) as e:
            self._fail(self.describe_failure(f"a rank could not be sent the step ({e})"))
        try:
            with self._threads():
                if self.mode == "tensor":
                    return model(step.input_ids, step.positions, kv_cache, step.meta, step.logits_indices)
                return self._pipeline_step(model, kv_cache, step)
        except RankFailure as e:
            self.failed = str(e)
            raise

    def _pipeline_step(self, model, kv_cache: PagedKVCache, step: Step) -> torch.Tensor:
        h = model.run_layers(model.embed(step.input_ids), step.positions, kv_cache, step.meta)
        self.comm.send(h, 1)
        rows = len(step.logits_indices)
        if rows == 0:
            return h.new_empty(0, model.config.vocab_size, dtype=torch.float32)
        last = self.comm.recv(torch.empty(rows, h.shape[1], dtype=h.dtype), self.world - 1)
        return model.head(last)

    # ---- faults and the end ----------------------------------------------------------------------

    def describe_failure(self, what: str) -> str:
        """`what`, with each rank that is gone and what it reported."""
        parts = [f"{self.mode}-parallel group of {self.world}: {what}"]
        for handle in self.ranks:
            handle.join(handle.settle_s)  # one the C side saw go may still be exiting
            if handle.alive():
                continue
            note = f"{handle.name} {handle.how_it_ended()}"
            conn = handle.conn
            try:
                if conn is not None and conn.poll(0.5) and (message := conn.recv())[0] == "error":
                    note += ": " + message[1].strip().splitlines()[-1]
            except (EOFError, OSError):
                pass
            parts.append(note)
        return "; ".join(parts)

    def _fail(self, message: str):
        self.failed = message
        raise RankFailure(message)

    def rank_memory(self) -> list[dict]:
        """Per rank 1..N-1: its weights' and its cache's bytes."""
        return [dict(info) for info in self.infos]

    def close(self) -> None:
        """Stop the ranks (each finishes nothing: a step in flight is abandoned) and free the region."""
        self._finalizer()


def _stop(ranks, shm: str | None, owned: list) -> None:
    launch.stop(ranks)
    for thing in owned:
        if isinstance(thing, launch._Listener):
            thing.close()
        else:  # the placement group the ranks were placed in, made for them
            launch.remove_placement(thing)
    if shm and os.path.exists(shm):
        os.unlink(shm)


class ParallelRunner(ModelRunner):
    """The target's runner when its layers are split over a `RankGroup` (rank 0 here)."""

    def __init__(self, model, kv_cache: PagedKVCache, output_vocab: int | None, attention_backend: str,
                 group: RankGroup, kv_dtype: str) -> None:
        super().__init__(model, kv_cache, output_vocab, attention_backend)
        self.group = group
        group.join()
        group.build_caches(kv_cache.num_blocks, kv_cache.spec.block_size, kv_dtype, attention_backend)

    def run_step(self, step: Step) -> torch.Tensor:
        return self.group.run_step(self.model, self.kv_cache, step)

    def close(self) -> None:
        self.group.close()
