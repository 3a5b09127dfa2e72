"""Data plane: POSIX shared memory, semaphores and CUDA IPC events.

Kept import-light (no torch) so the reaper process starts in milliseconds.
"""
