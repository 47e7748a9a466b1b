#!/bin/bash
# Where a continuation step's time goes beyond the greedy decode step (#15 target 2), one H200
# call, no model shipped, 0.5B shape, bf16, stock, graph engine, batch 64, fused sampler:
#   ctx256  — the usual bench: decode step after 256 cached tokens; continuations resumed from a
#             256 + 128-token rollout (static capacity 512)
#   ctx512  — the decode step after 512 cached tokens (the continuations' capacity)
#   short   — continuations from a 128 + 16-token rollout (capacity 273, about the decode step's)
#   bash docs/gpu-run18.sh        # carry ["gpu"]: gpu/bin/kvcredit.gz
set -u
export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/torch/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=/tmp/kvcredit
R=/tmp/R && rm -rf $R && mkdir -p $R
gunzip -c gpu/bin/kvcredit.gz > $B && chmod +x $B
common="--synthetic qwen2.5-0.5b --dtype bf16 --device cuda --quiet --policy stock --engine graph --batches 64"
run() { local d=$1; shift; echo "== $d"; mkdir -p $R/$d
  timeout 150 $B bench $common --out $R/$d "$@" 2>&1 | grep -E "graph|ms/step|tok/s" | grep -v "^\s*$" | head -12; }
run ctx256 --prompt 256 --cont-batches 64
run ctx512 --prompt 512 --no-continuations
run short --prompt 128 --rollout-tokens 16 --cont-batches 64
tar czf $OUT/results.tgz -C /tmp R
