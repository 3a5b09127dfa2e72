"""How long a step takes, estimated before the run: the model's useful FLOPs per step (megatrain/flops.py) at
the device's rate, and the CPU AdamW's pass over every parameter at the host's memory bandwidth.

A GPU's rate is its nominal dense bf16 rate (by name, else from its SMs and compute capability) times the
share of it MegaTrain reached in BENCHMARKS.md; the CPU's is measured: a matmul of the model's own shape,
timed with the threads the executor would run, in short rounds of which the fastest count. Both are
estimates, and say how they were made.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

# BENCHMARKS.md: dense models at 16x4096 tokens per step reached 432-501 TFLOPS on an H100 and 479-587 on an
# H200, whose nominal dense bf16 rate is 989: 44-59 %. The mixtures of experts reached 161-205 TFLOPS by
# active parameters on an H100 (16-21 %): 0.38x a dense model's share.
GPU_EFFICIENCY = 0.45
MOE_FACTOR = 0.38
# A CPU step (the fp32 matmuls, attention, the loss, the elementwise work and the recompute of checkpointed
# layers) ran at 0.5-0.6 of a matmul of the model's shape timed beside it: four shapes (hidden 128-768, vocab
# 256-16384) on a 2-core machine.
CPU_EFFICIENCY = 0.55
# The CPU device's step has a cost per unit beside its FLOPs (the executor's calls, the staging, the unit's
# small kernels): 0.09 s a step for the 4 units of the bundled default, whose FLOPs take 0.04 s.
CPU_UNIT_S = 0.012
# The fused AdamW pass reads the fp32 weight and both moments and the bf16 gradient, and writes the three
# planes and the new bf16 weight over the gradient (BENCHMARKS.md: 28 bytes per parameter).
ADAM_BYTES_PER_PARAM = 28
# The 16-core hosts of BENCHMARKS.md's GPUs: a STREAM triad moves 126 GB/s counting the write's read.
BENCH_HOST_BYTES_PER_S = 126e9
# Of a step's compute, what comes after the last update could start (head and backward: 4 of the 6 N·D):
# with clipping no update starts before the backward's last gradient, and the next forward waits for them.
BACKWARD_SHARE = 2 / 3

# Nominal dense bf16 TFLOPS with fp32 accumulation (what torch's matmuls use), by the vendor's data sheets;
# matched on the device's name as a word (the more specific first).
GPUS: list[tuple[str, str, float]] = [
    ("GB200", r"GB200", 2500.0),
    ("B200", r"B200", 2250.0),
    ("B100", r"B100", 1750.0),
    ("H100 PCIe", r"H100 PCIE", 756.0),
    ("H100 NVL", r"H100 NVL", 835.0),
    ("GH200", r"GH200", 989.0),
    ("H200", r"H200", 989.0),
    ("H100", r"H100", 989.0),
    ("H800", r"H800", 989.0),
    ("H20", r"H20", 148.0),
    ("A100", r"A100", 312.0),
    ("A800", r"A800", 312.0),
    ("A30", r"A30", 165.0),
    ("A40", r"A40", 150.0),
    ("A10G", r"A10G", 70.0),
    ("A10", r"A10", 125.0),
    ("L40S", r"L40S", 362.0),
    ("L40", r"L40", 181.0),
    ("L4", r"L4", 121.0),
    ("RTX 6000 Ada", r"6000 ADA", 364.0),
    ("RTX A6000", r"A6000", 155.0),
    ("RTX A5000", r"A5000", 111.0),
    ("RTX A4000", r"A4000", 77.0),
    ("RTX 5090", r"5090", 209.5),
    ("RTX 5080", r"5080", 112.6),
    ("RTX 4090", r"4090", 165.2),
    ("RTX 4080", r"4080", 97.5),
    ("RTX 3090", r"3090", 71.0),
    ("RTX 3080", r"3080", 59.5),
    ("RTX 4070", r"4070", 58.3),
    ("RTX 3070", r"3070", 40.6),
    ("RTX 3060", r"3060", 25.5),
]
# Memory by the vendors' data sheets, in GB, for `plan --gpu NAME` without --gpu-gib; a part sold in several
# sizes has them all (the plan asks which, unless the name says it: "A100 80GB"). CUDA reports about 99 % of
# the number as GiB (an H100's 80 GB: 79.2 GiB).
GPU_MEMORY_GB: dict[str, tuple[int, ...]] = {
    "GB200": (186,),
    "B200": (180,),
    "B100": (180,),
    "H100 PCIe": (80,),
    "H100 NVL": (94,),
    "GH200": (96, 144),
    "H200": (141,),
    "H100": (80,),
    "H800": (80,),
    "H20": (96,),
    "A100": (40, 80),
    "A800": (40, 80),
    "A30": (24,),
    "A40": (48,),
    "A10G": (24,),
    "A10": (24,),
    "L40S": (48,),
    "L40": (48,),
    "L4": (24,),
    "RTX 6000 Ada": (48,),
    "RTX A6000": (48,),
    "RTX A5000": (24,),
    "RTX A4000": (16,),
    "RTX 5090": (32,),
    "RTX 5080": (16,),
    "RTX 4090": (24,),
    "RTX 4080": (16,),
    "RTX 3090": (24,),
    "RTX 3080": (10, 12),
    "RTX 4070": (12,),
    "RTX 3070": (8,),
    "RTX 3060": (8, 12),
}
REPORTED_GIB_PER_GB = 0.99

# Dense bf16 FLOPs per SM per clock by compute capability (fp32 accumulation; the consumer parts' rate where
# data-center and consumer chips differ): the fallback for a GPU not in the table. None: no bf16 tensor cores.
SM_FLOPS = {(8, 0): 2048, (9, 0): 4096, (10, 0): 7680}
OTHER_SM_FLOPS = 512  # compute capability 8.6, 8.9, 12.0: the GeForce rate
ASSUMED_CLOCK_HZ = 1.5e9  # where torch does not say the clock


@dataclass(frozen=True)
class Rate:
    """What a step's useful FLOPs run at on a device, and how that was found (for the output)."""

    flops_per_s: float
    how: str
    cpu: bool = False


