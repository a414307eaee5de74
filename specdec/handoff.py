"""Prefill/decode disaggregation, the engine's half: a request's KV handed from one engine to another.

Prefill engine (`Engine.add_request(..., handoff=True)`): the target prefills the prompt and
samples the first token, which is emitted at once; the draft's cache is then fed the whole prompt
(a fill step of its own, so the first token never waits for it); then the request ends with
finish reason "handoff" and a `HandoffTicket`: the keys of the prompt's full blocks in both pools
and the size of its partial last block, which a `Lease` holds (reference counts) until they are
read or `timeout_s` passes.

Decode engine: `Engine.missing_keys(ticket)` names the full blocks its pools lack; the prefill
side's `Engine.export_kv(lease_id, wanted)` reads just those and the partial last blocks
(`KVPayload`) and releases the lease; `add_request(prompt, generated=[first token], payload=...)`
caches the full blocks, holds the partial ones for the request, and starts it on both: the prefix
cache finds the full blocks, the partial one is attached after them (`BlockTable.attach_partial`),
and nothing of the prompt is computed again.

Full blocks travel under their keys: they are the unit of the prefix cache (a decode engine that
holds some already skips them). The partial last block travels too, for exactness: computed again
in a decode window, its KV can differ in the last bits from the prompt's chunk on bf16 / quantized
kernels (the prefill path and the window path are different kernels), and a greedy answer could
then part from the colocated one (docs/results/v0.14.0-pd.md).
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from specdec.cache.block_pool import BlockKey, prefix_block_keys
from specdec.cache.transfer import read_blocks, write_blocks, write_held_block

LEASE_TIMEOUT_S = 30.0  # an unclaimed lease frees its blocks after this long


@dataclass(frozen=True)
class HandoffTicket:
    """What a decode engine needs to continue a prefilled request (small: it travels with it)."""

    lease_id: str
    prompt_len: int
    keys: dict[str, tuple[BlockKey, ...]]  # per pool ("target", "draft"): the prompt's full blocks
    compat: str  # the prefill engine's `compat_digest`
    partial: dict[str, int] = field(default_factory=dict)  # per pool: tokens in the partial last block


@dataclass
class KVPayload:
    """Blocks read out of a prefill engine's pools: per pool, their keys and their bytes."""

    lease_id: str
    blocks: dict[str, tuple[list[BlockKey], np.ndarray]] = field(default_factory=dict)  # [L, 2, n, S, H, D] bytes
    partial: dict[str, tuple[int, np.ndarray]] = field(default_factory=dict)  # tokens, [L, 2, 1, S, H, D] bytes

    @property
    def nbytes(self) -> int:
        return sum(data.nbytes for _, data in self.blocks.values()) + sum(d.nbytes for _, d in self.partial.values())

    @property
    def num_blocks(self) -> int:
        return sum(len(keys) for keys, _ in self.blocks.values()) + len(self.partial)


@dataclass
class Lease:
    ticket: HandoffTicket
    block_ids: dict[str, list[int]]  # per pool: the held blocks, aligned with ticket.keys (+ the partial one)
    deadline: float
    request_id: str = ""
    reading: bool = False  # export_kv is copying its blocks: expiry must wait


class UnknownLeaseError(KeyError):
    """The lease was never granted here, was already read, or expired."""


