"""The driver's side of a parallel target: `RankGroup` spawns ranks 1..N-1 on this machine and
runs each step over them; `ParallelRunner` is the target's `ModelRunner` whose forward does so.

    group = RankGroup.start(config, model_dir)      # ranks load while the driver loads its part
    group.shard(model)                               # the driver (rank 0) keeps its part
    runner = ParallelRunner(model, cache, vocab, backend, group)   # joins, sizes the ranks' caches

A step: the driver sends its tensors (as host lists) to every rank over a pipe, then runs its own
part; the ranks meet in the all-reduces (tensor) or pass the hidden states on (pipeline). A rank
that dies, hangs past `timeout_s` or fails ends the group: the step raises `RankFailure` naming
it, and so does every later one.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import weakref
from contextlib import contextmanager
from datetime import timedelta

import torch

from specdec.cache import PagedKVCache
from specdec.parallel import shard
from specdec.parallel.comm import Comm, RankFailure, ShmRegion, process_group, shm_path
from specdec.parallel.worker import RankSpec, main, step_to_wire
from specdec.target.runner import ModelRunner, Step

LOAD_TIMEOUT_S = 3600.0  # a rank's first load may quantize a large model


class RankGroup:
    """Ranks 1..N-1 of a tensor- or pipeline-parallel target, as local processes."""

    def __init__(self, spec: RankSpec, store, region: ShmRegion | None) -> None:
        self.spec, self.store, self.region = spec, store, region
        self.mode, self.world = spec.mode, spec.world
        self.comm = Comm(0, spec.world, None, region, spec.timeout_s)
        self.comm.describe_failure = self.describe_failure
        self.processes: list[multiprocessing.Process] = []
        self.conns = []
        self.infos: list[dict] = []
        self.failed: str | None = None
        self.threads = spec.threads
        self._finalizer = weakref.finalize(self, _stop, self.processes, self.conns, spec.shm)

    @classmethod
    def start(cls, model_dir: str, dtype: str, quant: str, tensor: int, pipeline: int,
              timeout_s: float = 60.0, threads: int | None = None) -> "RankGroup":
        """Spawn the ranks; they start loading at once (`shard` and `join` follow on the driver)."""
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
        store = dist.TCPStore("127.0.0.1", 0, world, True, timedelta(seconds=timeout_s), wait_for_workers=False)
        path = shm_path() if mode == "tensor" else None
        region = ShmRegion(path, world, create=True) if path else None
        spec = RankSpec(str(model_dir), dtype, quant, mode, world, per_rank, timeout_s, "127.0.0.1", store.port, path)
        group = cls(spec, store, region)
        context = multiprocessing.get_context("spawn")
        try:
            for rank in range(1, world):
                parent, child = context.Pipe()
                process = context.Process(target=main, args=(spec, rank, child), name=f"specdec-rank{rank}",
                                          daemon=True)
                process.start()
                child.close()
                group.processes.append(process)
                group.conns.append(parent)
        except BaseException:
            group.close()
            raise
        return group

    # ---- set-up --------------------------------------------------------------------------------

    def shard(self, model) -> None:
        """Keep rank 0's part of `model` (the driver's)."""
        if self.mode == "tensor":
            shard.tensor_parallel(model, 0, self.world, self.comm)
        else:
            shard.pipeline_stage(model, 0, self.world)

    def join(self) -> None:
        """Wait until every rank loaded its part, then form the gloo group."""
        self.infos = [self._expect(i, "loaded", LOAD_TIMEOUT_S) for i in range(len(self.conns))]
        self.comm.pg = process_group("127.0.0.1", self.spec.port, 0, self.world, self.spec.timeout_s, self.store)
        if self.spec.shm:  # every rank has it mapped: the name can go (the memory stays until the last unmaps)
            os.unlink(self.spec.shm)

    def build_caches(self, num_blocks: int, block_size: int, kv_dtype: str, backend: str) -> None:
        for conn in self.conns:
            conn.send(("cache", num_blocks, block_size, kv_dtype, backend))
        for i in range(len(self.conns)):
            self.infos[i].update(self._expect(i, "ready", LOAD_TIMEOUT_S))

    def _expect(self, i: int, what: str, timeout_s: float) -> dict:
        conn, process = self.conns[i], self.processes[i]
        deadline = time.monotonic() + timeout_s
        while not conn.poll(0.2):
            if not process.is_alive():
                break
            if time.monotonic() > deadline:
                self._fail(f"rank {i + 1} did not report '{what}' within {timeout_s:g} s")
        try:
            message = conn.recv()
        except (EOFError, OSError):
            process.join(5)
            self._fail(f"rank {i + 1} (pid {process.pid}) exited with code {process.exitcode} before '{what}'")
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
            for conn in self.conns:
                conn.send(("step", wire))
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
        for i, (process, conn) in enumerate(zip(self.processes, self.conns)):
            process.join(0.5)  # one the C side saw go may still be exiting
            if process.is_alive():
                continue
            note = f"rank {i + 1} (pid {process.pid}) exited with code {process.exitcode}"
            try:
                if conn.poll(0.5) and (message := conn.recv())[0] == "error":
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


def _stop(processes, conns, shm: str | None) -> None:
    for conn in conns:
        try:
            conn.send(("stop",))
        except (OSError, ValueError):
            pass
    for process in processes:
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join(5)
    for conn in conns:
        conn.close()
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