@dataclass(frozen=True)
class Estimate:
    """A run's time: per step (compute, the Adam pass, their overlap) and over its steps and evaluations."""

    steps: int
    compute_s: float
    adam_s: float
    step_s: float
    eval_s: float | None  # None: not estimated

    @property
    def total_s(self) -> float:
        return self.steps * self.step_s + (self.eval_s or 0.0)


def _words(name: str) -> str:
    return " " + re.sub(r"[^A-Z0-9]+", " ", name.upper()) + " "


def gpu_by_name(name: str) -> tuple[str, float] | None:
    """(the table's name, nominal dense bf16 TFLOPS) of a GPU named `name` (a device name, or what a user
    typed: "H100", "rtx 4090", "A6000"); None when the table does not know it."""
    words = _words(name)
    for label, pattern, tflops in GPUS:
        if f" {pattern} " in words:
            return label, tflops
    return None


def gpu_memory_gb(name: str) -> tuple[int, ...]:
    """The memory sizes (GB, the data sheet's) of a GPU named `name` that the table knows: the one the name
    says ("A100 80GB", "a100-40gb") where it says one of them; () for a GPU the table does not know."""
    known = gpu_by_name(name)
    if known is None:
        return ()
    sizes = GPU_MEMORY_GB.get(known[0], ())
    said = re.search(r"(\d+)\s*GB?\b", name.upper())
    if said and int(said.group(1)) in sizes:
        return (int(said.group(1)),)
    return sizes