class LeaseBook:
    """The leases one engine holds. Taken and released on the engine's thread (they touch its
    pools); `claim` may come from another thread (a pull being served), so all of it is locked."""

    def __init__(self, timeout_s: float = LEASE_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self.num_expired = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def add(self, ticket: HandoffTicket, block_ids: dict[str, list[int]], request_id: str = "") -> None:
        with self._lock:
            self._leases[ticket.lease_id] = Lease(ticket, block_ids, time.monotonic() + self.timeout_s, request_id)

    def of_request(self, request_id: str) -> list[str]:
        """The leases granted for a request (an abort after its handoff frees them)."""
        with self._lock:
            return [lid for lid, lease in self._leases.items() if lease.request_id == request_id]

    def claim(self, lease_id: str) -> Lease:
        """Mark a lease as being read (it cannot expire meanwhile); UnknownLeaseError if gone."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.reading:
                raise UnknownLeaseError(f"no lease {lease_id!r} here (unknown, already read, or expired)")
            lease.reading = True
            return lease

    def pop(self, lease_id: str) -> Lease | None:
        with self._lock:
            return self._leases.pop(lease_id, None)

    def expired(self, now: float | None = None) -> list[Lease]:
        """Remove and return the leases past their deadline that nobody is reading."""
        now = time.monotonic() if now is None else now
        with self._lock:
            gone = [lid for lid, lease in self._leases.items() if lease.deadline <= now and not lease.reading]
            self.num_expired += len(gone)
            return [self._leases.pop(lid) for lid in gone]

    def next_deadline(self) -> float | None:
        with self._lock:
            return min((lease.deadline for lease in self._leases.values()), default=None)


def new_lease_id() -> str:
    return secrets.token_hex(12)


def compat_fields(engine: Any) -> dict[str, str]:
    """What must be equal between a prefill and a decode engine for blocks to move between them:
    the weights (a digest of every tensor's name, shape and leading bytes), dtypes, the KV cache
    layouts and the speculative settings."""
    config = engine.config
    fields = {
        "target weights": _weights_digest(engine.target.model),
        "target KV cache": _spec_text(engine.target.kv_cache.spec, engine.target.kv_cache.k_scale),
        "dtype": str(config.dtype),
        "kv_dtype": str(config.kv_dtype),
        "block_size": str(engine.block_size),
        "proposer": str(config.proposer) if engine.proposer is not None else "none",
        "num_speculative_tokens": str(config.num_speculative_tokens),
        "adaptive_k": str(config.adaptive_k),
        "target_quant": str(config.target_quant),
        "draft_quant": str(config.draft_quant),
    }
    draft = engine.proposer.runner if engine.proposer is not None and engine.proposer.pool is not None else None
    fields["draft weights"] = _weights_digest(draft.model) if draft is not None else "none"
    fields["draft KV cache"] = _spec_text(draft.kv_cache.spec, draft.kv_cache.k_scale) if draft is not None else "none"
    return fields


def compat_digest(fields: dict[str, str]) -> str:
    return hashlib.blake2b(repr(sorted(fields.items())).encode(), digest_size=12).hexdigest()


def compat_mismatch(ours: dict[str, str], theirs: dict[str, str]) -> str | None:
    """The first field two engines disagree on, as "field: ours vs theirs"; None when equal."""
    for name in sorted(set(ours) | set(theirs)):
        a, b = ours.get(name, "missing"), theirs.get(name, "missing")
        if a != b:
            return f"{name}: {a} vs {b}"
    return None


def _spec_text(spec: Any, scale: float) -> str:
    latent = f" (latent rank {spec.latent_rank})" if spec.latent_rank else ""
    return (f"{spec.num_layers} layers x {spec.num_kv_heads} heads x {spec.head_dim} dims{latent}, block {spec.block_size}, "
            f"{str(spec.dtype).replace('torch.', '')}, scale {scale:g}")


def _weights_digest(model: Any) -> str:
    """Names, shapes, dtypes and the first 4 KiB of every parameter and buffer: two replicas that
    loaded different files (or quantized them differently) disagree here, in milliseconds."""
    h = hashlib.blake2b(digest_size=12)
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        flat = tensor.detach().reshape(-1)[:1024].contiguous().cpu()
        h.update(flat.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def take_lease(book: LeaseBook, runners: dict[str, Any], seq: Any, compat: str) -> HandoffTicket:
    """Hold the blocks of `seq`'s prompt in every pool (`runners`: pool name -> ModelRunner) under
    a new lease: the full ones and, when the pool computed the whole prompt, its partial last
    block. Call before the sequence's tables are freed."""
    keys: dict[str, tuple[BlockKey, ...]] = {}
    block_ids: dict[str, list[int]] = {}
    partial: dict[str, int] = {}
    for name, table in (("target", seq.target_table), ("draft", seq.draft_table)):
        if table is None or name not in runners:
            continue
        table.cache_full_blocks(seq.token_ids)
        num_full = min(table.num_computed, seq.prompt_len) // table.block_size
        ids = table.block_ids[:num_full]
        tail = seq.prompt_len - num_full * table.block_size
        if table.num_computed >= seq.prompt_len and 0 < tail < table.block_size:
            ids = table.block_ids[: num_full + 1]  # positions past the prompt in it are never read
            partial[name] = tail
        runners[name].pool.incref(ids)
        block_ids[name] = list(ids)
        keys[name] = tuple(prefix_block_keys(seq.token_ids[: num_full * table.block_size], table.block_size,
                                             seq.cache_salt))
    ticket = HandoffTicket(new_lease_id(), seq.prompt_len, keys, compat, partial)
    book.add(ticket, block_ids, seq.request_id)
    return ticket


def export_lease(book: LeaseBook, runners: dict[str, Any], lease_id: str,
                 wanted: dict[str, list[BlockKey]] | None = None) -> KVPayload:
    """Read a lease's blocks: the `wanted` full blocks per pool (None: all) and every partial
    last block (nobody else can hold those). Safe off the engine's thread: nothing writes leased
    blocks (their sequence is gone; the full ones are cached, the partial ones held by the lease
    alone), and a lease being read does not expire. Release it afterwards (`release_lease`, on
    the engine's thread)."""
    lease = book.claim(lease_id)
    payload = KVPayload(lease_id)
    for name, keys in lease.ticket.keys.items():
        want = None if wanted is None else set(wanted.get(name, ()))
        chosen = [i for i, key in enumerate(keys) if want is None or key in want]
        if chosen:
            ids = [lease.block_ids[name][i] for i in chosen]
            payload.blocks[name] = ([keys[i] for i in chosen], read_blocks(runners[name].kv_cache, ids))
    for name, tokens in lease.ticket.partial.items():
        last = lease.block_ids[name][len(lease.ticket.keys[name])]
        payload.partial[name] = (tokens, read_blocks(runners[name].kv_cache, [last]))
    return payload


def release_lease(book: LeaseBook, runners: dict[str, Any], lease_id: str) -> bool:
    """Free a lease's blocks (engine thread); False when it is already gone."""
    lease = book.pop(lease_id)
    if lease is None:
        return False
    _free(runners, lease)
    return True


def expire_leases(book: LeaseBook, runners: dict[str, Any]) -> int:
    """Free the blocks of every lease past its deadline (engine thread); returns how many."""
    gone = book.expired()
    for lease in gone:
        _free(runners, lease)
    return len(gone)


def _free(runners: dict[str, Any], lease: Lease) -> None:
    for name, ids in lease.block_ids.items():
        runners[name].pool.free(reversed(ids))


def missing_keys(runners: dict[str, Any], ticket: HandoffTicket) -> dict[str, list[BlockKey]]:
    """Per pool, the ticket's blocks this engine's prefix caches lack (what a pull should fetch)."""
    return {name: [key for key in keys if runners[name].pool.lookup(key) is None]
            for name, keys in ticket.keys.items() if name in runners}


def import_payload(runners: dict[str, Any], payload: KVPayload) -> tuple[int, dict[str, tuple[int, int]]]:
    """Cache a payload's full blocks in this engine's pools and write its partial last blocks into
    blocks held for the request (engine thread). Returns the blocks written and, per pool, the
    held partial block as (block id, tokens): the caller owns those references."""
    partial: dict[str, tuple[int, int]] = {}
    for name, (tokens, data) in payload.partial.items():  # first: allocating them evicts none of the full ones
        if name in runners:
            block_id = write_held_block(runners[name].pool, runners[name].kv_cache, data)
            if block_id is not None:  # no free block: that pool computes the tail again
                partial[name] = (block_id, tokens)
    written = len(partial)
    try:
        for name, (keys, data) in payload.blocks.items():
            if name in runners:
                runner = runners[name]
                written += write_blocks(runner.pool, runner.kv_cache, keys, data)
    except BaseException:  # a payload that does not fit: hold nothing
        free_partial({name: runners[name].pool for name in partial}, partial)
        raise
    return written, partial


def free_partial(pools: dict[str, Any], partial: dict[str, tuple[int, int]]) -> None:
    """Give back partial blocks `import_payload` held (`pools`: pool name -> BlockPool), for a
    request that never used them: aborted, or its full blocks evicted before admission."""
    for name, (block_id, _) in partial.items():
        pools[name].free([block_id])
