"""The Adam updater over several hosts (ipc/protocol/adam.py update_clipped, update_unclipped through a
HostsLink): each host's updater, on a store of its own, updates its slice of every unit and the hosts gather
the updated slices into every host's resident copy. Measured against one updater on a one-host store (the
same functions through OneHost) fed the same whole gradients: every host's slices and whole copy are the one
host's, an inf on one host skips or stops the step on every host alike, and the one host publishes each piece
as it is updated where the hosts publish each unit whole."""

from __future__ import annotations

import dataclasses
import secrets
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch

from megatrain.actors.adam_updater import AdamUpdater
from megatrain.errors import NonFiniteGradient, ProtocolError
from megatrain.host.adamw import OptimConfig
from megatrain.ipc.messages import AdamRequest
from megatrain.ipc.protocol import Store
from megatrain.ipc.protocol.executor import grads_landed
from megatrain.model.layout import STATE_PLANES as PLANES
from tests.shm_fixtures import make_spec, release

LR = 1e-2
ADDRESS = "127.0.0.1"
JOIN_S = 60  # the longest a test waits for every host's call: past it a host hung


def _spec(rid: str, model_spec, hosts: int, host: int, clip: bool):
    # slab_params of one tile block: units of several pieces, and with 3 hosts a unit host 2 owns none of
    spec = make_spec(
        rid, model_spec, staging="bf16", staging_mode="resident", slab_params=2048, wait_timeout_s=30.0, poll_s=0.01
    )
    return dataclasses.replace(spec, hosts=hosts, host=host, clip=clip)


@contextmanager
def _stores(model_spec, hosts: int, clip: bool) -> Iterator[tuple[Store, list[Store]]]:
    """The one-host reference store and each host's store (run ids of their own, as hosts simulated on one
    machine), all unlinked however the test ends."""
    rids = ["test" + secrets.token_hex(4) for _ in range(hosts + 1)]
    made: list[Store] = []
    try:
        made.append(Store.create(_spec(rids[0], model_spec, 1, 0, clip)))
        made += [Store.create(_spec(rids[h + 1], model_spec, hosts, h, clip)) for h in range(hosts)]
        yield made[0], made[1:]
    finally:
        release(made, rids)


@contextmanager
def _updaters(cfg: OptimConfig, ref: Store, stores: list[Store]) -> Iterator[tuple[AdamUpdater, list[AdamUpdater]]]:
    """An updater on the reference store and one per host, the hosts' joined into their group."""
    adams = [AdamUpdater(cfg) for _ in range(len(stores) + 1)]
    try:
        for adam, st in zip(adams, [ref, *stores], strict=True):
            adam.attach(st.spec)
        port = adams[1].open_hosts(ADDRESS)
        joined = _on_threads([lambda a=a: a.join_hosts(ADDRESS, port) for a in adams[1:]])
        assert joined == [None] * len(stores), joined
        yield adams[0], adams[1:]
    finally:
        for adam in adams:
            if adam.store is not None:
                adam.store.close()


def _on_threads(calls: list[Callable[[], Any]]) -> list[Any]:
    """Each call on a thread of its own (the hosts' updaters meet in collectives); their results or the
    exceptions they raised, in order. A call still running after JOIN_S fails the test."""
    out: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except Exception as exc:  # returned: the test checks which
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), "a host's updater hung"
    return out


def _init(rng: np.random.Generator, ref: Store, stores: list[Store]) -> None:
    """Random fp32 weights: the reference holds them whole, each host its slices; every resident copy whole."""
    for u in range(ref.spec.num_units):
        whole = rng.standard_normal(ref.spec.layout.structure_of(u).numel).astype(np.float32)
        ref.tile("params", u)[:] = whole
        ref.refresh_resident(u)
        for st in stores:
            lo, hi = st.spec.owned(u)
            st.tile("params", u)[:] = whole[lo:hi]
            st.resident_tile(u).copy_(torch.from_numpy(whole))


def _gradients(rng: np.random.Generator, spec) -> list[torch.Tensor]:
    """A whole bf16 gradient per unit, of magnitudes in [1/4, 2]: every square and every sum of them is exact
    in float64, so the hosts' norm (summed in another order) is the one host's to the bit."""
    out = []
    for u in range(spec.num_units):
        n = spec.layout.structure_of(u).numel
        out.append(torch.from_numpy(rng.uniform(0.25, 2.0, n) * rng.choice([-1.0, 1.0], n)).to(torch.bfloat16))
    return out


