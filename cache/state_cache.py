"""Recurrent state of linear-attention layers (Gated DeltaNet): a fixed-size state per sequence,
kept as of the last few positions so that speculation can roll back (issue 61).

A linear-attention layer carries, per sequence, a short-convolution state `[C, K-1]` (the last
K-1 inputs of its causal convolution) and a recurrent state `[H, Dk, Dv]`. Unlike paged KV they
cannot be truncated: the state after position p is a function of every token up to p. So each
slot keeps a ring of `depth` checkpoints, the states after each of the last positions a forward
wrote (`positions[slot][j]`: the sequence length after which ring entry j holds the state; -1:
none). A forward over a window `start..end` reads the state as of `start` (the table's
`num_computed`, whatever rollback left: accepting j drafts of a verify window keeps the state
after row j) and writes the states after each of its last `depth` rows. Rolling back is then
nothing but lowering `num_computed`, as for paged KV: the next forward starts from the
checkpoint at that length. A length no checkpoint holds (rolled back past the ring) is an error,
never a silent wrong state.

Slots are handed to block tables (`BlockTable.state_slot`) on their first forward and come back
when the table is freed (`StatePool`); the cache knows nothing of requests.

>>> cache = RecurrentStateCache(StateSpec(1, 4, 2, 1, 2, 2), num_slots=2, depth=3)
>>> slot = cache.pool.allocate()
>>> batch = cache.batch([slot], [0], [5])   # an empty sequence fed 5 tokens: starts from zeros
>>> batch.rows_kept(0)                      # the states after its last 3 rows are kept
3
>>> batch.commit(); cache.positions[slot]
[3, 4, 5]
>>> cache.batch([slot], [4], [6]).writes    # rolled back to 4 (its entry kept); 5, 6 written
[[(2, 5), (0, 6)]]
>>> cache.batch([slot], [1], [2])
Traceback (most recent call last):
...
RuntimeError: the recurrent state as of 1 tokens is not kept (checkpoints of lengths [4])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class NoFreeStatesError(RuntimeError):
    pass


class StatePool:
    """Free list of state slots (one per running sequence)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise NoFreeStatesError(f"all {self.num_slots} recurrent-state slots are in use")
        return self._free.pop()

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"state slot {slot} is not allocated")
        self._free.append(slot)


@dataclass(frozen=True)
class StateSpec:
    """The shapes of one model's linear-attention states."""

    num_layers: int  # linear-attention layers
    conv_dim: int  # channels of the short convolution (q, k and v together)
    conv_width: int  # kernel size - 1: the inputs a convolution state keeps
    num_heads: int  # value heads of the recurrence
    key_dim: int
    value_dim: int
    dtype: torch.dtype = torch.float32
    device: torch.device | str = "cpu"

    @property
    def slot_bytes(self) -> int:
        """The bytes of one checkpoint of one sequence (every layer's two states)."""
        size = torch.tensor([], dtype=self.dtype).element_size()
        per_layer = self.conv_dim * self.conv_width + self.num_heads * self.key_dim * self.value_dim
        return self.num_layers * per_layer * size


