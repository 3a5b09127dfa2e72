"""find_stall between calls: no worker inside a call is 'nothing owed', except for a worker whose process
exists but stopped beating (the driver may wait on a call it never started, or on the reply to one it
ended just before it was stopped)."""

from __future__ import annotations

import os
import subprocess
import sys

from megatrain.ipc.monitor import find_stall
from megatrain.ipc.protocol import Store
from megatrain.ipc.protocol.store import BEAT, CALLS, PROGRESS
from tests.shm_fixtures import make_spec, owned


def test_a_stopped_worker_is_named_even_when_no_call_is_in_flight(rid: str, model_spec) -> None:
    with owned(Store.create(make_spec(rid, model_spec))) as store:
        roles = store.spec.roles()
        gone = subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
        ).stdout.strip()
        now = 1000.0
        for slot, _ in enumerate(roles[:3]):
            store.pids[slot] = os.getpid()  # alive
            store.role_words[slot, [BEAT, PROGRESS, CALLS]] = (now - 0.5, now - 30.0, 0)
        assert find_stall(store, 5.0, now) is None  # idle, every process beating: nothing is owed
        adam = roles.index("adam-updater")
        store.role_words[adam, BEAT] = now - 4.0
        assert find_stall(store, 5.0, now) is None  # not yet past the limits
        store.role_words[adam, BEAT] = now - 12.0
        verdict = find_stall(store, 5.0, now)
        assert verdict and "actor 'adam-updater'" in verdict and "stopped running" in verdict, verdict
        assert find_stall(store, 15.0, now) is None  # the stall timeout is a limit too
        store.pids[adam] = int(gone)  # a process that is gone is shutdown's business, not a stall
        assert find_stall(store, 5.0, now) is None
