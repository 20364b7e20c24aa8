"""Install the torch build for this machine into the running Python (``make`` calls it).

A plain ``pip install torch`` on Linux takes the CUDA build from PyPI (several GB), which a
CPU-only machine does not want. So:

- a machine with ``nvidia-smi``: ``torch`` from the default index (the CUDA build);
- any other machine: the pinned version from PyTorch's CPU wheel index, when that index
  answers; else the pinned version from the default index (pip's configured index and
  find-links: on machines without internet that is a local wheel folder with the CPU build).

``--dry-run`` prints the one pip command it would run and why, and installs nothing.
``TORCH_SPEC`` (environment) overrides the requirement, e.g. ``TORCH_SPEC=torch==2.6.0``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request

PINNED = "torch==2.13.0"
"""The version the suite is tested with (its CPU build)."""

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PROBE_TIMEOUT_S = 5.0


def index_answers(index: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether ``index`` serves a torch project page (a quick GET, no retries)."""
    try:
        with urllib.request.urlopen(f"{index.rstrip('/')}/torch/", timeout=timeout) as reply:
            return bool(200 <= reply.status < 300)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def choose(*, has_gpu: bool, cpu_index: str, spec: str | None) -> tuple[list[str], str]:
    """The pip arguments to run and why."""
    if has_gpu:
        requirement = spec or "torch"
        return ["install", requirement], "nvidia-smi found: the CUDA build from the default index"
    requirement = spec or PINNED
    if index_answers(cpu_index):
        return (
            ["install", "--index-url", cpu_index, requirement],
            f"no nvidia-smi: the CPU build from {cpu_index}",
        )
    return (
        ["install", requirement],
        f"no nvidia-smi and {cpu_index} does not answer: {requirement} from the default index "
        "(a local wheel folder on machines without internet)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    parser.add_argument("--cpu-index", default=CPU_INDEX, help="PyTorch's CPU wheel index")
    parser.add_argument(
        "--gpu", choices=("auto", "yes", "no"), default="auto", help="treat as a CUDA machine"
    )
    args = parser.parse_args(argv)
    has_gpu = shutil.which("nvidia-smi") is not None if args.gpu == "auto" else args.gpu == "yes"
    pip_args, why = choose(
        has_gpu=has_gpu, cpu_index=args.cpu_index, spec=os.environ.get("TORCH_SPEC") or None
    )
    command = [sys.executable, "-m", "pip", "install", "-q", *pip_args[1:]]
    print(f"install_torch: {why}", file=sys.stderr)
    print(" ".join(command))
    if args.dry_run:
        return 0
    return subprocess.run(command, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