def gpu_rate(name: str, sms: int = 0, capability: tuple[int, int] = (0, 0), clock_hz: float = 0.0) -> Rate | None:
    """The rate of a step on a GPU: its nominal rate (by `name`, else from its SMs, compute capability and
    clock) times MegaTrain's measured share of it. None: nothing known of it, or no bf16 tensor cores."""
    known = gpu_by_name(name)
    if known is not None:
        label, tflops = known
        how = f"{label}: {tflops:g} TFLOPS nominal dense bf16"
    elif sms and capability[0] >= 8:
        per_sm = SM_FLOPS.get(capability, OTHER_SM_FLOPS)
        clock = clock_hz or ASSUMED_CLOCK_HZ
        tflops = sms * per_sm * clock / 1e12
        how = (
            f"{name}: {tflops:.0f} TFLOPS nominal dense bf16, from its {sms} SMs of compute capability "
            f"{capability[0]}.{capability[1]} at {clock / 1e9:.2f} GHz" + ("" if clock_hz else " (assumed)")
        )
    else:
        return None
    return Rate(
        tflops * 1e12 * GPU_EFFICIENCY, f"{how} x {GPU_EFFICIENCY:.0%}, MegaTrain's share of it in BENCHMARKS.md"
    )


def device_gpu_rate(device: object) -> Rate | None:
    """gpu_rate of a CUDA device, from torch's properties of it."""
    import torch

    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "clock_rate", 0) or 0
    return gpu_rate(props.name, props.multi_processor_count, (props.major, props.minor), clock_khz * 1e3)


@contextmanager
def _threads(n: int) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(n, 1))
    try:
        yield
    finally:
        torch.set_num_threads(before)


# The CPU's rate is timed in rounds of about ROUND_S (shorter than a scheduler's time slice, so that on a
# machine shared with other work some rounds run uninterrupted) for at least MIN_S and until the fastest
# BEST rounds agree within SETTLED, or MAX_S. A round is only ever slowed by other work, never sped up: the
# fastest rounds are the CPU's rate, their median is robust to one round's timer noise. Two plans made one
# after the other on a 2-core machine at a load of 15 said 16 and 251 GFLOPS with one 0.1 s window.
ROUND_S = 0.002
MIN_S = 0.1
MAX_S = 0.5
BEST = 3
SETTLED = 0.1
BUSY_SPREAD = 2.0  # the fastest round this many times the median one: other work shares the cores, said so


@dataclass(frozen=True)
class Timing:
    """A CPU's rate from rounds of timing: `rate` (best_rate of `rounds`, each a rate) and their spread."""

    rate: float
    rounds: tuple[float, ...]

    @property
    def busy(self) -> bool:
        """The rounds spread widely: other work took the cores in most of them."""
        return self.rate > BUSY_SPREAD * statistics.median(self.rounds)

    def spread(self, scale: float = 1e9) -> str:
        """The rounds' range in `scale` units (GFLOPS by default), for the plan's line."""
        return f"{min(self.rounds) / scale:.0f}-{max(self.rounds) / scale:.0f}"


def best_rate(rounds: list[float], best: int = BEST) -> float:
    """The median of the fastest `best` rounds' rates: the rate of the CPU when nothing else runs, robust to a
    round that other work slowed (most of them on a busy machine) and to one that timer noise sped up."""
    if not rounds:
        raise ValueError("best_rate of no rounds")
    return statistics.median(sorted(rounds)[-best:])


def settled(rounds: list[float], best: int = BEST, within: float = SETTLED) -> bool:
    """The fastest `best` rounds agree within `within` of the fastest: more rounds would not change the rate."""
    top = sorted(rounds)[-best:]
    return len(top) == best and top[0] >= (1 - within) * top[-1]


def timed_rounds(work: Callable[[], object], min_s: float = MIN_S, max_s: float = MAX_S) -> Timing:
    """Calls of `work` per second, in rounds of about ROUND_S after one warm-up call (its allocations, the
    thread pool's start): at least `min_s`, then until the fastest rounds settle or `max_s` has passed."""
    work()
    rounds: list[float] = []
    begin = time.perf_counter()
    while True:
        count, start = 0, time.perf_counter()
        while count < 1 or time.perf_counter() - start < ROUND_S:
            work()
            count += 1
        now = time.perf_counter()
        rounds.append(count / (now - start))
        if now - begin >= max_s or (now - begin >= min_s and settled(rounds)):
            return Timing(best_rate(rounds), tuple(rounds))


