"""Executors over several hosts on the CPU device (gloo), each host its own store (a run id of its own), every
executor a thread: after one step on its rows of a batch, each host's own pieces of its resident copy hold the
gradient one executor computes on the whole batch on a one-host store, with their squared norms in ctl; the
rest of each host's copy is untouched, and the executors' losses and token counts sum to the one executor's."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from megatrain.actors.executor.gpu_executor import GpuExecutor
from megatrain.collective import HOST, split_rows
from megatrain.config.engine import EngineConfig, fixed_sizes, resolve_engine
from megatrain.errors import MegatrainError
from megatrain.ipc.messages import StepReport, StepRequest
from megatrain.ipc.protocol import Store, StoreSpec
from megatrain.model.weights import flat_unit
from tests.harness import on_threads
from tests.model_fixtures import spec_for, tiny_hf
from tests.shm_fixtures import make_spec, remove_all

FAMILY, BATCH, SEQ = "llama", 4, 16
CFG = fixed_sizes(resolve_engine(EngineConfig(compute_dtype="fp32"), cuda=False))


@contextmanager
def _stores(specs: list[StoreSpec], state: dict[str, torch.Tensor]) -> Iterator[list[Store]]:
    """Each host's store, its whole resident copy filled with the model's weights; unlinked however the test
    ends."""
    stores: list[Store] = []
    try:
        for spec in specs:
            stores.append(Store.create(spec))
            for u in range(spec.num_units):
                stores[-1].resident_tile(u).copy_(flat_unit(spec.model, u, state))
        yield stores
    finally:
        for st in stores:
            st.unlink()
            st.close()
        for spec in specs:
            remove_all(spec.run_id)


@contextmanager
def _executors(specs: list[StoreSpec]) -> Iterator[list[GpuExecutor]]:
    """Every host's executors, attached to their host's store, in global rank order (host-major)."""
    out: list[GpuExecutor] = []
    try:
        for spec in specs:
            for r in range(spec.num_executors):
                out.append(GpuExecutor(CFG, FAMILY, rank=r))
                out[-1].attach(spec, CFG)
        yield out
    finally:
        for ex in out:
            ex.compute.shutdown()
            if ex.store is not None:
                ex.store.close()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=gen)
    labels = ids.clone()
    labels[0, : SEQ // 2] = -100  # the executors' rows count different tokens
    return ids, labels


def _steps(executors: list[GpuExecutor], ids: torch.Tensor, labels: torch.Tensor) -> list[StepReport]:
    rows = split_rows(BATCH, len(executors))
    step = [StepRequest(step=0, ids=ids[r], labels=labels[r]) for r in rows]
    return on_threads([functools.partial(ex.step, req) for ex, req in zip(executors, step, strict=True)])


def _reference(rid: str, spec: StoreSpec, state: dict, ids: torch.Tensor, labels: torch.Tensor) -> tuple:
    """One executor on a one-host store, the whole batch: (its report, each unit's gradient)."""
    one = dataclasses.replace(spec, run_id=rid + "one", hosts=1, host=0, num_executors=1)
    with _stores([one], state) as stores, _executors([one]) as (ex,):
        report = ex.step(StepRequest(step=0, ids=ids, labels=labels))
        return report, [stores[0].resident_tile(u).clone() for u in range(one.num_units)]


def _check_host(store: Store, want: list[torch.Tensor], state: dict) -> int:
    """The host's own pieces hold the run's gradient with its squared norms; every other element of its copy
    still holds the weights and every other piece's norm is untouched. Returns its pieces."""
    spec, pieces = store.spec, 0
    for items in spec.emit_items:
        for it in items:
            got, ref = store.resident_tile(it.unit)[it.lo : it.hi], want[it.unit][it.lo : it.hi]
            assert torch.linalg.norm(got - ref) <= 1e-5 * torch.linalg.norm(ref), (spec.host, it)
            sq = float(ref.double().square().sum())
            assert abs(float(store.sqnorms[it.piece]) - sq) <= 2e-5 * sq, (spec.host, it)
            pieces += 1
    mine = {it.piece for items in spec.emit_items for it in items}
    assert all(float(store.sqnorms[p]) == 0.0 for p in range(spec.num_pieces) if p not in mine)
    for u in range(spec.num_units):
        lo, hi = spec.owned(u)
        weights, tile = flat_unit(spec.model, u, state), store.resident_tile(u)
        assert torch.equal(tile[:lo], weights[:lo]) and torch.equal(tile[hi:], weights[hi:]), (spec.host, u)
    return pieces


def _check_groups(executors: list[GpuExecutor], hosts: int, per_host: int) -> None:
    """Each executor's groups: the statistics over every executor; its host's gradient sum only with several
    executors per host; the hosts' reduce-scatter only on each host's executor 0, and only over several hosts
    (a group of one member sums nothing: none is made)."""
    for ex in executors:
        world = ex.world
        assert world is not None and ex.engine.group is world.stats and world.stats.size == len(executors)
        assert (world.local is not None) == (per_host > 1)
        assert (world.hosts is not None) == (hosts > 1 and ex.rank == 0)
        assert world.hosts is None or world.hosts.size == hosts
        assert (ex.sink.hosts is not None) == (world.hosts is not None)


@pytest.mark.parametrize("hosts,per_host", [(2, 1), (2, 2), (3, 1), (1, 2)], ids=lambda v: str(v))
def test_hosts_executors_land_the_whole_batch_gradient_in_their_own_slices(rid: str, hosts: int, per_host: int) -> None:
    """Three hosts: host 2 owns none of the embedding (its tile is two hosts' slices), so it lands nothing of
    it. One host of two executors is the same set-up's one-host case: no hosts' group, no reduce-scatter."""
    model = tiny_hf(FAMILY, tied=False)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    base = make_spec(rid, spec_for(model, FAMILY), staging="fp32", staging_mode="resident", slab_params=1024)
    ids, labels = _batch()
    ref, want = _reference(rid, base, state, ids, labels)
    specs = [
        dataclasses.replace(base, run_id=f"{rid}h{h}", hosts=hosts, host=h, num_executors=per_host)
        for h in range(hosts)
    ]
    if hosts == 3:  # the case the docstring names is there
        assert not [it for items in specs[2].emit_items for it in items if it.unit == 0]
    with _stores(specs, state) as stores, _executors(specs) as executors:
        with pytest.raises(MegatrainError, match=f"a rendezvous for {len(executors) + 1} executors"):
            executors[0].open_world(len(executors) + 1, HOST)
        if len(executors) > 1:
            with pytest.raises(MegatrainError, match="host 0's executor 0 does"):
                executors[-1].open_world(len(executors), HOST)
        port = executors[0].open_world(len(executors), HOST)
        backends = on_threads([functools.partial(ex.join_world, HOST, port) for ex in executors])
        assert backends == ["gloo"] * len(executors)
        _check_groups(executors, hosts, per_host)
        reports = _steps(executors, ids, labels)
        pieces = sum(_check_host(st, want, state) for st in stores)
    assert pieces == base.num_pieces if hosts == 1 else pieces == specs[0].num_pieces
    assert sum(r.tokens for r in reports) == ref.tokens
    assert abs(sum(r.loss for r in reports) - ref.loss) <= 1e-5 * abs(ref.loss)
    assert all(r.tokens > 0 for r in reports) and len({r.tokens for r in reports}) > 1
