"""The state of the units the GPU holds (engine.gpu_optimizer) leaves the host: once the executor has it, their
pages in the store's fp32 planes go back to the system, and they come back only while a checkpoint's writer or
the final export reads them, with the state bit for bit. Measured on the segments' files (their blocks)."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

from megatrain.actors.executor.gpustate import STATE, GpuState
from megatrain.config.optim import OptimConfig
from megatrain.host.hostmem import ranges_without
from megatrain.ipc.protocol import Store
from megatrain.launch.cli.main import main
from tests.shm_fixtures import SHM, make_spec, owned

STEP = 3  # the state after this many steps: the store's versions, and the checkpoint written back


def held_blocks(rid: str, part: str) -> int:
    """Bytes the system holds for a plane's segment (every shard of it)."""
    stem = f"megatrain-{rid}-{part}"  # its first shard, then stem.1, stem.2, ...
    return sum(os.stat(f"{SHM}/{n}").st_blocks * 512 for n in os.listdir(SHM) if n.split(".")[0] == stem)


def filled(store: Store) -> dict[str, dict[int, np.ndarray]]:
    """Every unit's state drawn into the planes, the versions at STEP; a copy of the held units' state."""
    gen = np.random.default_rng(7)
    for part in STATE:
        plane = store.plane(part)
        plane[:] = gen.standard_normal(plane.size, dtype=np.float32)
        if part == "exp_avg_sq":
            np.abs(plane, out=plane)
    for unit in range(store.spec.num_units):
        store.refresh_resident(unit)
    store.publish_versions(STEP)
    return {part: {u: store.tile(part, u).copy() for u in store.spec.on_gpu} for part in STATE}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_held_state_leaves_the_host_and_comes_back_for_a_checkpoint(rid: str, model_spec, dtype) -> None:
    staging = "fp32" if dtype == torch.float32 else "bf16"  # the compute dtype's
    spec = dataclasses.replace(make_spec(rid, model_spec, staging, staging_mode="resident"), gpu_units=2)
    with owned(Store.create(spec)) as store:
        before = filled(store)
        full = {part: held_blocks(rid, part) for part in STATE}
        held = {part: sum(store.tile(part, u).nbytes for u in spec.on_gpu) for part in STATE}
        assert all(interior(store.tile("params", u)).size > 4 * 1024 for u in spec.on_gpu)  # pages to give back
        state = GpuState(store, torch.device("cpu"), dtype, OptimConfig())
        state.load(STEP)
        for part in STATE:  # every page wholly inside a held tile given back (tiles start on a page)
            assert full[part] - held_blocks(rid, part) >= held[part] - 4096 * len(spec.on_gpu), part
            assert not any(interior(store.tile(part, u)).any() for u in spec.on_gpu), part
        assert state.released >= sum(held.values()) - 3 * 4096 * len(spec.on_gpu)
        for unit in spec.on_gpu:  # the device holds what the planes held, and serves the weights in its dtype
            for part, tensor in zip(STATE, state.state[unit], strict=True):
                assert np.array_equal(tensor.numpy(), before[part][unit]), (part, unit)
            assert torch.equal(state.weights(unit), torch.from_numpy(before["params"][unit]).to(dtype))

        state.flush(STEP)  # a checkpoint of the state after STEP: written back, the pages in again
        assert all(held_blocks(rid, part) == full[part] for part in STATE)
        same(store, before)
        state.settle()  # the writer has not taken them: kept
        same(store, before)
        for unit in spec.on_gpu:
            for piece, _, _ in spec.pieces_of(unit):
                store.publish_saved(piece, STEP)
        state.settle()  # taken: given back again
        assert all(full[part] - held_blocks(rid, part) >= held[part] - 4096 * len(spec.on_gpu) for part in STATE)

        state.flush(None)  # the final weights: written back though nothing changed since the checkpoint
        same(store, before)


def interior(tile: np.ndarray) -> np.ndarray:
    """The elements of a tile on pages wholly inside it (those given back)."""
    first = -tile.ctypes.data % 4096 // 4
    last = (tile.ctypes.data + tile.nbytes) // 4096 * 4096
    return tile[first : max(first, (last - tile.ctypes.data) // 4)]


def same(store: Store, before: dict[str, dict[int, np.ndarray]]) -> None:
    for part, tiles in before.items():
        for unit, tile in tiles.items():
            assert np.array_equal(store.tile(part, unit), tile), (part, unit)


def test_the_page_in_leaves_out_the_held_tiles() -> None:
    whole = np.zeros(100, np.uint8)
    base = whole.ctypes.data
    holes = [whole[60:70], whole[10:20]]
    assert ranges_without(whole, holes) == [(base, 10), (base + 20, 40), (base + 70, 30)]
    assert ranges_without(whole, [whole[:100]]) == []
    assert ranges_without(whole, []) == [(base, 100)]


def test_the_plan_says_how_much_of_the_host_s_state_the_gpu_takes(capsys, tmp_path) -> None:
    """`plan` on a named GPU: the held units' fp32 state (12 bytes a parameter: weights and both moments) leaves
    the host's planes, and when it is there again."""
    hf = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4, "num_attention_heads": 8,
          "num_key_value_heads": 8, "vocab_size": 32000}  # fmt: skip
    path = tmp_path / "small.yaml"
    path.write_text(f"model: {{family: llama, hf: {json.dumps(hf)}}}\ndata: {{seq_len: 1024, batch_size: 4}}\n")
    code = main(["plan", str(path), "engine.gpu_optimizer=2", "--gpu", "H200", "--host-gib", "64"])
    out = capsys.readouterr().out
    held = 32000 * 1024 + 4 * 1024**2 + 3 * 1024 * 2816 + 2 * 1024  # the embedding, then layer 0
    assert code == 0, out
    gib = f"{held * 12 / 2**30:.1f} GiB"
    assert f"their fp32 state ({gib}) leaves the host's planes once the GPU has it" in out, out
