"""A run over several hosts of one cluster (actors.num_hosts): the slices each host holds, and what the memory
plan counts for one host of it. Host h owns slice h of every unit's tile in each fp32 plane (the
master weights, Adam's moments, and the gradients where the one-host rules give them a plane), the tile cut
into contiguous slices on the store's tile alignment; every host keeps the rest of the store whole (the
resident copy its executors stream from, the staging slabs, the control segment). The host that holds the
most holds the largest slice of every unit: that is what each host must have room for; every host lays its
slices out at the same offsets. The pieces (a version counter and a squared norm each) are cut at the slices
too, so that each piece's gradient, update and checkpoint are one host's. The bytes each host sends a step
(network_bytes) are the plan's too: its time section says what network hides them."""

from __future__ import annotations

from collections.abc import Callable

from megatrain.model.layout import TILE_ALIGN, StoreLayout

MAX_HOSTS = 64  # the most hosts the plan tries when it looks for the fewest that fit


def largest_slice(tile: int, hosts: int) -> int:
    """Elements of the largest of `hosts` contiguous slices of a unit's tile of `tile` elements, cut on
    TILE_ALIGN (the tile's padded length is a multiple of it): its blocks shared out as evenly as they go."""
    if hosts < 1:
        raise ValueError(f"a run has at least one host, got {hosts}")
    if tile % TILE_ALIGN:
        raise ValueError(f"a unit's tile of {tile} elements is not a multiple of {TILE_ALIGN}")
    return -(-(tile // TILE_ALIGN) // hosts) * TILE_ALIGN


def host_slice(tile: int, hosts: int, host: int) -> tuple[int, int]:
    """Elements [lo, hi) of a unit's tile of `tile` elements that host `host` of `hosts` owns: slice `host` of
    largest_slice each (the last hosts' may be shorter, or empty for a tile smaller than the hosts' share)."""
    if not 0 <= host < hosts:
        raise ValueError(f"host {host} is not one of a run's {hosts} hosts")
    size = largest_slice(tile, hosts)
    lo = min(host * size, tile)
    return lo, min(lo + size, tile)


def slice_offsets(layout: StoreLayout, hosts: int) -> tuple[int, ...]:
    """Per unit, where its slice starts in a host's fp32 plane (elements): every host lays out the largest
    slice of each unit in unit order, so the offsets are the same on every host (one host: the units' own)."""
    out, off = [], 0
    for u in layout.units:
        out.append(off)
        off += largest_slice(u.tile, hosts)
    return tuple(out)


def unit_pieces(numel: int, tile: int, piece_elems: int, hosts: int) -> list[tuple[int, int]]:
    """A unit's pieces as [lo, hi) ranges of its first `numel` elements: consecutive ranges of at most
    `piece_elems`, cut at the hosts' slice boundaries too, so that every piece lies in one host's slice (its
    gradient, update and checkpoint are that host's). A unit has at least one piece (an empty one: (0, 0))."""
    cuts = [host_slice(tile, hosts, h) for h in range(hosts)] if hosts > 1 else [(0, max(numel, 1))]
    out = []
    for lo, hi in cuts:
        hi = min(hi, max(numel, 1))
        out += [(a, min(a + piece_elems, hi, numel)) for a in range(lo, hi, piece_elems)]
    return out or [(0, 0)]


def host_of(tile: int, hosts: int, element: int) -> int:
    """The host whose slice holds `element` of a unit's tile."""
    return min(element // largest_slice(tile, hosts), hosts - 1)


def host_plane_elems(layout: StoreLayout, hosts: int) -> int:
    """Elements of one fp32 plane on each of `hosts` hosts: the largest slice of every unit (one host:
    the whole plane, layout.total)."""
    return sum(largest_slice(u.tile, hosts) for u in layout.units)


def fewest_hosts(fits: Callable[[int], bool], start: int, most: int = MAX_HOSTS) -> int | None:
    """The fewest hosts, from `start` up to `most`, on which `fits(hosts)` holds; None where none does."""
    return next((h for h in range(start, most + 1) if fits(h)), None)


def network_bytes(layout: StoreLayout, hosts: int, cuda: bool = True) -> int:
    """The bytes each host sends between the hosts in a step, and receives as many, over `hosts` hosts: each
    unit's fp32 gradient reduce-scattered (a ring: H-1 of its H chunks; on the CPU device an all-reduce, twice
    that) and its own bf16 slice of each unit to every other host: 6 (H-1)/H bytes per parameter on GPUs."""
    if hosts < 2:
        return 0
    grad_bytes = 4 if cuda else 8
    return sum((hosts - 1) * largest_slice(u.tile, hosts) * (grad_bytes + 2) for u in layout.units)