def _land(store: Store, grads: list[torch.Tensor]) -> None:
    """As the store's executor 0 lands them: its host's pieces, in the gradient order, each with its squared
    norm and a grads_ready."""
    for items in store.spec.emit_items:
        if not items:
            continue
        tile, sq = store.resident_tile(items[0].unit), []
        for it in items:
            g = grads[it.unit][it.lo : it.hi]
            tile[it.lo : it.hi].copy_(g)
            sq.append(float((g.double() ** 2).sum()))
        grads_landed(store, items, sq)


def _step(adams: list[AdamUpdater], step: int, saving: bool = False) -> list[Any]:
    return _on_threads([lambda a=a: a.step(AdamRequest(step=step, lr=LR, saving=saving)) for a in adams])


def _assert_same(ref: Store, stores: list[Store]) -> None:
    """Every host's slices of the fp32 planes are the reference's, and every host's whole copy is its copy."""
    for u in range(ref.spec.num_units):
        for part in PLANES:
            got = np.concatenate([st.tile(part, u) for st in stores])
            np.testing.assert_array_equal(got, ref.tile(part, u), err_msg=f"{part} of unit {u}")
        want = ref.resident_tile(u).view(torch.int16)
        for st in stores:
            assert torch.equal(st.resident_tile(u).view(torch.int16), want), f"host {st.spec.host}'s copy of unit {u}"


def _assert_published(stores: list[Store], version: int) -> None:
    for st in stores:
        assert list(st.versions) == [version] * st.spec.num_pieces, f"host {st.spec.host}'s versions"


@pytest.mark.parametrize("hosts", [2, 3])
@pytest.mark.parametrize("clip", [True, False])
def test_the_hosts_take_the_step_one_host_takes(model_spec, hosts: int, clip: bool) -> None:
    """Two steps (the second while a checkpoint is written: each host waits for its own pieces to be taken):
    with a max_grad_norm that clips, and without clipping."""
    cfg = OptimConfig(lr=LR, max_grad_norm=1.0 if clip else 0.0, weight_decay=0.1)
    rng = np.random.default_rng(hosts)
    with _stores(model_spec, hosts, clip) as (ref, stores), _updaters(cfg, ref, stores) as (one, adams):
        _init(rng, ref, stores)
        for step in range(2):
            grads = _gradients(rng, ref.spec)
            for st in [ref, *stores]:
                _land(st, grads)
                for it in st.spec.update_items if step else ():
                    st.publish_saved(it.piece, step)  # the writer has taken this host's pieces
            want = one.step(AdamRequest(step=step, lr=LR, saving=step > 0))
            got = _step(adams, step, saving=step > 0)
            assert all(g.grad_norm == want.grad_norm and not g.skipped for g in got), (got, want)
            assert all(g.clip_scale == want.clip_scale for g in got)
            assert want.clip_scale < 1.0 if clip else want.clip_scale == 1.0
            _assert_same(ref, stores)
            _assert_published([ref, *stores], step + 1)


@pytest.mark.parametrize("hosts", [2, 3])
def test_an_inf_on_one_host_skips_the_step_on_every_host(model_spec, hosts: int) -> None:
    """With clipping the norm is global: an inf in host 1's slice skips the step on every host, every copy
    back to the unchanged weights (the gradient sat in it) and every version published."""
    cfg = OptimConfig(lr=LR, max_grad_norm=1.0)
    rng = np.random.default_rng(7)
    with _stores(model_spec, hosts, True) as (ref, stores), _updaters(cfg, ref, stores) as (_, adams):
        _init(rng, ref, stores)
        before = {(st.spec.host, u): st.tile("params", u).copy() for st in stores for u in range(ref.spec.num_units)}
        grads = _gradients(rng, ref.spec)
        grads[1][stores[1].spec.owned(1)[0]] = float("inf")
        for st in stores:
            _land(st, grads)
        got = _step(adams, 0)
        assert all(g.skipped and not np.isfinite(g.grad_norm) for g in got), got
        for st in stores:
            for u in range(ref.spec.num_units):
                np.testing.assert_array_equal(st.tile("params", u), before[st.spec.host, u])
                assert not st.tile("exp_avg", u).any() and not st.tile("exp_avg_sq", u).any()
                whole = torch.from_numpy(ref.tile("params", u)).bfloat16()
                assert torch.equal(st.resident_tile(u).view(torch.int16), whole.view(torch.int16)), (st.spec.host, u)
        _assert_published(stores, 1)