class RecurrentStateCache:
    """`conv [slots, depth, L, C, K-1]` and `ssm [slots, depth, L, H, Dk, Dv]`: each slot's ring of
    checkpoints; `positions[slot][j]` the length after which ring entry j holds the state."""

    def __init__(self, spec: StateSpec, num_slots: int, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.spec, self.depth = spec, depth
        self.pool = StatePool(num_slots)
        s = spec
        self.conv = torch.zeros(num_slots, depth, s.num_layers, s.conv_dim, s.conv_width, dtype=s.dtype, device=s.device)
        self.ssm = torch.zeros(num_slots, depth, s.num_layers, s.num_heads, s.key_dim, s.value_dim,
                               dtype=s.dtype, device=s.device)
        self.positions: list[list[int]] = [[-1] * depth for _ in range(num_slots)]

    @property
    def memory_bytes(self) -> int:
        return (self.conv.numel() + self.ssm.numel()) * self.conv.element_size()

    def batch(self, slots: list[int], starts: list[int], ends: list[int]) -> "StateBatch":
        """One forward's windows (slot b's sequence fed from length `starts[b]` to `ends[b]`): the
        checkpoint each starts from, the ring entries it writes. The entries to be written are
        marked empty at once, so a forward that fails half-way leaves no entry claiming a state
        it does not hold."""
        reads, writes = [], []
        for slot, start, end in zip(slots, starts, ends):
            ring = self.positions[slot]
            if start == 0:
                read = None
            elif start in ring:
                read = ring.index(start)
            else:
                kept = sorted(p for p in ring if p >= 0)
                raise RuntimeError(f"the recurrent state as of {start} tokens is not kept (checkpoints of lengths {kept})")
            lengths = list(range(max(start + 1, end - self.depth + 1), end + 1))
            # stale entries (empty, or of rolled-back lengths) first, then the oldest; the start's last
            order = sorted((j for j in range(self.depth) if j != read),
                           key=lambda j: (0 if ring[j] < 0 or ring[j] > start else 1, ring[j]))
            order += [] if read is None else [read]
            entries = list(zip(order[: len(lengths)], lengths))
            for j, p in enumerate(ring):
                if p > start or any(j == e for e, _ in entries):
                    ring[j] = -1
            reads.append(read)
            writes.append(entries)
        return StateBatch(self, slots, reads, writes)

    def release(self, slot: int) -> None:
        self.positions[slot] = [-1] * self.depth
        self.pool.free(slot)


class StateBatch:
    """The states of one forward's windows; a layer `read`s window b's start state and `write`s
    the states after its rows, and the runner `commit`s after the last layer."""

    def __init__(self, cache: RecurrentStateCache, slots: list[int], reads: list[int | None],
                 writes: list[list[tuple[int, int]]]) -> None:
        self.cache, self.slots, self.reads, self.writes = cache, slots, reads, writes

    def read(self, b: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Window b's layer states as of its start: `[C, K-1]`, `[H, Dk, Dv]` (copies; zeros for
        an empty sequence)."""
        c, j = self.cache, self.reads[b]
        if j is None:
            return torch.zeros_like(c.conv[0, 0, layer]), torch.zeros_like(c.ssm[0, 0, layer])
        return c.conv[self.slots[b], j, layer].clone(), c.ssm[self.slots[b], j, layer].clone()

    def entries(self, b: int, layer: int) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, list[torch.Tensor], list[torch.Tensor]]:
        """Window b's layer states in place, for a kernel that reads and writes them by pointer: the
        start's `([C, K-1], [H, Dk, Dv])` (None: zeros) and the ring entries `rows_kept(b)` rows
        write, conv and ssm (one of them may be the start's: read it before writing)."""
        c, slot, j = self.cache, self.slots[b], self.reads[b]
        start = None if j is None else (c.conv[slot, j, layer], c.ssm[slot, j, layer])
        return (start, [c.conv[slot, e, layer] for e, _ in self.writes[b]],
                [c.ssm[slot, e, layer] for e, _ in self.writes[b]])

    def rows_kept(self, b: int) -> int:
        """How many of window b's last rows have their states kept (`write` takes that many)."""
        return len(self.writes[b])

    def write(self, b: int, layer: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Window b's layer states after each of its last `rows_kept(b)` rows: `conv [n, C, K-1]`,
        `ssm [n, H, Dk, Dv]`."""
        c, slot = self.cache, self.slots[b]
        index = torch.tensor([j for j, _ in self.writes[b]], device=c.conv.device)
        c.conv[slot, :, layer].index_copy_(0, index, conv.to(c.conv.dtype))
        c.ssm[slot, :, layer].index_copy_(0, index, ssm.to(c.ssm.dtype))

    def commit(self) -> None:
        """Every layer wrote: the ring entries now hold their lengths."""
        for slot, entries in zip(self.slots, self.writes):
            for j, length in entries:
                self.cache.positions[slot][j] = length
