"""The gpu-executor actor: its step on the GPU, the streams that move weights in and gradients out, its threads, and
the reductions among executors."""
