"""Which kernel orthogonalises a matrix: :func:`launch_path`, the one place that decides it.

The engine's layout (``engine/layout.assign``, ``build_fused``), the FSDP2 owners (through the
layout) and the compile registry's variant keys (:mod:`.compile`) all ask it.
"""

from __future__ import annotations

from typing import Literal

from .common import MAX_ROWS
from .panel import panelled

Path = Literal["program", "panel"]


def launch_path(use_gram: bool, rows: int, cols: int) -> Path | None:
    """The Triton path of a matrix (or launch group) with smaller side ``rows`` and larger ``cols``.

    ``"program"``: one program per matrix (:func:`.newton_schulz.orthogonalize_blocks`), smaller side up to
    :data:`.common.MAX_ROWS`; ``"panel"``: such a matrix too long for one program under the Gram
    iteration (:func:`.panel.orthogonalize_panels`); ``None``: the torch path (batched cuBLAS), for every
    larger matrix.
    """
    if rows <= MAX_ROWS:
        return "panel" if panelled(use_gram, rows, cols) else "program"
    return None