def matmul_timing(rows: int, inner: int, cols: int, dtype: object, threads: int) -> Timing:
    """FLOP/s of a (rows x inner) @ (inner x cols) matmul on this CPU with `threads` torch threads
    (timed_rounds)."""
    import torch

    a, b = torch.randn(rows, inner, dtype=dtype), torch.randn(inner, cols, dtype=dtype)
    flops = 2.0 * rows * inner * cols
    with _threads(threads):
        calls = timed_rounds(lambda: a @ b)
    return Timing(calls.rate * flops, tuple(r * flops for r in calls.rounds))


def cpu_rate(hidden: int, intermediate: int, tokens: int, dtype: object, threads: int) -> Rate:
    """The rate of a step on this CPU: a matmul of the model's MLP shape (tokens x hidden @ hidden x
    intermediate, each at most 2048-4096 wide so that it takes a fraction of a second), measured with the
    run's threads, times the share of it a step reaches. Where one thread is faster, the cores are busy with
    other work (each of the run's threads then waits for the slowest): the one thread's rate, said so; where
    the rounds spread widely, their range is said too."""
    rows, inner, cols = min(tokens, 2048), min(hidden, 4096), min(intermediate, 4096)
    timing = matmul_timing(rows, inner, cols, dtype, threads)
    used, notes = (f"{threads} threads" if threads > 1 else "1 thread"), []
    if threads > 1:
        one = matmul_timing(rows, inner, cols, dtype, 1)
        if one.rate > timing.rate:
            timing, used = one, "1 thread"
            notes.append(f"{threads} ran slower")
    if timing.busy:
        notes.append(f"its {len(timing.rounds)} timings ranged {timing.spread()} GFLOPS")
    if notes:
        used += f" ({'; '.join(notes)}: the cores are busy with other work now, the fastest timings count)"
    peak, name = timing.rate, str(dtype).removeprefix("torch.")
    return Rate(
        peak * CPU_EFFICIENCY,
        f"this CPU: a {name} matmul of the model's shape ({rows}x{inner} @ {inner}x{cols}) timed at "
        f"{peak / 1e9:.0f} GFLOPS with {used}, x {CPU_EFFICIENCY:.0%} for a whole step",
        cpu=True,
    )


def memory_bytes_per_s(threads: int, mib: int = 128) -> float:
    """This host's memory bandwidth: the best of three copies of `mib` MiB with `threads` torch threads,
    counting the bytes the memory moves (read, the write's read for ownership, write). Buffers larger than
    a CPU's last-level cache, so that it is memory's rate, not the cache's."""
    import torch

    n = mib * 2**20 // 4
    src, dst = torch.ones(n), torch.empty(n)
    with _threads(threads):
        dst.copy_(src)  # the pages' first touch
        best = math.inf
        for _ in range(3):
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
    return 3 * 4 * n / best


def step_estimate(
    flops: float, params: int, units: int, rate: Rate, host_bytes_per_s: float, steps: int, eval_flops: float | None
) -> Estimate:
    """A step's time from its useful FLOPs at `rate` and the Adam pass over `params` at the host's bandwidth.
    On a GPU the pass overlaps the next forward but not the backward it waits for; on the CPU device it
    shares the cores with the compute, which also pays a cost per unit. `eval_flops`: the evaluations' FLOPs
    over the whole run (None: not estimated)."""
    compute = flops / rate.flops_per_s
    adam = params * ADAM_BYTES_PER_PARAM / host_bytes_per_s
    cpu = compute + units * CPU_UNIT_S + adam
    step = cpu if rate.cpu else max(compute, BACKWARD_SHARE * compute + adam)
    evals = None if eval_flops is None else eval_flops / rate.flops_per_s
    return Estimate(steps, compute, adam, step, evals)


def duration(seconds: float) -> str:
    """A duration for a person: 40 s, 12 min, 3.4 hours, 18 days, 3.6 years."""
    if seconds < 90:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.2g} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} hours"
    if seconds < 365 * 86400:
        return f"{seconds / 86400:.0f} days"
    return f"{seconds / (365.25 * 86400):.3g} years"
