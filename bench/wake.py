"""Wake-up latency of the store's two kinds of wait, between two processes, through the real Store code.

  python bench/wake.py [--rounds 200] [--out FILE]

  counter    Store.publish_version (the Adam updater) -> Store.wait_version (a packer, the executor): a
             polling loop whose naps grow from NAP_MIN_S to NAP_MAX_S (ipc/protocol/store.py), so a
             version is seen up to a nap late. publish_saved/wait_saved share the loop.
  semaphore  Store.post -> Store.wait on a slab semaphore: sem_timedwait, woken by sem_post at once.

The parent creates a tiny run's store (as the store owner does) and a spawned child attaches to it as a
worker; per round the child waits, the parent publishes after a random delay and notes time.monotonic()
just before, the child notes it right after its wait returns (CLOCK_MONOTONIC is one clock for every
process of a host): latency = return - publish. Delays are log-uniform from --min-delay-ms to
--max-delay-ms, so the waiter is caught in every phase of its backoff (the ramp of short naps, which
lasts about 1 ms, and the capped naps after a long wait, like the 60 ms that once became 102 ms).
Prints p50/p90/p99/max in microseconds per kind (all rounds, then by delay) and the waiter's CPU use
while blocked (what polling costs); --out FILE gets the same as JSON, with every sample.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import secrets
import signal
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from megatrain.config.ipc import IpcConfig  # noqa: E402
from megatrain.errors import AbortError  # noqa: E402
from megatrain.ipc.protocol import Store, StoreSpec, plan_store  # noqa: E402
from megatrain.ipc.protocol import store as store_mod  # noqa: E402
from megatrain.model.spec import ModelConfig, build_spec  # noqa: E402

KINDS = ("counter", "semaphore")
# The smallest model the planner takes: the store is a few hundred KiB, and only its ctl segment and
# semaphores matter here.
TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
UNIT = 1  # the first decoder layer: one piece, as a packer or the executor waits on it
SEM = "w_full0"  # starts at 0, as a slab the executor waits for before the packer fills it
ROLE = "packer-0"  # the waiter attaches as a worker, so its waits keep the role table's books as in a run
WAIT_TIMEOUT_S = 30.0  # a lost publish fails the bench in seconds, not after the run default of 10 minutes
RECV_TIMEOUT_S = 120.0  # the child's first message follows its imports (torch, transformers): seconds
DELAY_BUCKETS_MS = (1.0, 10.0)  # < 1 ms: the naps still ramp up; beyond: capped naps, short and long waits


# ---- the store ----------------------------------------------------------------------------------------------
def tiny_spec(run_id: str) -> StoreSpec:
    """A run's StoreSpec planned as the launcher does (CPU, slabs mode), for a two-layer model."""
    model = build_spec(ModelConfig(family="llama", hf=dict(TINY)))
    ipc = IpcConfig(weight_slabs=1, grad_slabs=1, wait_timeout_s=WAIT_TIMEOUT_S)
    return plan_store(
        run_id, model, "bf16", checkpoint_interval=2, num_packers=1, num_accumulators=1, ipc=ipc, cuda=False
    )


def piece_of(spec: StoreSpec) -> int:
    return spec.piece_range(UNIT).start


def publish(store: Store, kind: str, version: int) -> None:
    if kind == "counter":
        store.publish_version(piece_of(store.spec), version)
    else:
        store.post(SEM)


def wait(store: Store, kind: str, version: int) -> None:
    if kind == "counter":
        store.wait_version(UNIT, version, "bench: version", piece=piece_of(store.spec))
    else:
        store.wait(SEM, "bench: slab")


# ---- the waiter (child process) -------------------------------------------------------------------------------
def waiter(spec: StoreSpec, rounds: int, conn: Connection) -> None:
    """Per kind: 'ready', then after each wait its return time (which also says: waiting for the next
    round), then (CPU seconds, wall seconds) of the whole kind."""
    store = Store.attach(spec, (), role=ROLE)
    try:
        store.wait_version(UNIT, 0, "bench: warm-up")  # loads the compiled fence before anything is timed
        for kind in KINDS:
            conn.send("ready")
            cpu0, wall0 = time.process_time(), time.monotonic()
            for version in range(1, rounds + 1):
                wait(store, kind, version)
                conn.send(time.monotonic())
            conn.send((time.process_time() - cpu0, time.monotonic() - wall0))
    except AbortError:
        pass  # the parent failed and aborted the run; it reports why
    finally:
        store.close()


