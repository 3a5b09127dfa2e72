"""The executors' process group: N executors (one per GPU) sum their gradients and share the step's
token count and router statistics through torch.distributed (NCCL on CUDA, gloo on the CPU device).

The groups are made as objects, not through `init_process_group`: the in-process runner runs every
executor as a thread of one process, and the global default group exists once per process. Two groups
are made over one rendezvous: `grads` carries the per-layer gradient reductions, issued in order by each
executor's reducer thread; `stats` the small reductions the engine makes on the compute thread. A
collective group must see the same calls in the same order on every rank, and two threads of one rank
issuing on one group would interleave differently on each.

A run's executors, on one host or several, form their groups one way (join_world), over one rendezvous: the
statistics over every executor of every host, each host's own executors' gradient sum (with more than one), and
over several hosts the hosts' reduce-scatter among each host's executor 0. One host is the case of one host: its
executors' statistics and gradient sum, no reduce-scatter. A run of one executor forms no group (nothing to sum).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from megatrain.errors import MegatrainError, WaitTimeout

HOST = "127.0.0.1"  # every executor is on the store's node (one STRICT_PACK placement group)


def open_rendezvous(size: int, timeout_s: float, host: str = HOST) -> dist.TCPStore:
    """Rank 0's key-value store for the group's rendezvous, on a free port (`.port`) of `host` (an address the
    other members reach it at: this node's own where the members are on other nodes)."""
    return dist.TCPStore(
        host, 0, size, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False, use_libuv=True
    )


def connect_rendezvous(address: str, port: int, size: int, timeout_s: float) -> dist.TCPStore:
    """A member's connection to the rendezvous open_rendezvous opened at `address`:`port`."""
    return dist.TCPStore(address, port, size, False, timeout=datetime.timedelta(seconds=timeout_s), use_libuv=True)


class Group:
    """One executor's membership: rank `rank` of `size`, on `device`. `check` raises when the run is
    aborted (a host wait on a collective polls it, so a dead peer never hangs a live one). `rendezvous`: rank 0's
    store, (address, port) to connect to it, or a store over it (a prefix: several groups over one rendezvous).
    `parts`: the process groups it makes, `grads` and `stats` (a group that never uses one does not connect it).
    `bind`: this node's address as the other members reach it, for gloo's connections (gloo_options)."""

    def __init__(
        self,
        rendezvous: dist.Store | tuple[str, int],
        rank: int,
        size: int,
        device: torch.device,
        timeout_s: float,
        check: Callable[[], None],
        poll_s: float = 0.01,
        *,
        parts: tuple[str, ...] = ("grads", "stats"),
        bind: str | None = None,
    ):
        if not 0 <= rank < size:
            raise MegatrainError(f"executor rank {rank} is not in a group of {size}")
        if not parts or set(parts) - {"grads", "stats"}:
            raise MegatrainError(f"a group's parts are grads and/or stats, not {parts}")
        self.rank, self.size, self.device, self.check, self.poll_s = rank, size, device, check, poll_s
        self.timeout_s, self.bind = timeout_s, bind
        timeout = datetime.timedelta(seconds=timeout_s)
        if isinstance(rendezvous, tuple):
            rendezvous = connect_rendezvous(*rendezvous, size, timeout_s)
        self.rendezvous = rendezvous  # held: the groups' connections were made through it
        self.cuda = device.type == "cuda"
        made = {p: self._make(dist.PrefixStore(p, rendezvous), timeout) for p in parts}
        self._grads, self._stats = made.get("grads"), made.get("stats")

    @property
    def grads(self) -> dist.Backend:
        """The gradients' process group (issued from one thread: the reducer's)."""
        if self._grads is None:
            raise MegatrainError("this executors' group carries statistics only, not gradients")
        return self._grads

    @property
    def stats(self) -> dist.Backend:
        """The statistics' process group (issued from the compute thread)."""
        if self._stats is None:
            raise MegatrainError("this executors' group carries gradients only, not statistics")
        return self._stats

    def _make(self, store: dist.Store, timeout: datetime.timedelta) -> dist.Backend:
        if not self.cuda:
            return dist.ProcessGroupGloo(store, self.rank, self.size, gloo_options(self.bind, timeout))
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, self.rank, self.size, opts)

    @property
    def backend(self) -> str:
        return "nccl" if self.cuda else "gloo"

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks in place (the stats group, from the compute thread). On CUDA the current
        stream waits for the result (the host does not); on the CPU the host waits."""
        self.finish(self.stats.allreduce([t], _sum()))
        return t

    def reduce_(self, t: torch.Tensor) -> dist.Work:
        """Sum `t` over the ranks into rank 0's `t` (the grads group); the caller finishes the work."""
        opts = dist.ReduceOptions()
        opts.rootRank, opts.reduceOp = 0, dist.ReduceOp.SUM
        return self.grads.reduce([t], opts)

    def broadcast_(self, t: torch.Tensor, src: int, part: str = "grads") -> None:
        """Rank `src`'s `t` into every rank's `t`, in place, over the `part` group ('grads': from the reducer's
        thread; 'stats': from the compute thread), finished as `finish` finishes."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.finish((self.grads if part == "grads" else self.stats).broadcast([t], opts))

    def reduce_scatter_(self, full: torch.Tensor, out: torch.Tensor) -> None:
        """Sum `full` (`size` chunks of len(out) elements) over the ranks; rank r's `out` gets chunk r of the
        sum (the grads group: a run over several hosts, each host's slice of a unit's gradient), finished as
        `finish` finishes. Gloo's reduce-scatter never reports itself complete to a poll, so on the CPU the sum
        is an all-reduce of `full` in place (the caller's buffer, done with) and `out` its chunk."""
        if full.numel() != out.numel() * self.size:
            raise MegatrainError(f"a reduce-scatter of {full.numel()} elements into {self.size} x {out.numel()}")
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        if self.cuda:
            self.finish(self.grads._reduce_scatter_base(out, full, opts))
            return
        self.finish(self.grads.allreduce([full], _sum()))
        out.copy_(full[self.rank * out.numel() : (self.rank + 1) * out.numel()])

    def finish(self, work: dist.Work) -> None:
        """On CUDA: the current stream waits for the collective (no host wait). On the CPU: the host waits,
        re-checking the abort flag, so a peer that died or stopped fails this rank too."""
        if self.cuda:
            work.wait()
            return
        await_works([work], self.check, self.timeout_s, self.poll_s, "the other executors' part of a reduction")

    def barrier(self) -> None:
        """Every rank reached this point: a one-element reduction, waited for on the host."""
        one = torch.ones(1, device=self.device)
        self.all_reduce_(one)
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        if int(one.item()) != self.size:
            raise MegatrainError(f"the executors' group answered {int(one.item())} of {self.size} ranks")


@dataclasses.dataclass(frozen=True, kw_only=True)
class World:
    """One executor's groups in a run of several executors, over one host or several. `stats`: every executor of
    every host (the step's token count and router statistics); `local`: this host's executors, whose gradients
    are summed into its executor 0 (None with one executor per host); `hosts`: executor 0 of every host, which
    reduce-scatter the hosts' sums so that each holds its own slice of the whole sum (None with one host, and on
    the other executors)."""

    stats: Group
    local: Group | None
    hosts: Group | None


def join_world(
    rendezvous: dist.Store,
    *,
    host: int,
    hosts: int,
    rank: int,
    per_host: int,
    device: torch.device,
    timeout_s: float,
    check: Callable[[], None],
    bind: str | None = None,
) -> World:
    """Executor `rank` of `per_host` on host `host` of `hosts` joins the run's groups over one rendezvous (every
    executor of every host at once). Each group forms only when all its members are there, so every member
    forms them in one order, the run's group first, then its host's, then the hosts': a member never waits for
    one still forming another. A group of one member is not made: it would sum nothing (one host has no hosts'
    group, one executor per host no host's group)."""
    if not 0 <= host < hosts or not 0 <= rank < per_host:
        raise MegatrainError(f"executor {rank} of host {host} is not one of {hosts} hosts x {per_host} executors")
    at = {"device": device, "timeout_s": timeout_s, "check": check, "bind": bind}
    every = dist.PrefixStore("world/", rendezvous)
    stats = Group(every, host * per_host + rank, hosts * per_host, parts=("stats",), **at)
    mine = dist.PrefixStore(f"host{host}/", rendezvous)
    local = Group(mine, rank, per_host, parts=("grads",), **at) if per_host > 1 else None
    firsts = dist.PrefixStore("hosts/", rendezvous)
    across = Group(firsts, host, hosts, parts=("grads",), **at) if rank == 0 and hosts > 1 else None
    return World(stats=stats, local=local, hosts=across)


def gloo_options(bind: str | None, timeout: datetime.timedelta) -> dist.ProcessGroupGloo._Options:
    """A gloo group's options: its connections on `bind` (this node's address as the other nodes reach it), unless
    the user named interfaces in GLOO_SOCKET_IFNAME or there is no such address (one host). Gloo's own default is
    the address this machine's hostname resolves to, a loopback address on many a Linux, which no other node
    reaches."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    named = os.environ.get("GLOO_SOCKET_IFNAME", "")
    try:
        if named:
            opts._devices = [dist.ProcessGroupGloo.create_device(interface=i) for i in named.split(",")]
        else:
            make = dist.ProcessGroupGloo
            opts._devices = [make.create_device(hostname=bind) if bind else make.create_default_device()]
    except RuntimeError as exc:
        where = f"the interfaces GLOO_SOCKET_IFNAME names ({named})" if named else f"this node's address {bind}"
        raise MegatrainError(
            f"gloo cannot listen on {where}: {exc}; set GLOO_SOCKET_IFNAME to the network interface the other "
            "hosts reach this one through"
        ) from None
    return opts


def await_works(
    works: Sequence[dist.Work], check: Callable[[], None], timeout_s: float, poll_s: float, what: str
) -> None:
    """The host waits for gloo collectives, polling, with `check` (the run's abort flag) between polls, so a peer
    that died or stopped fails this rank too instead of hanging it. (A gloo send or recv never reports itself
    complete to a poll, and a wait with a timeout breaks its connection: only collectives are awaited so.)"""
    deadline = time.monotonic() + timeout_s
    for work in works:
        while not work.is_completed():
            check()
            if time.monotonic() > deadline:
                raise WaitTimeout(f"waited {timeout_s:g}s for {what}")
            time.sleep(poll_s)
        work.wait()  # raises the collective's own error (a peer's connection lost)


# The gather of the hosts' updated slices goes over this many gloo groups at once, each with its own TCP
# connections and threads: over loopback on 2 cores one carried 1.1 GB/s, two or more 1.5 GB/s together (and
# gloo's all-gather 0.3). A part under MIN_CHANNEL_BYTES is not cut.
GATHER_CHANNELS = 4
MIN_CHANNEL_BYTES = 1 << 20


class SliceExchange:
    """Rank r of `size` (a host's Adam updater) holds elements [lo_r, hi_r) of a tensor that every rank holds
    whole; `start` puts every rank's range into every rank's tensor, in place: one gloo broadcast per rank, its
    range cut over the channels. No buffer: each rank's range is the same elements of every rank's tensor.
    Gloo's all-gather would need two copies and runs at a third of a broadcast's speed."""

    def __init__(
        self,
        rendezvous: dist.Store,
        rank: int,
        size: int,
        timeout_s: float,
        check: Callable[[], None],
        channels: int = GATHER_CHANNELS,
        poll_s: float = 0.002,
        bind: str | None = None,
    ):
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.size, self.timeout_s, self.check, self.poll_s = rank, size, timeout_s, check, poll_s
        self.groups = [
            dist.ProcessGroupGloo(dist.PrefixStore(f"gather{c}/", rendezvous), rank, size, gloo_options(bind, timeout))
            for c in range(channels)
        ]

    def start(self, tensor: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> list[dist.Work]:
        """Issue the broadcasts of rank r's `tensor[lo_r:hi_r]` (ranges: the same list on every rank); the
        caller finishes them (`finish`), after other work if it likes: they run on gloo's threads."""
        if len(ranges) != self.size or tensor.dim() != 1:
            raise MegatrainError(
                f"an exchange over {self.size} ranks of {len(ranges)} ranges of a {tensor.dim()}-d tensor"
            )
        works = []
        for root, (lo, hi) in enumerate(ranges):
            span = tensor[lo:hi]
            ways = min(len(self.groups), max(1, span.numel() * span.element_size() // MIN_CHANNEL_BYTES))
            for group, part in zip(self.groups, torch.tensor_split(span, ways), strict=False):
                if part.numel():
                    opts = dist.BroadcastOptions()
                    opts.rootRank = root
                    works.append(group.broadcast([part], opts))
        return works

    def finish(self, works: Sequence[dist.Work]) -> None:
        await_works(works, self.check, self.timeout_s, self.poll_s, "the other hosts' updated slices")


def _sum() -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    return opts


def split_rows(batch: int, size: int) -> list[slice]:
    """The batch's rows per rank: contiguous, sizes differing by at most one (the first ranks larger)."""
    if batch < size:
        raise MegatrainError(f"a batch of {batch} sequences cannot be split over {size} executors")
    base, extra = divmod(batch, size)
    out, lo = [], 0
    for r in range(size):
        hi = lo + base + (1 if r < extra else 0)
        out.append(slice(lo, hi))
        lo = hi
    return out
