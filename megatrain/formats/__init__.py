"""Files on disk: the run's checkpoints, HF safetensors names and MXFP4 experts, and the export to HF directories."""
