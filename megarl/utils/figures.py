"""Figures for PNG reports, drawn without pyplot: a :class:`matplotlib.figure.Figure` on its own Agg
canvas holds no global backend state (safe in a training process, a test, or a thread) and
needs no display."""
from __future__ import annotations

import io

WIDTH_IN = 12.0
"""Width of every report figure, inches."""
DPI = 100


def new_figure(height_in: float, width_in: float = WIDTH_IN):
    """An empty figure of ``width_in`` x ``height_in`` inches at :data:`DPI`, constrained layout."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width_in, height_in), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def png_bytes(fig) -> bytes:
    """``fig`` rendered as PNG, exactly figsize * dpi pixels (no ``bbox_inches="tight"``)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()
