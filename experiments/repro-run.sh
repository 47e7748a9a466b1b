#!/usr/bin/env bash
# Reproduce the seed table (issue 16): run every experiments/repro-*.toml campaign on a GPU,
# each into ROOT/<config-name>, then analyze them all into ROOT/report (one report.md with the
# side-by-side table and the seed's claims).
#
#   bash experiments/repro-run.sh KVCREDIT_BINARY ROOT
#
# Resumable: rerunning it resumes every run dir where it stopped (`campaign run` continues an
# existing run dir of the same spec; finished ones are left as they are), then re-analyzes.
# A campaign that fails does not stop the others; the report covers every run dir written
# (unfinished ones listed apart) and the script exits non-zero.
#
# Environment:
#   REPRO_SPECS      space-separated spec paths (default: experiments/repro-*.toml next to this
#                    script), e.g. tiny CPU specs for a test
#   REPRO_PARALLEL   campaigns run at once (default 1; on an H200 each campaign is
#                    latency-bound, so 3-4 raise throughput)
#   REPRO_DEVICE     passed as --device to every campaign (default: each spec's device)
#   REPRO_USD_PER_GPU_HOUR  passed to `analyze --usd-per-gpu-hour` (default: analyze's)
#   REPRO_REPS       bootstrap replicates of `analyze --reps` (default: analyze's)
# Logs: ROOT/logs/<config-name>.log.
set -euo pipefail

if [ $# -ne 2 ]; then
    echo "usage: $0 KVCREDIT_BINARY ROOT" >&2
    exit 2
fi
BIN=$1
ROOT=$2
if [ ! -x "$BIN" ]; then
    echo "$0: $BIN is not an executable kvcredit binary" >&2
    exit 2
fi
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ -n "${REPRO_SPECS:-}" ]; then
    read -r -a SPECS <<<"$REPRO_SPECS"
else
    SPECS=("$HERE"/repro-*.toml)
fi
PARALLEL=${REPRO_PARALLEL:-1}
case "$PARALLEL" in
'' | *[!0-9]* | 0)
    echo "$0: REPRO_PARALLEL must be a positive integer, got '$PARALLEL'" >&2
    exit 2
    ;;
esac

# Refuse a bad spec before any campaign starts.
"$BIN" campaign validate "${SPECS[@]}"

mkdir -p "$ROOT/logs"
NAMES=()
for s in "${SPECS[@]}"; do
    NAMES+=("$(basename "$s" .toml)")
done

run_one() {
    local spec=$1 name
    name=$(basename "$spec" .toml)
    local args=(campaign run "$spec" --out "$ROOT/$name" --quiet)
    if [ -n "${REPRO_DEVICE:-}" ]; then
        args+=(--device "$REPRO_DEVICE")
    fi
    echo "[$(date -u +%H:%M:%S)] start $name"
    if "$BIN" "${args[@]}" >"$ROOT/logs/$name.log" 2>&1; then
        echo "[$(date -u +%H:%M:%S)] done  $name"
    else
        echo "[$(date -u +%H:%M:%S)] FAILED $name (see $ROOT/logs/$name.log)" >&2
        return 1
    fi
}
export -f run_one
export BIN ROOT REPRO_DEVICE

# A campaign that fails (e.g. fp16 overflow) does not stop the others, nor the report of
# those that ran; the script then exits non-zero.
status=0
printf '%s\0' "${SPECS[@]}" | xargs -0 -n 1 -P "$PARALLEL" bash -c 'run_one "$1"' _ || status=$?

ANALYZE=(analyze --out "$ROOT/report")
if [ -n "${REPRO_USD_PER_GPU_HOUR:-}" ]; then
    ANALYZE+=(--usd-per-gpu-hour "$REPRO_USD_PER_GPU_HOUR")
fi
if [ -n "${REPRO_REPS:-}" ]; then
    ANALYZE+=(--reps "$REPRO_REPS")
fi
# Every run dir that exists (a campaign refused before its first write leaves none); analyze
# lists the unfinished ones apart.
DIRS=()
for n in "${NAMES[@]}"; do
    if [ -e "$ROOT/$n/manifest.json" ]; then
        DIRS+=("$ROOT/$n")
    fi
done
if [ ${#DIRS[@]} -eq 0 ]; then
    echo "$0: no campaign wrote a run dir; see $ROOT/logs" >&2
    exit 1
fi
"$BIN" "${ANALYZE[@]}" "${DIRS[@]}" || status=$?
if [ "$status" -ne 0 ]; then
    echo "$0: not every campaign finished (exit $status); see $ROOT/logs and $ROOT/report/report.md" >&2
    exit "$status"
fi
echo "report: $ROOT/report/report.md"
