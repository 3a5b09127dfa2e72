"""`megatrain-launch plan --hosts H`: one host of a run over H hosts alike holds its slice of every unit's fp32
planes, cut on the store's tile alignment, and the rest of the store whole; a plan that does not fit names the
fewest hosts like its own that would fit it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from bench.presets import GPT_OSS_120B
from megatrain.ipc.shared.shm import HEADER_BYTES
from megatrain.launch.cli.main import main
from megatrain.launch.config import memplan
from megatrain.launch.config.tree import load_config
from megatrain.memory.hosts import MAX_HOSTS, fewest_hosts, host_plane_elems, largest_slice
from megatrain.model.layout import TILE_ALIGN

GIB = 2**30
ROOT = Path(__file__).resolve().parents[1]
GPT_OSS = ["model.family=gpt_oss", f"model.hf={json.dumps({**GPT_OSS_120B, 'num_hidden_layers': 36})}"]
SHAPE = [*GPT_OSS, "data.seq_len=4096", "data.batch_size=16"]
H200 = int(139.3 * GIB)
FP32 = ("params", "exp_avg", "exp_avg_sq", "grads")

# The GPT-OSS-120B shape on one 512 GiB host as the plan had it before it planned several hosts, byte for byte:
# on an H200 (clipping, the resident copy) and on the CPU device (slabs, a gradient plane); segments with their
# headers, as printed.
PLANE = 467316690944
BEFORE = {
    "cuda": (
        {"params": PLANE, "exp_avg": PLANE, "exp_avg_sq": PLANE, "staging": 6144, "resident": 233658347520},
        1650142038594,  # ctl: a word per piece for the banks of spare slots (none fit here)
    ),
    "cpu": (
        {"params": PLANE, "exp_avg": PLANE, "exp_avg_sq": PLANE, "grads": PLANE, "staging": 102818582528},
        1989342122129,
    ),
}


def _plan(device: str, hosts: int, *extra: str) -> memplan.MemPlan:
    cfg = load_config(None, [*SHAPE, f"engine.device={device}", *extra])
    cuda = device == "cuda"
    return memplan.make_plan(cfg, H200 if cuda else None, cuda, memplan.this_host(cfg, 512), hosts)


def _largest_slices(tile: int, hosts: int) -> int:
    """The largest of `hosts` contiguous runs of the tile's TILE_ALIGN blocks, as evenly as they go."""
    return max(len(run) for run in np.array_split(np.arange(tile // TILE_ALIGN), hosts)) * TILE_ALIGN


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("hosts", [1, 2, 3])
def test_each_host_holds_the_largest_slice_of_every_unit(device: str, hosts: int) -> None:
    """Every fp32 plane on a host is the sum over the layout's units of the unit's largest slice; the rest of
    the store is whole on every host. Several hosts take the resident copy whatever the device (each host's
    executors stream from their own copy; no host holds the whole fp32 weights slabs are packed from), also
    on the CPU device, which stages through slabs on one host."""
    plan, one = _plan(device, hosts), _plan(device, 1)
    layout = memplan.arch_of(load_config(None, SHAPE)).layout
    elems = sum(_largest_slices(u.tile, hosts) for u in layout.units)
    planes = [p for p in FP32 if f"shm: {p}" in plan.host]
    assert planes == list(FP32[: 3 if device == "cuda" or hosts > 1 else 4])
    for plane in planes:
        assert plan.host[f"shm: {plane}"] == elems * 4 + HEADER_BYTES
    assert ("shm: resident" in plan.host) == (device == "cuda" or hosts > 1)
    if device == "cuda" or hosts == 1:
        for key in ("shm: staging", "shm: resident"):
            assert plan.host.get(key) == one.host.get(key)
        # the pieces are cut at the slices too: a control-segment entry more per piece cut
        assert (plan.host["shm: ctl"] > one.host["shm: ctl"]) == (hosts > 1)
    if hosts == 3:  # not the whole plane over three: units whose blocks do not divide evenly round up
        assert elems > -(-layout.total // 3) and elems == host_plane_elems(layout, 3)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_one_host_is_the_plan_it_was(device: str) -> None:
    parts, total = BEFORE[device]
    plan = _plan(device, 1)
    shm = {k[len("shm: ") :]: v for k, v in plan.host.items() if k.startswith("shm: ")}  # headers included
    assert {k: v for k, v in shm.items() if k != "ctl"} == parts
    assert sum(plan.host.values()) == total


def test_a_units_slices_are_cut_on_the_tile_alignment() -> None:
    assert largest_slice(7 * TILE_ALIGN, 3) == 3 * TILE_ALIGN and largest_slice(TILE_ALIGN, 4) == TILE_ALIGN
    with pytest.raises(ValueError, match="at least one host"):
        largest_slice(TILE_ALIGN, 0)
    with pytest.raises(ValueError, match="not a multiple"):
        largest_slice(TILE_ALIGN + 1, 2)
    assert fewest_hosts(lambda h: h >= 4, 2) == 4 and fewest_hosts(lambda h: False, 2) is None
    assert fewest_hosts(lambda h: True, MAX_HOSTS + 1) is None


def _config(tmp_path) -> str:
    path = tmp_path / "gpt-oss-120b.yaml"
    hf = json.dumps({**GPT_OSS_120B, "num_hidden_layers": 36})
    path.write_text(f"model: {{family: gpt_oss, hf: {hf}}}\ndata: {{seq_len: 4096, batch_size: 16}}\n")
    return str(path)


def _run(capsys, *args: str) -> tuple[int, str]:
    code = main(["plan", *args, "--gpu-gib", "139.3", "--host-gib", "512"])
    return code, capsys.readouterr().out


def test_gpt_oss_120b_without_clipping_needs_five_hosts_of_512_gib_too(capsys, tmp_path) -> None:
    """Without clipping one host would take slabs where the resident copy does not fit; several hosts keep the
    copy whatever clipping says, so four hosts are 5 bytes per parameter each still, and five are needed."""
    path, no_clip = _config(tmp_path), "optim.max_grad_norm=0"
    code, out = _run(capsys, path, no_clip)
    assert code == 1 and "verdict: does not fit" in out and "staging slabs, clipping off" in out
    assert re.search(
        r"^on 5 hosts like that one \(--hosts 5, actors\.num_hosts=5\) each needs 486.16 GiB: fits", out, re.M
    )
    code, out = _run(capsys, path, no_clip, "--hosts", "4")
    assert code == 1 and "\nhost 0 of 4: 551.83 GiB needed" in out and "staging resident, clipping off" in out
    code, out = _run(capsys, path, no_clip, "--hosts", "5")
    assert code == 0 and "verdict for host 0 of 5: fits" in out
    assert out.startswith("memory plan of host 0 of 5: ") and "each checkpoint: the 5 hosts' parts of " in out


def test_slabs_are_refused_across_hosts(capsys, tmp_path) -> None:
    """Slabs are packed from the whole fp32 weights, which no host of several holds: a usage error."""
    code = main(["plan", _config(tmp_path), "ipc.staging=slabs", "--hosts", "2", "--host-gib", "512"])
    assert code == 2 and "actors.num_hosts 2 needs the resident copy" in capsys.readouterr().err


def test_the_levers_a_run_cannot_take_are_not_offered(capsys, tmp_path) -> None:
    """Two executors read the resident copy: the plan that does not fit offers no slabs (it did, and failed)."""
    code, out = _run(capsys, _config(tmp_path), "actors.num_gpus=2")
    assert code == 1 and "verdict: does not fit" in out and "ipc.staging=slabs" not in out


def test_gpt_oss_120b_with_the_defaults_needs_five_hosts_of_512_gib(capsys, tmp_path) -> None:
    """With clipping the resident copy is the rule: 12/H + 2 bytes per parameter, 5.0 on four hosts (551.8 GiB
    each, over the 501.8 GiB Ray's monitor leaves a run of 512 GiB), 4.4 on five."""
    path = _config(tmp_path)
    code, out = _run(capsys, path, "--hosts", "4")
    assert code == 1 and "\nhost 0 of 4: 551.83 GiB needed" in out and "verdict for host 0 of 4: does not fit" in out
    assert "\non 5 hosts like that one (--hosts 5, actors.num_hosts=5) each needs 486.16 GiB: fits" in out
    code, out = _run(capsys, path, "--hosts", "5")
    assert code == 0 and "verdict for host 0 of 5: fits" in out and "staging resident, clipping on" in out


def test_no_number_of_hosts_fits_what_each_keeps_whole(capsys) -> None:
    """A tiny model's processes alone exceed a 3 GiB host: no host count helps, and the plan says so."""
    code = main(["plan", str(ROOT / "examples" / "default.yaml"), "engine.device=cpu", "--host-gib", "3"])
    out = capsys.readouterr().out
    assert code == 1 and f"no number of hosts like that one fits it: on {MAX_HOSTS} (--hosts {MAX_HOSTS})" in out


@pytest.mark.parametrize("hosts", ["0", "-2", "x"])
def test_hosts_must_be_a_positive_integer(capsys, tmp_path, hosts: str) -> None:
    try:
        code = main(["plan", _config(tmp_path), "engine.device=cpu", "--hosts", hosts])
    except SystemExit as exc:  # argparse's refusal of what is not an integer
        code = exc.code
    assert code == 2 and "--hosts" in capsys.readouterr().err


def test_a_one_host_plan_with_slabs_names_the_hosts_with_the_resident_copy(capsys, tmp_path) -> None:
    """ipc.staging=slabs on one host that does not fit: the plan (exit 1), and the fewest hosts, which take
    the resident copy (slabs are refused across hosts, not in this host's plan)."""
    code, out = _run(capsys, _config(tmp_path), "ipc.staging=slabs")
    assert code == 1 and "staging slabs" in out and "verdict: does not fit" in out
    assert re.search(
        r"^on 5 hosts like that one \(--hosts 5, actors\.num_hosts=5\) each needs 486.16 GiB: fits", out, re.M
    )


def test_the_plan_over_hosts_says_what_each_host_sends_a_step(capsys, tmp_path) -> None:
    """The time section splits the batch over every host's executors and says each host's traffic: 6 (H-1)/H
    bytes per parameter (GPT-OSS-120B, 116.8B: about 561 GB a step on five hosts) and the speed that hides it."""
    code, out = _run(capsys, _config(tmp_path), "--hosts", "5", "--gpu", "H200")
    assert code == 0 and "on each of 5 executors (1 on each of 5 hosts)" in out
    sent = re.search(r"between the hosts: each sends ([\d,.]+) GB a step and receives as much", out)
    assert sent is not None and 560 <= float(sent.group(1).replace(",", "")) <= 570
    assert re.search(r"it hides behind the step at [\d,.]+ GB/s \([\d,]+ Gb/s\) each way or more", out)
