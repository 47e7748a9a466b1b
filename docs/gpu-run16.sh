#!/bin/bash
# The fused sampler against the ATen reference in a real campaign on the H200 (#15):
# experiments/bench-campaign-smollm2-16.toml timed by `kvcredit bench campaign` under
# KVCREDIT_SAMPLER=aten and then =fused, alone on the GPU; both runs pass `kvcredit check`, and
# their rollouts/pivots/continuations/estimates Parquet files must be byte-identical.
# The GGUF (98 MB) ships in two halves (`split -n 2 -d` into gpu/ship/, carry ["gpu"], with
# docs/runs and tests/fixtures moved aside so the tree fits):
#   bash docs/gpu-run16.sh piece      # first half: kept under /tmp/m
#   bash docs/gpu-run16.sh campaign   # second half, join, verify, run both, check, compare
set -u
export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/torch/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export KVCREDIT_HOME=/tmp/kvhome
M=smollm2-135m-instruct
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
B=/tmp/kvcredit
mkdir -p /tmp/m && cp gpu/ship/* /tmp/m/
ls -la /tmp/m
[ "$1" = campaign ] || exit 0
gunzip -c gpu/bin/kvcredit.gz > $B && chmod +x $B
f=$KVCREDIT_HOME/models/$M/$M.gguf
mkdir -p "$(dirname $f)"
cat /tmp/m/$M.gguf.part* > $f
echo "$SHA  $f" | sha256sum -c || exit 1
S=experiments/bench-campaign-smollm2-16.toml
R=/tmp/R && rm -rf $R && mkdir -p $R
for s in aten fused; do
  echo "== KVCREDIT_SAMPLER=$s"
  KVCREDIT_SAMPLER=$s timeout 240 $B bench campaign $S --out $R/$s --json $R/$s.json 2>&1 | grep -v "^\s*$" | tail -20
  echo "[$s] rc=${PIPESTATUS[0]}"
done
for s in aten fused; do echo "== check $s"; timeout 60 $B check $R/$s 2>&1 | tail -4; done
for t in rollouts pivots continuations estimates; do
  cmp -s $R/aten/$t.parquet $R/fused/$t.parquet && echo "$t.parquet: identical" || echo "$t.parquet: DIFFER"
done
tar czf $OUT/results.tgz -C /tmp R
