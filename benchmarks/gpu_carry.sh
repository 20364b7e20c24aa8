#!/usr/bin/env bash
# What one device call carries, against its 64 MiB limit: the working tree that travels
# (tracked files and untracked files git does not ignore) plus the ignored folders the
# check names in `carry` (.whl/ from gpu_wheels.sh, .kernels/ from gpu_kernels.sh).
#
#   benchmarks/gpu_carry.sh [CARRIED...]     # CARRIED defaults to .whl .kernels
#
# Prints each part in MiB and the total; exits 1 when the total passes 64 MiB.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
LIMIT=$((64 * 1048576))
[ $# -eq 0 ] && set -- .whl .kernels
mib() { awk -v s="$1" -v n="$2" 'BEGIN { printf "%8.2f MiB  %s\n", s / 1048576, n }'; }
tree=$(git ls-files -z --cached --others --exclude-standard |
    xargs -0 -r stat -c %s -- 2>/dev/null | awk '{ s += $1 } END { print s + 0 }')
mib "$tree" "working tree (tracked and untracked, not ignored)"
total=$tree
for path in "$@"; do
    size=0
    [ -e "$path" ] && size=$(du -sb "$path" | cut -f1)
    mib "$size" "$path"
    total=$((total + size))
done
mib "$total" "total (limit 64 MiB)"
if [ "$total" -gt "$LIMIT" ]; then
    echo "the device call cannot carry this: over 64 MiB" >&2
    exit 1
fi
