#!/bin/bash
# The fused glue (kernels/glue.cu) and the shortened batch-invariant launches on the H200 (#15).
#   bash docs/gpu-run20.sh piece      # ship one half of the SmolLM2 GGUF (gpu/ship/), twice
#   bash docs/gpu-run20.sh campaign   # the real campaign, then the 0.5B shape with HF baselines
#   bash docs/gpu-run20.sh shapes     # the 1.5B shape, and `kvcredit invariance` on the 0.5B
# campaign: experiments/bench-campaign-smollm2-16.toml with the default (fused) glue; its
#   Parquet files must be byte-identical to docs/runs/h200-2026-12-03/campaign/fused/ (made
#   before the glue existed; carried as gpu/ref/). Then HF eager and static-cache compiled
#   `generate` and `kvcredit bench` (--profile 1,64) on the 0.5B shape, bf16, in the same call.
# shapes: `kvcredit bench` on the 1.5B shape; `kvcredit invariance` batch_invariant (must be
#   bitwise) and stock (the negative control) on the 0.5B shape.
# carry ["gpu"]: gpu/bin/kvcredit.gz (+ gpu/ship/ or gpu/ref/). Results: $OUT/results.tgz.
set -u
export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/torch/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export KVCREDIT_HOME=/tmp/kvhome PYTHONUNBUFFERED=1
M=smollm2-135m-instruct
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
B=/tmp/kvcredit
PY=/opt/torch/.venv/bin/python
if [ "$1" = piece ]; then mkdir -p /tmp/m && cp gpu/ship/* /tmp/m/ && ls -la /tmp/m; exit 0; fi
gunzip -c gpu/bin/kvcredit.gz > $B && chmod +x $B
R=/tmp/R && mkdir -p $R
if [ "$1" = campaign ]; then
  rm -rf $R/campaign
  f=$KVCREDIT_HOME/models/$M/$M.gguf
  mkdir -p "$(dirname $f)"
  cat /tmp/m/$M.gguf.part* > $f
  echo "$SHA  $f" | sha256sum -c || exit 1
  { date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; $B --version; } > $R/env.txt 2>&1
  timeout 200 $B bench campaign experiments/bench-campaign-smollm2-16.toml --out $R/campaign \
    --json $R/campaign.json 2>&1 | grep -v "^\s*$" | tail -9
  timeout 60 $B check $R/campaign 2>&1 | tail -1
  for t in rollouts pivots continuations estimates; do
    cmp -s gpu/ref/$t.parquet $R/campaign/$t.parquet && echo "$t.parquet: identical to the committed run" || echo "$t.parquet: DIFFERS from the committed run"
  done
  tar czf $OUT/results.tgz -C /tmp R
  timeout 200 $PY benches/hf_generate.py --shape qwen2.5-0.5b --dtype bf16 --batches 1,64 \
    --static --no-loop --out $R/hf-0.5b.json > $R/hf-0.5b.txt 2>&1 || echo "hf: exit $?" >> $R/hf-0.5b.txt
  tail -4 $R/hf-0.5b.txt
  mkdir -p $R/bench-0.5b
  timeout 170 $B bench --synthetic qwen2.5-0.5b --dtype bf16 --device cuda --quiet --engine graph \
    --batches 1,64 --cont-batches 32,64 --hf $R/hf-0.5b.json --profile 1,64 --out $R/bench-0.5b \
    > $R/bench-0.5b/bench.txt 2>&1 || echo "bench: exit $?" >> $R/bench-0.5b/bench.txt
  grep -v "^      \|trace:" $R/bench-0.5b/bench.txt
fi
if [ "$1" = shapes ]; then
  mkdir -p $R/bench-1.5b
  timeout 170 $B bench --synthetic qwen2.5-1.5b --dtype bf16 --device cuda --quiet --engine graph \
    --batches 1,64 --cont-batches 32,64 --out $R/bench-1.5b \
    > $R/bench-1.5b/bench.txt 2>&1 || echo "bench: exit $?" >> $R/bench-1.5b/bench.txt
  cat $R/bench-1.5b/bench.txt
  for p in batch_invariant stock; do
    timeout 150 $B invariance --synthetic qwen2.5-0.5b --device cuda --dtype bf16 --policy $p \
      --trials 3 --max-len 300 --decode-steps 8 > $R/invariance-$p.txt 2>&1 || echo "invariance $p: exit $?" >> $R/invariance-$p.txt
    cat $R/invariance-$p.txt
  done
fi
tar czf $OUT/results.tgz -C /tmp R
