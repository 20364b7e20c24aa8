"""Ray, when installed, is imported here first and quietly: its import-time deprecation
warnings would fail collection (warnings are errors), whichever test module imports it."""

from __future__ import annotations

import contextlib
import warnings

with warnings.catch_warnings(), contextlib.suppress(ImportError):
    warnings.simplefilter("ignore")
    import ray.serve  # noqa: F401
