"""The model: a family's architecture without torch, its HF configs, its split into streamable units and the host
layout of its parameters."""
