"""What the shared memory of a run id on this node is, decided in one place for `megatrain-launch status`,
`megatrain-launch --cleanup`, the sweep every store owner makes before it creates a store, and a launch
that names its run id (train.run_id), so that all four say and do the same.

A run's entries in shm_dir (megatrain-<run id>-*, and its semaphores' sem.megatrain-<run id>-*) are
classified from its control segment's header and from the processes that hold them:

  live           this layout version, its store owner alive: a run; left alone
  dead           this layout version, its owner gone (exited, killed, a zombie, or its pid reused by
                 another process): removable; workers still mapping it keep their memory until they exit
  other version  another MegaTrain's layout: removable only while no process holds any of its entries
                 and the owner its header names is not alive
  unreadable     no control segment, one shorter than its header, or one without MegaTrain's magic:
                 removable only while no process holds any of its entries

A process holds an entry while it has it open or mapped, as /proc shows. A store being created has its
control segment open from the moment the file exists until it has mapped it, and writes the header only
after mapping it, so a store being made is held, never taken for a leftover. Entries of another user
cannot be removed by this one (the sticky /dev/shm) and their processes cannot be seen: said so, left.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from megatrain.errors import ConfigError
from megatrain.ipc.procs import live
from megatrain.ipc.shared.shm import LAYOUT_VERSION, MAGIC, PREFIX, read_header, remove_run, run_entries, unlink_entries

LIVE, DEAD, OTHER_VERSION, UNREADABLE = "live", "dead", "other version", "unreadable"
CLEANUP = "`megatrain-launch --cleanup` removes it (so does the next launch on this node)"


@dataclass(frozen=True)
class Found:
    """A run id's shared memory, classified."""

    run_id: str
    kind: str  # LIVE, DEAD, OTHER_VERSION or UNREADABLE
    entries: tuple[str, ...]
    owner_pid: int = 0  # from the header, where there is one
    version: int = 0  # the header's layout version, where there is one
    holders: tuple[int, ...] = ()  # live processes holding an entry (OTHER_VERSION and UNREADABLE only)
    problem: str = ""  # UNREADABLE: what is wrong with the control segment
    uid: int | None = None  # the entries' owner, where it is another user than this one

    @property
    def removable(self) -> bool:
        if self.uid is not None:
            return False
        return self.kind == DEAD or (self.kind in (OTHER_VERSION, UNREADABLE) and not self.holders)

    @property
    def state(self) -> str:
        """What it is, after a subject ('shared memory of run X', "train.run_id 'X'")."""
        if self.uid is not None:
            return f"belongs to another user (uid {self.uid}), whose processes this user cannot see"
        other = f"another MegaTrain version (layout version {self.version}; this one's is {LAYOUT_VERSION})"
        if self.kind == LIVE:
            return f"is in use by a live run (store owner pid {self.owner_pid})"
        if self.kind == DEAD:
            return f"is left over from a run whose store owner (pid {self.owner_pid}) is gone"
        if self.kind == OTHER_VERSION and self.holders:
            return f"is in use by a run of {other}, held by {_pids(self.holders)}"
        if self.kind == OTHER_VERSION:
            return f"is left over from a run of {other}; no process holds it"
        if self.holders:
            return f"is held by {_pids(self.holders)} but has {self.problem} (a run being created, or not MegaTrain's)"
        return f"is left over with {self.problem}; no process holds it"

    @property
    def action(self) -> str:
        """What to do about it."""
        if self.removable:
            return CLEANUP
        if self.uid is not None:
            return f"only uid {self.uid} or root can remove it"
        return "it is in use: nothing removes it while a process holds it"

    def line(self) -> str:
        """As `status` and `--cleanup` say it."""
        return f"shared memory of run {self.run_id} ({len(self.entries)} objects) {self.state}; {self.action}"

    def refusal(self) -> str:
        """As a launch naming this run id says it, refused."""
        return f"train.run_id '{self.run_id}' {self.state}; choose another, or leave it empty for a random one"


def _pids(pids: tuple[int, ...]) -> str:
    shown = ", ".join(str(p) for p in pids[:5])
    return ("pid " if len(pids) == 1 else "pids ") + shown + (f" and {len(pids) - 5} more" if len(pids) > 5 else "")


