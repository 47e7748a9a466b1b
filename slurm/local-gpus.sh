#!/bin/bash
# Run a sharded campaign on the GPUs of one host, without Slurm: one process per shard with
# CUDA_VISIBLE_DEVICES set to its GPU, through the very scripts the Slurm array runs
# (campaign-array.sbatch per shard, then campaign-merge.sbatch: merge + analyze).
#
#   slurm/local-gpus.sh SPEC.toml N RUN_ROOT
#
# GPUS: comma-separated GPU indices to deal shards over (shard i gets GPU i mod count);
#   default: every GPU nvidia-smi lists, none on a machine without one (CPU specs).
#   GPUS=0 with N > 1 runs N shards side by side on one GPU.
# COMPARE: an unsharded run dir of the same spec; every Parquet file of the merged run must be
#   byte-identical to it (exit 1 naming the first that is not).
# KVCREDIT: the binary (default: `kvcredit` on PATH). Writes RUN_ROOT/local-gpus.json (shards,
# GPUs, wall seconds per shard and in all); logs in RUN_ROOT/logs/. Shards resume on a rerun.
set -euo pipefail
if [ $# -ne 3 ]; then
    sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
spec=$(realpath "$1")
shards=$2
root=$(realpath -m "$3")
case $shards in '' | *[!0-9]* | 0) echo "local-gpus.sh: N must be a positive integer, not '$shards'" >&2; exit 2 ;; esac
here=$(dirname "$(realpath "$0")")
kvcredit=${KVCREDIT:-$(command -v kvcredit || true)}
[ -n "$kvcredit" ] || { echo "local-gpus.sh: no kvcredit on PATH; set KVCREDIT" >&2; exit 2; }
kvcredit=$(realpath "$kvcredit")
if [ -z "${GPUS+set}" ]; then
    GPUS=$( (nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null || true) | paste -sd, -)
fi
IFS=, read -r -a gpus <<< "$GPUS"
mkdir -p "$root/logs"
# Seconds since a `date +%s%N` stamp, with millisecond digits.
secs() { local ms=$(( ($(date +%s%N) - $1) / 1000000 )); printf '%d.%03d' $((ms / 1000)) $((ms % 1000)); }

start=$(date +%s%N)
pids=()
for ((i = 0; i < shards; i++)); do
    (
        s=$(date +%s%N)
        if [ ${#gpus[@]} -gt 0 ]; then export CUDA_VISIBLE_DEVICES=${gpus[$((i % ${#gpus[@]}))]}; fi
        SLURM_ARRAY_TASK_ID=$i SPEC=$spec SHARDS=$shards RUN_ROOT=$root KVCREDIT=$kvcredit \
            bash "$here/campaign-array.sbatch"
        echo "$i $(secs "$s")" > "$root/logs/shard-$i.seconds"
    ) > "$root/logs/shard-$i.out" 2>&1 &
    pids+=($!)
done
failed=()
for ((i = 0; i < shards; i++)); do
    wait "${pids[$i]}" || failed+=("$i")
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "local-gpus.sh: shard(s) ${failed[*]} of $shards failed; see $root/logs/shard-<i>.out (a rerun resumes)" >&2
    exit 1
fi
SHARDS=$shards RUN_ROOT=$root KVCREDIT=$kvcredit bash "$here/campaign-merge.sbatch" > "$root/logs/merge.out" 2>&1 \
    || { echo "local-gpus.sh: merge or analyze failed; see $root/logs/merge.out" >&2; exit 1; }
wall=$(secs "$start")

per=$(for ((i = 0; i < shards; i++)); do cut -d' ' -f2 "$root/logs/shard-$i.seconds"; done | paste -sd, -)
printf '{"spec": "%s", "shards": %d, "gpus": "%s", "wall_seconds": %s, "shard_seconds": [%s]}\n' \
    "$spec" "$shards" "$GPUS" "$wall" "$per" > "$root/local-gpus.json.tmp"
mv "$root/local-gpus.json.tmp" "$root/local-gpus.json"

if [ -n "${COMPARE:-}" ]; then
    COMPARE=$(realpath "$COMPARE")
    n=0
    while IFS= read -r -d '' f; do
        rel=${f#"$COMPARE"/}
        cmp -s "$f" "$root/merged/$rel" || { echo "local-gpus.sh: $rel differs from $COMPARE" >&2; exit 1; }
        n=$((n + 1))
    done < <(find "$COMPARE" -name '*.parquet' -print0)
    m=$(find "$root/merged" -name '*.parquet' | wc -l)
    [ "$n" = "$m" ] || { echo "local-gpus.sh: $m Parquet files merged, $n in $COMPARE" >&2; exit 1; }
    echo "byte-identical: $n Parquet files of $root/merged equal $COMPARE's"
fi
echo "merged: $root/merged  report: $root/report  timing: $root/local-gpus.json"
