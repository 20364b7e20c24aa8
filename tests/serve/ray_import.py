"""Ray Serve for the ``ray`` tests: imported quietly, or the module skipped (never under CI)."""

from __future__ import annotations

import os
import warnings

import pytest

try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # NOTE: Ray's own import-time deprecation warnings
        import ray
        from ray import serve
except ImportError:
    if os.environ.get("CI"):
        raise  # NOTE: make test installs the ray extra; CI must run these tests
    pytest.skip("ray is not installed (pip install 'inlinelm[ray]')", allow_module_level=True)

RAY_MARKS = [
    pytest.mark.ray,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]

__all__ = ["RAY_MARKS", "ray", "serve"]
