#!/bin/bash
# Submit a sharded campaign to Slurm: an N-task job array (one `campaign run --shard i/N` per
# task) and a merge + analyze job that starts only after every array task succeeded.
#
#   slurm/submit.sh SPEC.toml N RUN_ROOT [sbatch options for the array tasks...]
#
# e.g. slurm/submit.sh experiments/repro-1.5b-chat-bf16.toml 8 /shared/runs/repro --gres=gpu:1 -p gpu
#
# RUN_ROOT must be on a file system every node sees. Environment: KVCREDIT (the binary,
# default: `kvcredit` on PATH, resolved here), MERGE_SBATCH_ARGS (sbatch options for the merge
# job, e.g. a CPU partition), ANALYZE_ARGS (extra `kvcredit analyze` options). Prints the two
# job ids (array, merge) on one line. Logs: RUN_ROOT/logs/.
set -euo pipefail
if [ $# -lt 3 ]; then
    sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
spec=$(realpath "$1")
shards=$2
root=$(realpath -m "$3")
shift 3
case $shards in '' | *[!0-9]* | 0) echo "submit.sh: N must be a positive integer, not '$shards'" >&2; exit 2 ;; esac
here=$(dirname "$(realpath "$0")")
kvcredit=${KVCREDIT:-$(command -v kvcredit || true)}
[ -n "$kvcredit" ] || { echo "submit.sh: no kvcredit on PATH; set KVCREDIT" >&2; exit 2; }
kvcredit=$(realpath "$kvcredit")
mkdir -p "$root/logs"
export_vars="ALL,SPEC=$spec,SHARDS=$shards,RUN_ROOT=$root,KVCREDIT=$kvcredit,ANALYZE_ARGS=${ANALYZE_ARGS:-}"
array=$(sbatch --parsable --array="0-$((shards - 1))" --export="$export_vars" \
    --output="$root/logs/shard-%a.out" "$@" "$here/campaign-array.sbatch")
array=${array%%;*}
# shellcheck disable=SC2086
merge=$(sbatch --parsable --dependency="afterok:$array" --kill-on-invalid-dep=yes \
    --export="$export_vars" --output="$root/logs/merge.out" ${MERGE_SBATCH_ARGS:-} \
    "$here/campaign-merge.sbatch")
merge=${merge%%;*}
echo "$array $merge"
