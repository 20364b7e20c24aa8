"""Progress bars for the slow first steps (GGUF conversion, weight loading, ``generate``).

A bar is drawn only where someone watches: on a terminal, or in a Jupyter kernel (as a
widget when ipywidgets is installed, else as the plain text bar, without tqdm's
"IProgress not found" warning, which transformers' import of ``tqdm.auto`` would print:
see :func:`silence_iprogress_warning`). On any other stream (a log file, a pipe, a server's
output) nothing is drawn; the same steps are logged on the ``inlinelm`` logger instead
(see docs/logging.md).
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
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


def silence_iprogress_warning() -> None:
    """In a Jupyter kernel, import ``tqdm.auto`` now with its "IProgress not found" warning
    (no ipywidgets) filtered out; elsewhere, or once imported, nothing.

    transformers imports ``tqdm.auto`` while the model loads, and it warns at that import,
    once per process. Call this before starting the thread that loads the model: the
    filter is set and restored around this one import (``warnings.catch_warnings`` is not
    thread-safe, so that thread must not run yet).
    """
    if "tqdm.auto" in sys.modules or not in_notebook(sys.stderr):
        return
    from tqdm.std import TqdmWarning

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="IProgress not found", category=TqdmWarning)
        import tqdm.auto  # noqa: F401  # NOTE: imported for its side effect: the one warning


def in_notebook(stream: TextIO) -> bool:
    """True when ``stream`` is a Jupyter kernel's output (ipykernel's ``OutStream``)."""
    return type(stream).__module__.startswith("ipykernel")


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # NOTE: a replaced or closed stream
        return False
