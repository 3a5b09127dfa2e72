"""What every figure of `megatrain-launch plot` shares: matplotlib on the Agg backend, and the steps a
figure draws as its title says them (plots.py, plots_moe.py)."""

from __future__ import annotations

from typing import Any

from megatrain.errors import ConfigError


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only); a ConfigError when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(
            "plotting needs matplotlib, which megatrain installs with itself but this Python "
            "lacks: pip install matplotlib"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def span(steps: list[int]) -> str:
    """'step 7' or 'steps 1-40': the steps a figure or panel draws."""
    first, last = min(steps), max(steps)
    return f"step {last}" if first == last else f"steps {first}-{last}"
