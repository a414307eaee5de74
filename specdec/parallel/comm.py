"""The collectives of one group of ranks.

`torch.distributed` (gloo on the CPU) joins the ranks and carries the pipeline's hidden states.
The tensor-parallel all-reduce of ranks on one machine goes through a mapped region instead
(`shm_allreduce.c`): gloo over loopback took 2.3 ms for one hidden vector here (send/recv 0.19 ms
a round trip, a plain socket 0.02 ms), and a 28-layer target makes 56 of them a token. Without the
C kernels the all-reduce falls back to gloo's.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import tempfile
import time
from datetime import timedelta

import torch

from specdec import kernel_abi

SLOT_BYTES = 4 << 20  # each rank's part of one all-reduce call; longer vectors take several
PIDS = 2048  # shm_allreduce.c SHM_PIDS: the ranks' process ids in the region's header


class RankFailure(RuntimeError):
    """A rank of the group died, hung past the timeout or failed: the engine cannot go on."""

    fatal = True  # the serving loop dies on it (`api.engine_loop`) instead of serving on


SHM_PREFIX = "specdec-group-"


def shm_folder() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def shm_path() -> str:
    """A fresh path for a group's region: in /dev/shm where it exists (memory, not disk). The
    regions of drivers that died before their ranks joined (the name goes at join) are removed."""
    folder = shm_folder()
    sweep_stale_regions(folder)
    fd, path = tempfile.mkstemp(prefix=SHM_PREFIX, dir=folder)
    os.close(fd)
    return path


def sweep_stale_regions(folder: str, min_age_s: float = 600.0) -> list[str]:
    """Remove the regions in `folder` whose driver (rank 0, its pid in the header) is gone, or
    that no driver attached to within `min_age_s`; returns their paths."""
    removed = []
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if not name.startswith(SHM_PREFIX):
            continue
        try:
            with open(path, "rb") as f:
                f.seek(PIDS)
                raw = f.read(4)
            pid = struct.unpack("i", raw)[0] if len(raw) == 4 else 0
            stale = not _alive(pid) if pid > 0 else time.time() - os.path.getmtime(path) > min_age_s
            if stale:
                os.unlink(path)
                removed.append(path)
        except OSError:  # gone meanwhile, or another user's
            continue
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class ShmRegion:
    """The mapped region of a group on one machine (`shm_allreduce.c` describes its layout)."""

    def __init__(self, path: str, world: int, slot_bytes: int = SLOT_BYTES, create: bool = False) -> None:
        if world > 32:
            raise ValueError(f"a group on one machine holds at most 32 ranks, got {world}")
        size = kernel_abi.SHM_HEADER + 2 * world * slot_bytes
        fd = os.open(path, os.O_RDWR)
        try:
            if create:
                os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)  # its address, kept alive
        self.world, self.slot_bytes = world, slot_bytes

    def attach(self, rank: int) -> None:
        """Write this process's id as `rank`'s (the others tell a dead rank from a slow one by it)."""
        struct.pack_into("i", self.map, PIDS + 4 * rank, os.getpid())


class Comm:
    """This process's place in a group of `world` ranks: `pg` (gloo) and, on one machine, the
    region the all-reduce goes through."""

    def __init__(self, rank: int, world: int, pg, region: ShmRegion | None, timeout_s: float) -> None:
        from specdec.target.quant import decoder_stack

        self.rank, self.world, self.pg, self.timeout_s = rank, world, pg, timeout_s
        self.lib = decoder_stack.kernel().load() if region is not None else None
        self.region = region if self.lib is not None else None
        self.calls = ctypes.c_int64(0)  # this rank's all-reduce calls; the C side advances it
        self.descriptor = kernel_abi.Group(
            self.region.bytes.data_ptr() if self.region else None, rank, world,
            self.region.slot_bytes if self.region else 64, ctypes.addressof(self.calls), int(timeout_s * 1000),
        )
        if self.region is not None:
            self.region.attach(rank)
        self.describe_failure = lambda what: what  # the driver names the rank that failed
        self.num_all_reduces = 0
        self.all_reduce_bytes = 0

    def set_columns(self, att: tuple[int, int, int], ffn: tuple[int, int, int], out: tuple[int, int, int]) -> None:
        """This rank's (start, width, full) columns of the attention output, of gate (and up),
        and of the hidden state, where the layers are split exactly (`shard.ColumnParallelLinear`):
        what the C layer loop gathers."""
        for name, values in (("att", att), ("ffn", ffn), ("out", out)):
            for what, value in zip(("start", "width", "full"), values):
                setattr(self.descriptor, f"{name}_{what}", value)

    @property
    def exact(self) -> bool:
        """Whether the layers are split exactly (`set_columns`)."""
        return self.descriptor.out_full > 0

    @property
    def group(self) -> kernel_abi.Group | None:
        """The descriptor `decoder_layers` takes (None: its all-reduce is not on this machine)."""
        return self.descriptor if self.region is not None else None

    def count(self, numel: int) -> None:
        self.num_all_reduces += 1
        self.all_reduce_bytes += 4 * numel

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (fp32, contiguous, CPU) summed over the ranks, in place; the same bits on every rank."""
        if self.world == 1:
            return t
        self.count(t.numel())
        if self.region is not None:
            rc = self.lib.group_allreduce(ctypes.byref(self.descriptor), t.data_ptr(), t.numel())
            self.raise_for_status(rc)
            return t
        self.wait(self.pg.allreduce([t]))
        return t

    def raise_for_status(self, rc: int) -> None:
        if rc == kernel_abi.Status.OK:
            return
        if rc == kernel_abi.Status.ERR_TIMEOUT:
            raise RankFailure(self.describe_failure(f"a rank did not answer within {self.timeout_s:g} s"))
        if rc == kernel_abi.Status.ERR_PEER_GONE:
            raise RankFailure(self.describe_failure("a rank's process ended"))
        kernel_abi.raise_for_status(rc, "group_allreduce")

    def wait(self, work) -> None:
        """Wait for a gloo operation; its failure (a rank gone, the timeout) is a `RankFailure`."""
        try:
            work.wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            raise RankFailure(self.describe_failure(f"a collective failed ({str(e).splitlines()[0]})")) from e

    def send(self, t: torch.Tensor, dst: int) -> None:
        self.wait(self.pg.send([_wire(t)], dst, 0))

    def recv(self, t: torch.Tensor, src: int) -> torch.Tensor:
        self.wait(self.pg.recv([_wire(t)], src, 0))
        return t


def _wire(t: torch.Tensor) -> torch.Tensor:
    """bf16 travels as its int16 bits (every gloo build carries those)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def process_group(host: str, port: int, rank: int, world: int, timeout_s: float, store=None, bind: str = "127.0.0.1"):
    """The gloo group of `world` ranks whose store listens at host:port (rank 0 holds it); this
    rank's gloo device on address `bind`, or on the interface `GLOO_SOCKET_IFNAME` names."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world, False, timeout)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    options._devices = [dist.ProcessGroupGloo.create_device(interface=interface) if interface
                        else dist.ProcessGroupGloo.create_device(hostname=bind)]
    return dist.ProcessGroupGloo(store, rank, world, options)
