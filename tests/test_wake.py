"""bench/wake.py end to end with a handful of rounds: it runs, reports both kinds of wait, and leaves
nothing in /dev/shm. Latency values are not checked: speed is the benchmark's business, not a test's."""

from __future__ import annotations

import json
import math
import os
import secrets
import subprocess
import sys
from pathlib import Path

from tests.shm_fixtures import SHM, remove_all

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 5


def test_wake_bench_reports_both_kinds_and_cleans_up(tmp_path: Path) -> None:
    run_id = "testwake" + secrets.token_hex(4)  # our own name, so a failed run can still be found and removed
    out = tmp_path / "wake.json"
    before = set(os.listdir(SHM))
    try:
        # Short delays keep the test at the bench's start-up cost (two interpreters importing torch).
        proc = subprocess.run(
            [
                sys.executable,
                str(ROOT / "bench" / "wake.py"),
                "--rounds",
                str(ROUNDS),
                "--max-delay-ms",
                "5",
                "--run-id",
                run_id,
                "--out",
                str(out),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        new = sorted(n for n in set(os.listdir(SHM)) - before if run_id in n)
    finally:
        remove_all(run_id)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert new == [], f"bench left {new} in {SHM}"

    summary = json.loads(out.read_text())
    assert summary["run_id"] == run_id and summary["rounds"] == ROUNDS
    assert set(summary["kinds"]) == {"counter", "semaphore"}
    for kind, k in summary["kinds"].items():
        assert k["n"] == ROUNDS and len(k["latency_s"]) == ROUNDS, kind
        assert sum(b["n"] for b in k["by_delay"].values()) == ROUNDS, kind
        values = [*k["latency_s"], k["p50_us"], k["p90_us"], k["p99_us"], k["max_us"]]
        assert all(math.isfinite(v) for v in values), (kind, values)
        assert kind in proc.stdout
