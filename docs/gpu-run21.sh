#!/bin/bash
# Issue 15 on the H200: page-locked snapshot copies, and the 1.5B campaign at scale.
#   bash docs/gpu-run21.sh cont       # 0.5B shape: HF eager + static-cache compiled generate, then
#                                     #   `kvcredit bench` with this binary and with the previous one
#                                     #   (gpu/bin/kvcredit-old.gz), in the same call
#   bash docs/gpu-run21.sh piece      # ship one piece of the 1.5B GGUF (gpu/ship/), once per piece
#   bash docs/gpu-run21.sh campaign   # experiments/bench-campaign-qwen15-scale.toml, `check`, then
#                                     #   `kvcredit bench` on the 1.5B shape (continuations at 32, 64)
#   bash docs/gpu-run21.sh final      # the final binary: 0.5B bench, `kvcredit invariance` (both policies)
# carry ["gpu"]: gpu/bin/kvcredit.gz (+ gpu/bin/kvcredit-old.gz, gpu/ship/). Results: $OUT/results.tgz.
set -u
export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/torch/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export KVCREDIT_HOME=/tmp/kvhome PYTHONUNBUFFERED=1
M=qwen2.5-coder-1.5b-instruct
SHA=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
B=/tmp/kvcredit
PY=/opt/torch/.venv/bin/python
if [ "$1" = piece ]; then mkdir -p /tmp/m && cp gpu/ship/* /tmp/m/ && ls /tmp/m | wc -l; exit 0; fi
gunzip -c gpu/bin/kvcredit.gz > $B && chmod +x $B
R=/tmp/R && mkdir -p $R
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; $B --version; } > $R/env.txt 2>&1
if [ "$1" = cont ]; then
  gunzip -c gpu/bin/kvcredit-old.gz > $B-old && chmod +x $B-old
  timeout 240 $PY benches/hf_generate.py --shape qwen2.5-0.5b --dtype bf16 --batches 64 \
    --static --no-loop --out $R/hf-0.5b.json > $R/hf-0.5b.txt 2>&1 || echo "hf: exit $?" >> $R/hf-0.5b.txt
  tail -3 $R/hf-0.5b.txt
  common="--synthetic qwen2.5-0.5b --dtype bf16 --device cuda --quiet --engine graph --hf $R/hf-0.5b.json"
  for run in new old; do
    mkdir -p $R/bench-0.5b-$run
    case $run in
      new) args="--batches 1,64 --cont-batches 32,64"; bin=$B ;;
      old) args="--batches 1,64 --cont-batches 32,64"; bin=$B-old ;;
    esac
    timeout 150 $bin bench $common $args --out $R/bench-0.5b-$run > $R/bench-0.5b-$run/bench.txt 2>&1 \
      || echo "bench $run: exit $?" >> $R/bench-0.5b-$run/bench.txt
    echo "== $run"; grep -A10 "^continuations\|^decode step" $R/bench-0.5b-$run/bench.txt | grep -v "^--"
  done
fi
if [ "$1" = campaign ]; then
  rm -rf $R/campaign
  f=$KVCREDIT_HOME/models/$M/$M.gguf
  mkdir -p "$(dirname $f)"
  cat /tmp/m/$M.gguf.part* > $f
  echo "$SHA  $f" | sha256sum -c || exit 1
  timeout 420 $B bench campaign experiments/bench-campaign-qwen15-scale.toml --out $R/campaign \
    --json $R/campaign.json 2>&1 | grep -v "^\s*$" | tail -12
  timeout 60 $B check $R/campaign 2>&1 | tail -1
  tar czf $OUT/results.tgz -C /tmp R
  mkdir -p $R/bench-1.5b
  timeout 150 $B bench --synthetic qwen2.5-1.5b --dtype bf16 --device cuda --quiet --engine graph \
    --batches 1,64 --cont-batches 32,64 --out $R/bench-1.5b \
    > $R/bench-1.5b/bench.txt 2>&1 || echo "bench: exit $?" >> $R/bench-1.5b/bench.txt
  grep -A4 "^continuations" $R/bench-1.5b/bench.txt
fi
if [ "$1" = final ]; then
  mkdir -p $R/final
  timeout 150 $B bench --synthetic qwen2.5-0.5b --dtype bf16 --device cuda --quiet --engine graph \
    --batches 1,64 --cont-batches 32,64 --out $R/final > $R/final/bench.txt 2>&1 || echo "bench: exit $?" >> $R/final/bench.txt
  grep -A12 "^decode step\|^continuations" $R/final/bench.txt | grep -v "^--"
  for p in batch_invariant stock; do
    timeout 150 $B invariance --synthetic qwen2.5-0.5b --device cuda --dtype bf16 --policy $p \
      --trials 3 --max-len 300 --decode-steps 8 > $R/final/invariance-$p.txt 2>&1 || echo "invariance $p: exit $?" >> $R/final/invariance-$p.txt
    tail -3 $R/final/invariance-$p.txt
  done
fi
tar czf $OUT/results.tgz -C /tmp R