@pytest.mark.parametrize("hosts", [2, 3])
def test_an_inf_on_one_host_stops_every_host_without_clipping(model_spec, hosts: int) -> None:
    """Without clipping a unit is updated as its pieces arrive: an inf in the last host's slice of a layer
    stops every host at that unit with NonFiniteGradient, none left waiting in a collective."""
    cfg = OptimConfig(lr=LR, max_grad_norm=0.0)
    rng = np.random.default_rng(11)
    with _stores(model_spec, hosts, False) as (ref, stores), _updaters(cfg, ref, stores) as (_, adams):
        _init(rng, ref, stores)
        grads = _gradients(rng, ref.spec)
        bad = 2  # layer 1: its gradient comes after the head's and layer 2's, which are updated first
        grads[bad][stores[-1].spec.owned(bad)[0]] = float("-inf")
        for st in stores:
            _land(st, grads)
        got = _step(adams, 0)
        for g in got:
            assert isinstance(g, NonFiniteGradient), got
            assert f"in unit {bad} (layer 1)" in str(g)
        for st in stores:
            assert st.version(ref.spec.piece_range(bad).start) == 0  # nothing reads the half-applied step
            assert st.version(ref.spec.piece_range(bad + 1).start) == 1


def test_a_step_over_several_hosts_needs_the_hosts_group(model_spec) -> None:
    """Host 1 opens no rendezvous, one host has no group, and a step before join_hosts is refused by name."""
    with _stores(model_spec, 2, True) as (ref, stores):
        adams = [AdamUpdater(OptimConfig()) for _ in range(3)]
        try:
            for adam, st in zip(adams, [ref, *stores], strict=True):
                adam.attach(st.spec)
            with pytest.raises(ProtocolError, match="one host has no hosts' group"):
                adams[0].open_hosts(ADDRESS)
            with pytest.raises(ProtocolError, match="host 0's updater's to open, not host 1's"):
                adams[2].open_hosts(ADDRESS)
            with pytest.raises(ProtocolError, match="open_hosts first"):
                adams[1].join_hosts(ADDRESS, 1)
            with pytest.raises(ProtocolError, match=r"has not joined it \(AdamUpdater.join_hosts\)"):
                adams[1].step(AdamRequest(step=0, lr=LR))
        finally:
            for adam in adams:
                adam.store.close()


def _watched(adam: AdamUpdater) -> list[tuple[int, list[int]]]:
    """Every piece the updater updates, with its store's versions as they stood right before the update: what
    the next forward could read at that moment."""
    seen: list[tuple[int, list[int]]] = []
    real = adam._piece

    def piece(t: int, lr: float, item, grad: np.ndarray, scale: float, spare: bool) -> None:
        seen.append((item.piece, list(adam.store.versions)))
        real(t, lr, item, grad, scale, spare)

    adam._piece = piece  # the step binds its PieceUpdate from the instance
    return seen


@pytest.mark.parametrize("clip", [True, False])
def test_one_host_publishes_each_piece_and_the_hosts_each_unit_whole(model_spec, clip: bool) -> None:
    """One host: each piece is published right after its update (the next forward may begin on a unit's first
    pieces while its last are updated). Two hosts: a unit is published only whole, after its gather, so no
    update ever sees a unit half published."""
    cfg = OptimConfig(lr=LR, max_grad_norm=1.0 if clip else 0.0)
    with _stores(model_spec, 2, clip) as (ref, stores), _updaters(cfg, ref, stores) as (one, adams):
        _init(np.random.default_rng(3), ref, stores)
        grads = _gradients(np.random.default_rng(4), ref.spec)
        for st in [ref, *stores]:
            _land(st, grads)
        seen_one, seen_hosts = _watched(one), [_watched(a) for a in adams]
        one.step(AdamRequest(step=0, lr=LR))
        assert all(not isinstance(g, Exception) for g in _step(adams, 0))
        order = [it.piece for it in ref.spec.update_items]
        units = [ref.spec.piece_range(u) for u in range(ref.spec.num_units)]
        assert any(len(range(r.start, r.stop)) > 1 for r in units)  # else per piece and per unit look alike
        assert [p for p, _ in seen_one] == order
        for k, (_, versions) in enumerate(seen_one):
            assert [versions[p] for p in order] == [1] * k + [0] * (len(order) - k), k
        for st, seen in zip(stores, seen_hosts, strict=True):
            assert [p for p, _ in seen] == [it.piece for it in st.spec.update_items]
            for piece, versions in seen:
                for r in units:
                    assert len(set(versions[r])) == 1, (st.spec.host, piece, r, versions[r])
        _assert_published([ref, *stores], 1)
