#!/bin/bash
# Background fingerprint hashing in rollouts, and the replica at the exact pass's batch size, on
# the H200 (#15): experiments/bench-campaign-smollm2-16.toml again (its Parquet files must be
# byte-identical to docs/runs/h200-2026-12-03/campaign/fused/, carried as gpu/ref/), then
# experiments/bench-campaign-smollm2-16-r32.toml, with and without --refill; `kvcredit check` on each.
# Ships the GGUF like docs/gpu-run16.sh (two halves, carry ["gpu"]):
#   bash docs/gpu-run17.sh piece
#   bash docs/gpu-run17.sh campaign
set -u
export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/torch/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export KVCREDIT_HOME=/tmp/kvhome
M=smollm2-135m-instruct
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
B=/tmp/kvcredit
mkdir -p /tmp/m && cp gpu/ship/* /tmp/m/
[ "$1" = campaign ] || { ls -la /tmp/m; exit 0; }
gunzip -c gpu/bin/kvcredit.gz > $B && chmod +x $B
f=$KVCREDIT_HOME/models/$M/$M.gguf
mkdir -p "$(dirname $f)"
cat /tmp/m/$M.gguf.part* > $f
echo "$SHA  $f" | sha256sum -c || exit 1
R=/tmp/R && rm -rf $R && mkdir -p $R
run() {  # name spec [flags]
  local d=$1 s=$2; shift 2
  echo "== $d"
  timeout 200 $B bench campaign experiments/$s.toml --out $R/$d --json $R/$d.json "$@" 2>&1 | grep -v "^\s*$" | tail -9
  timeout 60 $B check $R/$d 2>&1 | tail -1
}
run again bench-campaign-smollm2-16
for t in rollouts pivots continuations estimates; do
  cmp -s gpu/ref/$t.parquet $R/again/$t.parquet && echo "$t.parquet: identical to the committed run" || echo "$t.parquet: DIFFERS from the committed run"
done
run r32 bench-campaign-smollm2-16-r32
run r32-refill bench-campaign-smollm2-16-r32 --refill
tar czf $OUT/results.tgz -C /tmp R
