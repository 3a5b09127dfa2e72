"""Host-side compute and memory: the CPU AdamW, the workers' bulk kernels, page-level host memory and page-locking
for DMA."""
