"""A run's memory, planned once: the machine (machine.py), the host terms and the store's sizes (host.py),
the GPU terms (gpu.py), and `plan_memory(...) -> MemoryPlan` with the staging mode it decides (plan.py).
Free of torch, numba and transformers at import, so that `megatrain-launch plan` needs none of them."""
