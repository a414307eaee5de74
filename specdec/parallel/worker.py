"""A rank's process (ranks 1..N-1; the driver is rank 0): load the target, keep this rank's part,
build its paged cache when the driver says how big, then run every step the driver sends until
it says stop or goes away. Any failure is sent to the driver and ends the process."""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass

import torch

from specdec.cache import AttentionMetadata
from specdec.target.runner import Step


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to load and join its group (picklable: it crosses to a spawned process)."""

    model_dir: str
    dtype: str
    quant: str
    mode: str  # "tensor" or "pipeline"
    world: int
    threads: int
    timeout_s: float
    host: str
    port: int
    shm: str | None
    exact: bool = True  # tensor parallel: o_proj and down_proj split exactly (`shard.ColumnParallelLinear`)


def step_to_wire(step: Step) -> dict:
    """A step's tensors as host lists (what crosses the pipe)."""
    meta = step.meta
    return {
        "input_ids": step.input_ids.tolist(), "positions": step.positions.tolist(),
        "logits_indices": step.logits_indices.tolist(), "slot_mapping": meta.slot_mapping.tolist(),
        "block_tables": meta.block_tables.tolist(), "seq_lens": meta.seq_lens_cpu,
        "query_start_loc": meta.query_start_loc.tolist(), "max_query_len": meta.max_query_len,
        "max_seq_len": meta.max_seq_len, "query_lens": meta.query_lens_cpu, "backend": meta.backend,
    }


def step_from_wire(wire: dict) -> Step:
    as_tensor = lambda xs, dtype=torch.long: torch.tensor(xs, dtype=dtype)  # noqa: E731
    tables = as_tensor(wire["block_tables"], torch.int32).view(len(wire["seq_lens"]), -1)
    meta = AttentionMetadata(
        as_tensor(wire["slot_mapping"]), tables, as_tensor(wire["seq_lens"], torch.int32),
        as_tensor(wire["query_start_loc"], torch.int32), wire["max_query_len"], wire["max_seq_len"],
        list(wire["seq_lens"]), list(wire["query_lens"]), wire["backend"],
    )
    return Step(as_tensor(wire["input_ids"]), as_tensor(wire["positions"]), meta, as_tensor(wire["logits_indices"]), [])


def main(spec: RankSpec, rank: int, conn, bind: str) -> None:
    """Be rank `rank` (its gloo device on address `bind`) until told to stop."""
    try:
        Rank(spec, rank, conn, bind).serve()
    except (EOFError, BrokenPipeError, KeyboardInterrupt, SystemExit):  # the driver is gone, or Ray ends us
        os._exit(0)
    except BaseException:
        try:
            conn.send(("error", f"rank {rank}: {traceback.format_exc()}"))
        except (OSError, ValueError):
            pass
        sys.stderr.write(traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)


class Rank:
    def __init__(self, spec: RankSpec, rank: int, conn, bind: str) -> None:
        from specdec.parallel import shard
        from specdec.parallel.comm import Comm, ShmRegion
        from specdec.target.model_weights import load_config, load_model, parse_dtype

        torch.set_num_threads(spec.threads)
        self.spec, self.rank, self.conn, self.bind = spec, rank, conn, bind
        region = ShmRegion(spec.shm, spec.world) if spec.shm else None
        self.comm = Comm(rank, spec.world, None, region, spec.timeout_s)
        part = shard.load_part(spec.mode, load_config(spec.model_dir), rank, spec.world, self.comm, spec.exact)
        model = load_model(spec.model_dir, parse_dtype(spec.dtype), "cpu", spec.quant, part)
        if spec.mode == "tensor":
            shard.tensor_parallel(model, rank, spec.world, self.comm, spec.exact)
            layers = (0, len(model.model.layers))
        else:
            layers = shard.pipeline_stage(model, rank, spec.world)
        self.model = model
        weights = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in model.parameters()}.values())
        weights += sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in model.buffers()}.values())
        conn.send(("loaded", {"weights": weights, "layers": layers, "pid": os.getpid(), "address": bind}))

    def serve(self) -> None:
        from specdec.cache import PagedKVCache
        from specdec.parallel.comm import process_group
        from specdec.target.runner import ModelRunner

        spec = self.spec
        self.comm.pg = process_group(spec.host, spec.port, self.rank, spec.world, spec.timeout_s, bind=self.bind)
        what, num_blocks, block_size, kv_dtype, backend = self.conn.recv()
        assert what == "cache", what
        dtype = torch.float8_e4m3fn if kv_dtype == "fp8" else None
        cache = PagedKVCache(ModelRunner.kv_spec(self.model, block_size, dtype), num_blocks)
        self.runner = ModelRunner(self.model, cache, attention_backend=backend)
        self.conn.send(("ready", {"kv": cache.kv.numel() * cache.kv.element_size()}))
        while True:
            message = self.conn.recv()
            if message[0] == "stop":
                return
            self.step(*message[1:])

    @torch.inference_mode()
    def step(self, wire: dict) -> None:
        step = step_from_wire(wire)
        model, cache = self.model, self.runner.kv_cache
        if self.spec.mode == "tensor":
            model(step.input_ids, step.positions, cache, step.meta, step.logits_indices)
            return
        stage, last = self.rank, self.spec.world - 1
        dtype = model.model.norm.weight.dtype
        h = self.comm.recv(torch.empty(len(step.input_ids), model.config.hidden_size, dtype=dtype), stage - 1)
        h = model.run_layers(h, step.positions, cache, step.meta)
        if stage != last:
            self.comm.send(h, stage + 1)
        elif len(step.logits_indices):
            self.comm.send(h[step.logits_indices].contiguous(), 0)
