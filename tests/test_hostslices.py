"""A run over several hosts, at the store: each host's slice of the fp32 planes, the pieces cut at the slices,
and the collectives that move a unit's slices between hosts (megatrain/memory/hosts.py, ipc/protocol/plan.py,
megatrain/collective.py)."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import threading

import numpy as np
import pytest
import torch

from megatrain.collective import Group, SliceExchange, gloo_options, open_rendezvous
from megatrain.errors import AbortError, MegatrainError, ProtocolError
from megatrain.ipc.protocol import Store
from megatrain.memory.hosts import host_plane_elems
from tests.harness import on_threads
from tests.shm_fixtures import make_spec, release


def _spec(rid: str, model_spec, hosts: int, host: int, slab_params: int = 4096):
    spec = make_spec(rid, model_spec, staging="bf16", staging_mode="resident", slab_params=slab_params)
    return dataclasses.replace(spec, hosts=hosts, host=host)


@pytest.mark.parametrize("hosts", [1, 2, 3, 5])
def test_the_hosts_pieces_partition_every_unit(rid: str, model_spec, hosts: int) -> None:
    """Every element of every unit is in exactly one piece, every piece in exactly one host's slice, and each
    host updates (and lands gradients for) exactly its own pieces; the control segment counts them all."""
    specs = [_spec(rid, model_spec, hosts, h) for h in range(hosts)]
    table = specs[0].piece_table
    assert all(s.piece_table == table for s in specs)
    assert specs[0].num_pieces == specs[0].shape.num_pieces
    for u, pieces in enumerate(table):
        numel = specs[0].layout.structure_of(u).numel
        covered = np.zeros(numel, np.int64)
        for _, lo, hi in pieces:
            covered[lo:hi] += 1
            assert hi - lo <= specs[0].slab_elems
        assert (covered == 1).all()
        slices = [s.owned(u) for s in specs]
        assert slices[0][0] == 0 and slices[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(slices, slices[1:], strict=False))
    owners = {}
    for s in specs:
        for item in s.update_items:
            lo, hi = s.owned(item.unit)
            assert lo <= item.lo <= item.hi <= hi
            owners.setdefault(item.piece, []).append(s.host)
        assert sorted(it.piece for it in s.update_items) == sorted(it.piece for u in s.emit_items for it in u)
    assert sorted(owners) == list(range(specs[0].num_pieces))
    assert all(len(h) == 1 for h in owners.values())


def test_each_host_holds_its_slice_and_only_its_slice(model_spec) -> None:
    """Two hosts' stores on one machine: each fp32 plane is the host's slices (the plan's size), the whole
    weights written through both hosts' tiles read back whole, and an element of the other host's slice is
    refused by name."""
    import secrets

    rids = ["test" + secrets.token_hex(4) for _ in range(2)]
    stores = []
    try:
        stores = [Store.create(_spec(rids[h], model_spec, 2, h)) for h in range(2)]
        layout = stores[0].spec.layout
        assert stores[0].plane("params").size == host_plane_elems(layout, 2) < layout.total
        rng = np.random.default_rng(0)
        for u in range(len(layout.units)):
            whole = rng.standard_normal(layout.structure_of(u).numel).astype(np.float32)
            for st in stores:
                lo, hi = st.spec.owned(u)
                st.tile("params", u)[:] = whole[lo:hi]
            got = np.concatenate([st.tile("params", u) for st in stores])
            assert np.array_equal(got, whole)
            lo, hi = stores[1].spec.owned(u)
            if hi > lo:
                assert np.array_equal(stores[1].span("params", u, lo, hi), whole[lo:hi])
                with pytest.raises(ProtocolError, match="not in host 0's slice"):
                    stores[0].span("params", u, lo, hi)
            stores[1].refresh_resident(u)  # its own slice of the copy, from its own fp32 slice
            assert torch.equal(stores[1].resident_tile(u)[lo:hi], torch.from_numpy(whole[lo:hi]).bfloat16())
    finally:
        release(stores, rids)


def test_several_hosts_stream_from_a_resident_copy(rid: str, model_spec) -> None:
    with pytest.raises(ProtocolError, match="resident copy"):
        dataclasses.replace(make_spec(rid, model_spec), hosts=2, host=1)
    with pytest.raises(ProtocolError, match="host 2 is not one of"):
        _spec(rid, model_spec, 2, 2)


def _groups(size: int, body) -> list:
    """`body(group)` on `size` ranks of a gloo group, one thread each; their results in rank order."""
    rendezvous = open_rendezvous(size, 30)

    def member(rank: int):
        where = rendezvous if rank == 0 else ("127.0.0.1", rendezvous.port)
        return body(Group(where, rank, size, torch.device("cpu"), 30, lambda: None))

    return on_threads([functools.partial(member, r) for r in range(size)])


def test_a_gradient_is_reduce_scattered_over_the_hosts() -> None:
    hosts, chunk = 3, 5

    def body(group: Group) -> torch.Tensor:
        full = torch.arange(hosts * chunk, dtype=torch.float32) * (group.rank + 1)
        mine = torch.empty(chunk)
        group.reduce_scatter_(full, mine)
        with pytest.raises(MegatrainError, match="reduce-scatter of 4 elements"):
            group.reduce_scatter_(torch.zeros(4), mine)
        return mine

    total = torch.arange(hosts * chunk, dtype=torch.float32) * sum(range(1, hosts + 1))
    for rank, mine in enumerate(_groups(hosts, body)):
        assert torch.equal(mine, total[rank * chunk : (rank + 1) * chunk])


def test_the_hosts_updated_slices_are_exchanged_in_place_over_several_channels() -> None:
    """Host h's range of the tensor (unequal lengths, the last empty) reaches every host's tensor in place; a
    range over twice MIN_CHANNEL_BYTES is cut over two channels, one under it is not cut."""
    n = 1_700_000  # bf16: host 0's range 2.2 MB (two channels), host 1's 1.2 MB (one), host 2's empty
    ranges = [(0, 1_100_000), (1_100_000, n), (n, n)]

    def body(group: Group) -> tuple[torch.Tensor, int]:
        exchange = SliceExchange(group.rendezvous, group.rank, group.size, 30, lambda: None)
        tensor = torch.zeros(n, dtype=torch.bfloat16)
        lo, hi = ranges[group.rank]
        tensor[lo:hi] = group.rank + 1
        works = exchange.start(tensor, ranges)
        exchange.finish(works)
        with pytest.raises(MegatrainError, match="an exchange over 3 ranks of 2 ranges"):
            exchange.start(tensor, ranges[:2])
        return tensor, len(works)

    want = torch.cat([torch.full((1_100_000,), 1.0), torch.full((n - 1_100_000,), 2.0)]).to(torch.bfloat16)
    for tensor, works in _groups(3, body):
        assert torch.equal(tensor, want) and works == 3


def test_a_host_waiting_on_the_exchange_stops_at_the_abort_and_the_exchange_still_completes() -> None:
    """Host 0 waits on a host that has not entered the exchange yet: the abort flag ends its wait by name; once
    host 1 enters, both hosts' broadcasts complete (nothing was left broken)."""
    entered, aborted = threading.Event(), threading.Event()

    def check() -> None:
        if not entered.is_set():
            aborted.set()
            raise AbortError("the run was aborted")

    def body(group: Group) -> torch.Tensor:
        exchange = SliceExchange(group.rendezvous, group.rank, group.size, 30, check, poll_s=0.001)
        tensor = torch.full((8,), group.rank + 1.0)
        if group.rank == 0:
            works = exchange.start(tensor, [(0, 4), (4, 8)])
            with pytest.raises(AbortError, match="aborted"):
                exchange.finish(works)
            entered.set()
        else:
            aborted.wait(30)
            works = exchange.start(tensor, [(0, 4), (4, 8)])
        exchange.finish(works)
        return tensor

    for tensor in _groups(2, body):
        assert tensor.tolist() == [1.0] * 4 + [2.0] * 4


def test_gloo_listens_on_the_nodes_address_or_the_interfaces_the_user_names(monkeypatch) -> None:
    """A group over hosts binds gloo to the node's address (the hostname may resolve to a loopback address no
    other node reaches); GLOO_SOCKET_IFNAME, where set, wins; an address or interface gloo cannot listen on is
    one error naming what to set."""
    timeout = datetime.timedelta(seconds=5)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert len(gloo_options("127.0.0.1", timeout)._devices) == 1
    with pytest.raises(MegatrainError, match=r"this node's address 198\.51\.100\.7: .*set GLOO_SOCKET_IFNAME"):
        gloo_options("198.51.100.7", timeout)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert len(gloo_options("198.51.100.7", timeout)._devices) == 1  # the interface named, not the address
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-interface0")
    with pytest.raises(MegatrainError, match=r"GLOO_SOCKET_IFNAME names \(no-such-interface0\)"):
        gloo_options(None, timeout)
