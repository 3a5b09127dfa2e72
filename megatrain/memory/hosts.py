"""A run over several hosts of one cluster, as the memory plan sizes one host of it (a run spans one host
today; the plan is for sizing a cluster). Host h owns slice h of every unit's tile in each fp32 plane (the
master weights, Adam's moments, and the gradients where the one-host rules give them a plane), the tile cut
into contiguous slices on the store's tile alignment; every host keeps the rest of the store whole (the
resident copy its executors stream from, the staging slabs, the control segment). The host that holds the
most holds the largest slice of every unit: that is what each host must have room for."""

from __future__ import annotations

from collections.abc import Callable

from megatrain.layout import TILE_ALIGN, StoreLayout

MAX_HOSTS = 64  # the most hosts the plan tries when it looks for the fewest that fit


def largest_slice(tile: int, hosts: int) -> int:
    """Elements of the largest of `hosts` contiguous slices of a unit's tile of `tile` elements, cut on
    TILE_ALIGN (the tile's padded length is a multiple of it): its blocks shared out as evenly as they go."""
    if hosts < 1:
        raise ValueError(f"a run has at least one host, got {hosts}")
    if tile % TILE_ALIGN:
        raise ValueError(f"a unit's tile of {tile} elements is not a multiple of {TILE_ALIGN}")
    return -(-(tile // TILE_ALIGN) // hosts) * TILE_ALIGN


def host_plane_elems(layout: StoreLayout, hosts: int) -> int:
    """Elements of one fp32 plane on each of `hosts` hosts: the largest slice of every unit (one host:
    the whole plane, layout.total)."""
    return sum(largest_slice(u.tile, hosts) for u in layout.units)


def fewest_hosts(fits: Callable[[int], bool], start: int, most: int = MAX_HOSTS) -> int | None:
    """The fewest hosts, from `start` up to `most`, on which `fits(hosts)` holds; None where none does."""
    return next((h for h in range(start, most + 1) if fits(h)), None)