# ---- the publisher (parent) -----------------------------------------------------------------------------------
def recv(conn: Connection, proc: mp.process.BaseProcess, timeout_s: float = RECV_TIMEOUT_S) -> Any:
    """The child's next message; an error, not a hang, if it died or stopped talking."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(0.1):  # returns as soon as a message is there: no delay added to the pacing
        if not proc.is_alive():
            raise RuntimeError(f"waiter process exited with code {proc.exitcode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no message from the waiter in {timeout_s:g}s")
    try:
        return conn.recv()
    except EOFError:  # poll() is also true at EOF: the child closed its end by dying
        proc.join(1.0)
        raise RuntimeError(f"waiter process exited with code {proc.exitcode}") from None


def measure(
    store: Store, kind: str, rounds: int, delays_s: list[float], conn: Connection, proc: mp.process.BaseProcess
) -> dict[str, Any]:
    if recv(conn, proc) != "ready":
        raise RuntimeError("waiter out of step")
    latencies = []
    for version, delay in enumerate(delays_s, start=1):
        time.sleep(delay)  # the waiter has been waiting since its last message
        t_publish = time.monotonic()
        publish(store, kind, version)
        latencies.append(recv(conn, proc) - t_publish)
    cpu_s, wall_s = recv(conn, proc)
    return {"latency_s": latencies, "delay_s": delays_s, "waiter_cpu_s": cpu_s, "waiter_wall_s": wall_s}


def random_delays(rng: random.Random, rounds: int, lo_ms: float, hi_ms: float) -> list[float]:
    """Log-uniform: as many rounds in the nap ramp (below 1 ms) as per decade of long waits."""
    lo, hi = math.log(lo_ms * 1e-3), math.log(hi_ms * 1e-3)
    return [math.exp(rng.uniform(lo, hi)) for _ in range(rounds)]


def stop(proc: mp.process.BaseProcess) -> None:
    """Join the waiter; kill it if it does not end (it wakes within ipc.poll_s of an abort)."""
    if proc.pid is None:
        return  # never started
    proc.join(10.0)
    if proc.is_alive():
        proc.kill()
        proc.join()


def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = tiny_spec(args.run_id)
    rng = random.Random(args.seed)
    ctx = mp.get_context("spawn")  # a fresh interpreter, as a worker process is: nothing shared but the store
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=waiter, args=(spec, args.rounds, child_conn), name="wake-waiter", daemon=True)
    store = Store.create(spec)  # cleans up after itself if it fails half-way
    try:
        store.publish_version(piece_of(spec), 0)  # loads the compiled fence in this process too
        proc.start()
        child_conn.close()  # only the child's copy stays open, so its death shows as EOF
        results = {
            kind: measure(
                store,
                kind,
                args.rounds,
                random_delays(rng, args.rounds, args.min_delay_ms, args.max_delay_ms),
                conn,
                proc,
            )
            for kind in KINDS
        }
    except BaseException:
        store.abort("bench/wake.py failed")  # wakes the waiter out of whatever wait it is in
        raise
    finally:
        stop(proc)
        store.unlink()
        store.close()
    return results


# ---- report ---------------------------------------------------------------------------------------------------
def stats_us(latencies_s: list[float]) -> dict[str, float]:
    if not latencies_s:
        return {"n": 0}
    us = np.asarray(latencies_s) * 1e6
    p50, p90, p99 = np.percentile(us, [50, 90, 99])
    return {"n": len(us), "p50_us": float(p50), "p90_us": float(p90), "p99_us": float(p99), "max_us": float(us.max())}


def by_delay(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    edges = [0.0, *DELAY_BUCKETS_MS, math.inf]
    out = {}
    for lo, hi in zip(edges, edges[1:]):
        picked = [lat for lat, d in zip(result["latency_s"], result["delay_s"]) if lo <= d * 1e3 < hi]
        out[f"{lo:g}-{hi:g} ms"] = stats_us(picked)
    return out


def summarize(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    kinds = {}
    for kind, r in results.items():
        kinds[kind] = {
            **stats_us(r["latency_s"]),
            "by_delay": by_delay(r),
            "waiter_cpu_fraction": r["waiter_cpu_s"] / r["waiter_wall_s"],
            **r,
        }
    return {
        "run_id": args.run_id,
        "rounds": args.rounds,
        "delay_ms": [args.min_delay_ms, args.max_delay_ms],
        "nap_min_s": store_mod.NAP_MIN_S,
        "nap_max_s": store_mod.NAP_MAX_S,
        "cpus": os.cpu_count(),
        "kinds": kinds,
    }


def table(summary: dict[str, Any]) -> str:
    head = f"{'kind':<10} {'delay':>14} {'n':>5} {'p50 us':>9} {'p90 us':>9} {'p99 us':>9} {'max us':>9}"
    lines = [head, "-" * len(head)]
    for kind, k in summary["kinds"].items():
        for label, s in [("all", k), *k["by_delay"].items()]:
            cells = "".join(f" {s[f'{p}_us']:>9.0f}" for p in ("p50", "p90", "p99", "max")) if s["n"] else ""
            lines.append(f"{kind:<10} {label:>14} {s['n']:>5}{cells}")
        lines.append(f"{kind:<10} waiter CPU while blocked: {100 * k['waiter_cpu_fraction']:.1f}% of a core")
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=200, help="waits measured per kind")
    p.add_argument("--min-delay-ms", type=float, default=0.1)
    p.add_argument("--max-delay-ms", type=float, default=100.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-id", default="wake" + secrets.token_hex(4), help="names the store in /dev/shm")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.rounds < 1 or not 0 < args.min_delay_ms <= args.max_delay_ms:
        p.error("need --rounds >= 1 and 0 < --min-delay-ms <= --max-delay-ms")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    # SIGTERM (a killed benchmark) unwinds like Ctrl-C, so the finally blocks unlink the store.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    summary = summarize(run(args), args)
    print(table(summary))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
