"""Progress bars for the slow first steps (GGUF conversion, weight loading, ``generate``).

A bar is drawn only where someone watches: on a terminal, or in a Jupyter kernel (as a
widget when ipywidgets is installed, else as the plain text bar, without tqdm's
"IProgress not found" warning). On any other stream (a log file, a pipe, a server's
output) nothing is drawn; the same steps are logged on the ``inlinelm`` logger instead
(see docs/logging.md).
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any, TextIO


def progress_bar(
    total: float | None, desc: str, *, unit: str = "it", enabled: bool = True, **options: Any
) -> Any:
    """A tqdm bar over ``total`` units, disabled unless ``enabled`` and someone watches
    (see the module docstring). Use it as a context manager; ``update(n)`` advances it."""
    stream = sys.stderr
    notebook = in_notebook(stream)
    show = enabled and (notebook or _isatty(stream))
    if show and notebook and importlib.util.find_spec("ipywidgets") is not None:
        from tqdm.notebook import tqdm as notebook_tqdm

        return notebook_tqdm(total=total, desc=desc, unit=unit, **options)
    from tqdm.std import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not show, file=stream, **options)


def in_notebook(stream: TextIO) -> bool:
    """True when ``stream`` is a Jupyter kernel's output (ipykernel's ``OutStream``)."""
    return type(stream).__module__.startswith("ipykernel")


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # NOTE: a replaced or closed stream
        return False
