"""Static-shape decode and verify steps, and CUDA graphs of them (`--cuda-graphs`).

A decode or verify forward (every window wants logits for every row: one row per sequence to
decode, k + 1 to verify) is padded up to a *bucket* of tokens (`TOKEN_BUCKETS`), so that each
bucket's forward has one shape: buffers allocated once per bucket and written in place each step
(two host-to-device copies, no sync), the number of sequences padded to the bucket too (a padded
sequence has no rows and no keys), padded rows writing their keys to a block of their own that
no sequence reads (`pad_slot`). On CUDA each bucket's forward is captured once as a CUDA graph and
replayed (vLLM V1 and SGLang capture the same way: by token count, attention metadata in static
buffers, the kernel's launch grid sized for the bucket and the rows past a sequence's window
exiting at once). On the CPU, or with graphs off, the same padded step runs eagerly: the
attention of backends that read host lengths (the torch reference) runs on the real rows under
the real metadata (`AttentionMetadata.real`), so the logits are bitwise the plain step's where
the linears are row-independent (tested).

Prefill chunks and cache fills (windows with rows that want no logits) run the plain path.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from specdec.cache import AttentionMetadata

# Tokens a bucketed forward holds: each decode / verify step runs in the smallest that fits
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def bucket_for(num_tokens: int) -> int | None:
    """The smallest bucket holding `num_tokens` rows; None past the largest."""
    return next((b for b in TOKEN_BUCKETS if b >= num_tokens), None)


@dataclass
class _Buffers:
    """One bucket's device tensors, written in place every step (their addresses are what a
    captured graph reads)."""

    longs: torch.Tensor  # [3, T]: input ids, positions, slot mapping
    ints: torch.Tensor  # [T * max_blocks + T + T + 1]: block tables, seq lens, query starts
    logits_indices: torch.Tensor  # [T] arange: every row's logits
    meta: AttentionMetadata  # over the views below, host lengths of the bucket's shape
    host_longs: torch.Tensor  # the staging copies (pinned on CUDA) the device buffers are copied from
    host_ints: torch.Tensor
    copied: object | None = None  # torch.cuda.Event of the latest copies: staging is reused after it
    graph: object | None = None  # torch.cuda.CUDAGraph once captured
    out: torch.Tensor | None = None  # the graph's logits [T, V]


class StaticSteps:
    """The bucketed steps of one runner: `run(windows)` returns logits `[T, V]` of a decode /
    verify step (None where the step does not fit a bucket: the caller runs the plain path).

    `capture`: record each bucket as a CUDA graph at its first use (CUDA only) and replay it;
    a bucket whose capture fails runs eagerly from then on, said once on stderr."""

    def __init__(self, runner, pad_block: int, capture: bool) -> None:
        self.runner = runner
        self.pad_block = pad_block  # a cache block outside the runner's pool: padded rows' keys
        self.capture = capture and runner.device.type == "cuda"
        self.max_blocks = -(-runner.max_positions // runner.block_size)
        self.buffers: dict[int, _Buffers] = {}
        self.steps = {"bucketed": 0, "replayed": 0, "plain": 0}  # what ran, for tests and the bench
        self._pool = None  # the graphs' shared memory pool

    @property
    def pad_slot(self) -> int:
        return self.pad_block * self.runner.block_size

    def fits(self, windows) -> int | None:
        """The bucket of a step whose every window wants logits for all its rows; else None."""
        if not windows or any(w.num_logits != len(w.token_ids) or not len(w.token_ids) for w in windows):
            return None
        return bucket_for(sum(len(w.token_ids) for w in windows))

    def run(self, windows) -> torch.Tensor | None:
        """Logits `[T, model vocab]` of `windows` through their bucket; None: use the plain step."""
        bucket = self.fits(windows)
        if bucket is None:
            self.steps["plain"] += 1
            return None
        buffers = self.buffers.get(bucket) or self._allocate(bucket)
        num_tokens = self._fill(buffers, windows, bucket)
        if self.capture and buffers.graph is None and buffers.out is None:
            self._capture(buffers, bucket)
        if buffers.graph is not None:
            buffers.graph.replay()
            self.steps["replayed"] += 1
            return buffers.out[:num_tokens]
        self.steps["bucketed"] += 1
        logits = self.runner.model(buffers.longs[0], buffers.longs[1], self.runner.kv_cache, buffers.meta,
                                   buffers.logits_indices)
        return logits[:num_tokens]

    def _allocate(self, bucket: int) -> _Buffers:
        device, mb = self.runner.device, self.max_blocks
        longs = torch.zeros(3, bucket, dtype=torch.long, device=device)
        ints = torch.zeros(bucket * mb + 2 * bucket + 1, dtype=torch.int32, device=device)
        tables = ints[: bucket * mb].view(bucket, mb)
        seq_lens = ints[bucket * mb : bucket * mb + bucket]
        starts = ints[bucket * mb + bucket :]
        # the bucket's host lengths: what a launch grid sized at capture sees (every sequence
        # slot, windows up to the whole bucket, keys up to the longest context)
        meta = AttentionMetadata(
            slot_mapping=longs[2], block_tables=tables, seq_lens=seq_lens, query_start_loc=starts,
            max_query_len=bucket, max_seq_len=mb * self.runner.block_size,
            seq_lens_cpu=[0] * bucket, query_lens_cpu=[0] * bucket, backend=self.runner.attention_backend,
        )
        pinned = device.type == "cuda"
        buffers = _Buffers(longs, ints, torch.arange(bucket, device=device), meta,
                           torch.zeros(longs.shape, dtype=torch.long, pin_memory=pinned),
                           torch.zeros(ints.shape, dtype=torch.int32, pin_memory=pinned))
        self.buffers[bucket] = buffers
        return buffers

    def _fill(self, buffers: _Buffers, windows, bucket: int) -> int:
        """Write the step's ids, positions, slots and metadata into the bucket's buffers (one copy
        for the longs, one for the ints; token ids already on the device copied there); the
        real-rows metadata goes to `meta.real`. Returns the step's real token count."""
        runner, mb, bs = self.runner, self.max_blocks, self.runner.block_size
        starts = [w.table.num_computed for w in windows]
        ends = [s + len(w.token_ids) for s, w in zip(starts, windows)]
        num_tokens = sum(e - s for s, e in zip(starts, ends))
        pad = bucket - num_tokens
        positions, slots, tables = [], [], []
        for w, start, end in zip(windows, starts, ends):
            assert end <= w.table.capacity, "window exceeds the table's allocated slots"
            assert start >= w.table.num_frozen_tokens, "a window would write into a cached block"
            positions.extend(range(start, end))
            slots += w.table.slot_mapping(start, end)
            used = w.table.block_ids[: -(-end // bs)]
            tables += used + [0] * (mb - len(used))
        num_seqs = len(windows)
        tables += [0] * (mb * (bucket - num_seqs))
        query_lens = [e - s for s, e in zip(starts, ends)]
        query_starts = [0]
        for q in query_lens:
            query_starts.append(query_starts[-1] + q)
        if buffers.copied is not None:
            buffers.copied.synchronize()  # the previous step's copies have left the staging buffers
        on_host = all(isinstance(w.token_ids, list) for w in windows)
        ids = [t for w in windows for t in w.token_ids] if on_host else []
        buffers.host_ints.copy_(torch.tensor(tables + ends + [0] * (bucket - num_seqs) + query_starts
                                             + [num_tokens] * (bucket - num_seqs), dtype=torch.int32))
        buffers.host_longs.copy_(torch.tensor([ids + [0] * (bucket - len(ids)), positions + [0] * pad,
                                               slots + [self.pad_slot] * pad], dtype=torch.long))
        buffers.ints.copy_(buffers.host_ints, non_blocking=True)
        buffers.longs.copy_(buffers.host_longs, non_blocking=True)
        if not on_host:  # draft tokens on the device: copied there, no sync
            buffers.longs[0, :num_tokens].copy_(runner._input_ids(windows))
        if runner.device.type == "cuda":
            buffers.copied = torch.cuda.Event()
            buffers.copied.record()
        if runner.output_vocab > runner.model_vocab and on_host:  # ids the model lacks read as 0 (`ModelRunner`)
            ids = buffers.longs[0]
            ids.copy_(torch.where(ids < runner.model_vocab, ids, torch.zeros_like(ids)))
        meta = buffers.meta
        meta.scratch.clear()
        meta.real = AttentionMetadata(
            slot_mapping=meta.slot_mapping[:num_tokens], block_tables=meta.block_tables[:num_seqs],
            seq_lens=meta.seq_lens[:num_seqs], query_start_loc=meta.query_start_loc[: num_seqs + 1],
            max_query_len=max(query_lens), max_seq_len=max(ends), seq_lens_cpu=ends, query_lens_cpu=query_lens,
            backend=meta.backend,
        )
        for w, end in zip(windows, ends):
            w.table.num_computed = end
        return num_tokens

    def _capture(self, buffers: _Buffers, bucket: int) -> None:
        """Record the bucket's forward as a CUDA graph (after a warm-up run on a side stream, as
        torch's capture wants); on failure the bucket stays eager, said once."""
        runner = self.runner
        forward = lambda: runner.model(buffers.longs[0], buffers.longs[1], runner.kv_cache, buffers.meta,  # noqa: E731
                                       buffers.logits_indices)
        try:
            stream = torch.cuda.Stream(device=runner.device)
            stream.wait_stream(torch.cuda.current_stream(runner.device))
            with torch.cuda.stream(stream):
                forward()  # warm-up: kernels compiled and autotuned outside the capture
            torch.cuda.current_stream(runner.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self._pool):
                out = forward()
            buffers.graph, buffers.out = graph, out
        except Exception as exc:  # noqa: BLE001 - any capture failure leaves the eager path
            buffers.out = torch.empty(0, device=runner.device)  # marks the bucket tried
            print(f"specdec: CUDA graph capture of a {bucket}-token step failed ({type(exc).__name__}: "
                  f"{str(exc).splitlines()[0] if str(exc) else ''}); that bucket runs eagerly", file=sys.stderr)
