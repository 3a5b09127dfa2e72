"""The memory plan (megatrain/memory/): each term against a count made here from the HF model itself, for a
small dense and a small mixture-of-experts model; the staging mode it decides; and the store owner's
admission, which refuses a plan its node has no room for, with the numbers."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from megatrain.actors.store_owner import StoreOwner
from megatrain.config.ipc import IpcConfig
from megatrain.errors import ResourceError
from megatrain.ipc.messages import StoreRequest
from megatrain.ipc.protocol.ctl import CTL_FIXED, PIECE_BYTES
from megatrain.ipc.shared import shm
from megatrain.ipc.shared.shm import HEADER_BYTES
from megatrain.memory.gpu import GPU_STATE, gpu_state_bytes
from megatrain.memory.machine import Machine
from megatrain.memory.plan import CHECKPOINT_HEADROOM_FRACTION, MemoryPlan, RunShape, plan_memory, staging_mode
from megatrain.model.arch import arch_of_spec
from megatrain.model.layout import TILE_ALIGN
from megatrain.model.spec import ModelConfig, build_spec
from megatrain.step.engine import EngineConfig
from tests.harness import tiny_config_dict
from tests.model_fixtures import tiny_hf
from tests.shm_fixtures import leftovers

GIB = 2**30
LAYERS, BATCH, SEQ = 4, 2, 64
# every size explicit: the plan's GPU part keeps them (K 1 and a last block of 1: three pinned checkpoints)
SIZES = dict(
    checkpoint_interval=1,
    last_block_layers=1,
    chunk_sequences=0,
    loss_chunk_tokens=512,
    lean_layers=0,
    offload_checkpoints=True,
    token_tile=0,
)
ENGINE = EngineConfig(device="cuda", compute_dtype="bf16", **SIZES)
BIG = Machine(ram=512 * GIB, total=512 * GIB, shm=512 * GIB, threshold=0.95)


def shape(**over) -> RunShape:
    base = dict(
        engine=ENGINE,
        executors=1,
        batch=BATCH,
        seq=SEQ,
        clip=True,
        staging="auto",
        weight_slabs=4,
        grad_slabs=3,
        slab_params=0,
        num_packers=1,
        num_accumulators=1,
        saves_checkpoints=True,
        launcher=True,
        private_ray=True,
        header_bytes=HEADER_BYTES,
        ctl_fixed=CTL_FIXED,
        ctl_piece_bytes=PIECE_BYTES,
    )
    return RunShape(**{**base, **over})


class Counted:
    """A model's sizes counted from its HF modules: the units' elements (the embedding, each decoder layer,
    and the rest: the final norm and an untied LM head), their tiles, and the hidden and vocab sizes."""

    def __init__(self, family: str):
        self.config = ModelConfig(family=family, hf=tiny_config_dict(family, tied=False, layers=LAYERS))
        model = tiny_hf(family, tied=False, layers=LAYERS)
        embed = model.model.embed_tokens.weight.numel()
        layers = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
        rest = sum(p.numel() for p in model.parameters()) - embed - sum(layers)
        self.units = [embed, *layers, rest]
        self.layer = max(layers)
        self.total = sum(-(-n // TILE_ALIGN) * TILE_ALIGN for n in self.units)
        self.hidden, self.vocab = model.config.hidden_size, model.config.vocab_size

    def pieces(self, slab: int) -> int:
        return sum(-(-n // slab) for n in self.units)

    def plan(self, machine: Machine = BIG, gpu_free: int | None = 80 * GIB, **over) -> MemoryPlan:
        return plan_memory(arch_of_spec(build_spec(self.config)), shape(**over), machine, gpu_free)


@pytest.fixture(params=["llama", "qwen2_moe"], scope="module")
def counted(request) -> Counted:
    return Counted(request.param)


def test_the_store_parts_are_the_planes_the_copy_and_the_control_segment(counted: Counted) -> None:
    """Resident with clipping: three fp32 planes, the bf16 copy (which also takes the gradients), a page of
    staging; each segment with its header in the host terms."""
    plan = counted.plan()
    slab = -(-counted.layer // TILE_ALIGN) * TILE_ALIGN  # a decoder layer's, aligned
    assert plan.staging_mode == "resident"
    assert plan.store_parts == {
        "params": 4 * counted.total,
        "exp_avg": 4 * counted.total,
        "exp_avg_sq": 4 * counted.total,
        "staging": TILE_ALIGN,
        "resident": 2 * counted.total,
        "ctl": CTL_FIXED + PIECE_BYTES * counted.pieces(slab),
    }
    assert {k: v for k, v in plan.host.items() if k.startswith("shm:")} == {
        f"shm: {k}": v + HEADER_BYTES for k, v in plan.store_parts.items()
    }


def test_slabs_with_clipping_add_the_gradient_plane_and_the_slabs(counted: Counted) -> None:
    plan = counted.plan(staging="slabs")
    slab = -(-counted.layer // TILE_ALIGN) * TILE_ALIGN
    assert plan.store_parts["grads"] == 4 * counted.total and "resident" not in plan.store_parts
    assert plan.store_parts["staging"] == slab * (4 * 2 + 3 * 4)  # four bf16 weight slabs, three fp32 gradient


def test_the_processes_page_tables_and_pinned_checkpoints(counted: Counted) -> None:
    plan = counted.plan(staging="slabs")
    processes = {k: v for k, v in plan.host.items() if k.startswith(("process:", "node: the", "node: Ray"))}
    cpu = int(0.7 * GIB)
    assert processes == {
        "process: gpu-executor": int(1.4 * GIB),
        "process: store-owner": cpu,
        "process: reaper": int(0.01 * GIB),
        "process: adam-updater": cpu,
        "process: packer-0": cpu,
        "process: grad-accumulator-0": cpu,
        "process: checkpoint-writer": cpu,
        "node: the launcher (megatrain-launch)": GIB,
        "node: Ray's own processes (raylet, GCS, agents)": int(0.8 * GIB),
    }
    assert plan.reserve == int(1.4 * GIB) + 5 * cpu + int(0.01 * GIB)
    assert plan.host["node: page tables of the store's mappings"] == 3 * sum(plan.store_parts.values()) // 512
    # K 1, a last block of 1: the three blocks below it keep a [batch, seq, hidden] bf16 checkpoint each
    assert plan.pinned == (LAYERS - 1) * BATCH * SEQ * counted.hidden * 2


def test_the_room_for_pinned_checkpoints_is_the_limit_less_the_rest_and_a_headroom(counted: Counted) -> None:
    plan = counted.plan()
    headroom = int(BIG.limit * CHECKPOINT_HEADROOM_FRACTION)
    assert plan.pinned_room == BIG.limit - headroom - (sum(plan.host.values()) - plan.pinned)
    assert counted.plan(engine=dataclasses.replace(ENGINE, device="cpu")).pinned_room is None


def test_the_gpu_terms_at_explicit_sizes(counted: Counted) -> None:
    plan = counted.plan(executors=2)
    gpu = plan.gpu.terms
    assert plan.gpu.sizes.loss_chunk_tokens == 512 and plan.gpu.sizes.last_block_layers == 1
    assert gpu["weight buffers (3 layers, compute dtype)"] == 3 * counted.layer * 2  # prefetch 2, bf16
    assert gpu["loss chunk logits (512 tokens x vocab, 12 B each)"] == 512 * counted.vocab * 12
    assert gpu["largest unit's weights and fp32 gradient"] == max(counted.units) * (2 + 4)
    assert gpu["activation checkpoints on the GPU (0)"] == 0  # all three pinned in host RAM
    assert gpu["fp32 gradients awaiting the executors' sum"] == 3 * counted.layer * 4  # two credits and one reducing
    assert plan.gpu_limit == 80 * GIB and plan.gpu_fits()
    # auto holds every unit's optimizer, shared between the two GPUs: the GPU holding most is the term
    held = plan.gpu.gpu_units
    assert held == len(counted.units)
    assert gpu[GPU_STATE] == gpu_state_bytes(arch_of_spec(build_spec(counted.config)).layout, held, 2, executors=2)
    pinned = dataclasses.replace(ENGINE, gpu_optimizer=held)  # one byte less would only make auto hold fewer
    assert not counted.plan(executors=2, engine=pinned, gpu_free=sum(gpu.values()) - 1).gpu_fits()


def test_the_staging_mode_is_decided_on_the_stores_node() -> None:
    counted = Counted("llama")
    arch = arch_of_spec(build_spec(counted.config))
    need = counted.plan(clip=False, staging="resident", gpu_free=None).least_host()
    fits = Machine(ram=need, total=need, shm=need, threshold=None)
    short = dataclasses.replace(fits, ram=need - 1)
    assert staging_mode(arch, shape(clip=False), fits) == "resident"
    assert staging_mode(arch, shape(clip=False), short) == "slabs"
    assert staging_mode(arch, shape(clip=True), short) == "resident"  # its copy holds the gradients: the least
    assert staging_mode(arch, shape(executors=2, clip=False), short) == "resident"  # several executors read it
    assert staging_mode(arch, shape(engine=dataclasses.replace(ENGINE, device="cpu")), fits) == "slabs"
    assert staging_mode(arch, shape(staging="slabs"), fits) == "slabs"


def test_the_owner_refuses_a_plan_its_node_has_no_room_for_naming_the_numbers(rid: str, monkeypatch) -> None:
    """The driver's plan was made for another node; the owner's admission re-checks it on its own and refuses
    with what the store and the processes need, and what the node has."""
    counted = Counted("llama")
    plan = counted.plan(gpu_free=None)
    avail = sum(plan.store_parts.values()) + len(plan.store_parts) * HEADER_BYTES + plan.reserve - 1
    monkeypatch.setattr(shm, "mem_available_bytes", lambda: avail)
    request = StoreRequest(
        run_id=rid,
        model=counted.config,
        no_decay_1d=True,
        clip=True,
        engine=ENGINE,
        num_packers=1,
        num_accumulators=1,
        ipc=IpcConfig(),
        batch_shape=(BATCH, SEQ),
        memory=plan,
    )
    owner = StoreOwner()
    try:
        with pytest.raises(ResourceError) as refused:
            owner.create(request)
    finally:
        owner.shutdown()
    said = str(refused.value)
    assert f"but only {shm.gib(avail)} is available" in said
    assert f"processes, after the store {shm.gib(plan.reserve)}" in said
    assert f"resident {shm.gib(plan.store_parts['resident'])}" in said
    assert not leftovers(rid)


def test_the_memory_package_imports_no_torch_numba_or_transformers() -> None:
    code = (
        "import sys, megatrain.memory.plan, megatrain.memory.host, megatrain.memory.machine; "
        "print([m for m in ('torch', 'numba', 'transformers') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_plan_travels_to_the_owner() -> None:
    """Frozen and picklable: the driver sends it in the store request."""
    import pickle

    plan = Counted("llama").plan()
    again = pickle.loads(pickle.dumps(plan))
    assert again == plan and again.staging_mode == plan.staging_mode
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.staging_mode = "slabs"  # type: ignore[misc]