def classify(run_id: str, entries: list[str], shm_dir: str = "/dev/shm") -> Found:
    """The run id's entries in shm_dir (run_entries()), classified."""
    names = tuple(sorted(entries))
    uid = _other_user(names, shm_dir)
    if uid is not None:
        return Found(run_id, UNREADABLE, names, problem="files of another user", uid=uid)
    got = read_header(run_id, shm_dir)
    if got is not None and got[0] == MAGIC:
        _, version, hdr = got
        owner_live = live(hdr.owner_pid, hdr.owner_ticks)  # a zombie owner counts as dead: it cleans up nothing
        if version == LAYOUT_VERSION:
            return Found(run_id, LIVE if owner_live else DEAD, names, hdr.owner_pid, version)
        held = set(holders(names, shm_dir)) | ({hdr.owner_pid} if owner_live else set())
        return Found(run_id, OTHER_VERSION, names, hdr.owner_pid, version, tuple(sorted(held)))
    ctl = f"{PREFIX}{run_id}-ctl"
    problem = (
        "no control segment"
        if ctl not in names
        else "a control segment without MegaTrain's header"
        if got is not None
        else "a control segment shorter than its header"
    )
    return Found(run_id, UNREADABLE, names, holders=tuple(holders(names, shm_dir)), problem=problem)


def found(shm_dir: str = "/dev/shm") -> list[Found]:
    """Every run id's shared memory in shm_dir, classified, by run id."""
    return [classify(rid, entries, shm_dir) for rid, entries in sorted(run_entries(shm_dir).items())]


def _other_user(names: tuple[str, ...], shm_dir: str) -> int | None:
    """The owner of the first entry that belongs to another user (for a user other than root), else None."""
    me = os.geteuid()
    if me == 0:
        return None
    for name in names:
        try:
            uid = os.stat(os.path.join(shm_dir, name)).st_uid
        except OSError:
            continue  # gone meanwhile
        if uid != me:
            return uid
    return None


def holders(names: tuple[str, ...] | list[str], shm_dir: str = "/dev/shm") -> list[int]:
    """Pids of the processes that have any of the entries open or mapped. Read from /proc directly: psutil's
    mappings come from smaps, which walks the page tables of every mapping (seconds for a process that maps
    a large store). A process's descriptors are read before its mappings: a creator closes its descriptor
    only once it has mapped the file, so it is seen in one or the other. Processes this user may not read
    are skipped (they cannot open this user's 0600 entries either, root's aside)."""
    root = os.path.realpath(shm_dir)
    paths = {os.path.join(root, n) for n in names}
    out = []
    for pid in sorted(int(p) for p in os.listdir("/proc") if p.isdigit()):
        if _holds(pid, paths):
            out.append(pid)
    return out


def _holds(pid: int, paths: set[str]) -> bool:
    base = f"/proc/{pid}"
    try:
        for fd in os.listdir(f"{base}/fd"):
            try:
                if os.readlink(f"{base}/fd/{fd}") in paths:
                    return True
            except OSError:
                continue  # closed meanwhile
    except OSError:
        pass  # gone, or not this user's
    try:
        with open(f"{base}/maps") as maps:
            for row in maps:
                fields = row.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n") in paths:
                    return True
    except OSError:
        pass
    return False


def remove(f: Found, shm_dir: str = "/dev/shm", wait_s: float = 0.0) -> list[str]:
    """Remove a removable run id's entries (and, for a dead run of this version, what the CUDA driver left
    for its workers); what went."""
    if not f.removable:
        raise ValueError(f"shared memory of run {f.run_id} {f.state}: not removable")
    if f.kind == DEAD:
        return remove_run(f.run_id, list(f.entries), shm_dir, wait_s)
    return unlink_entries(list(f.entries), shm_dir)


def sweep(run_id: str | None = None, shm_dir: str = "/dev/shm") -> list[str]:
    """Remove every removable run id's entries (of `run_id` only, when given); what went."""
    removed = []
    for rid, entries in run_entries(shm_dir).items():
        if run_id is None or rid == run_id:
            f = classify(rid, entries, shm_dir)
            if f.removable:
                removed += remove(f, shm_dir)
    return removed


def check_run_id_free(run_id: str, shm_dir: str = "/dev/shm") -> None:
    """A launch naming its run id, before anything starts: refused where that id's shared memory is in use
    (in the words `status` uses); leftovers are no conflict (the store owner's sweep removes them)."""
    entries = run_entries(shm_dir).get(run_id)
    if entries:
        f = classify(run_id, entries, shm_dir)
        if not f.removable:
            raise ConfigError(f.refusal())
