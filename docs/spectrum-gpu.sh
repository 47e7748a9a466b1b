#!/bin/bash
# SpectrumKV on one H200: probe + gate, perplexity grid, 4,096-token NIAH grid, and the
# two-process TTFT at b = 0.5 vs FP16 (unlimited link and 1 Gbit/s). One model per call:
#   bash docs/spectrum-gpu.sh qwen2.5-coder-0.5b-instruct
# Needs ./gpu/kvcredit (README "Running on a GPU") and the model under $KVCREDIT_HOME/models.
set -u
export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/torch/lib KVCREDIT_HOME=$PWD/gpu/home
B=./gpu/kvcredit
M=${1:-qwen2.5-coder-0.5b-instruct}
O=$OUT/spectrum-$M
mkdir -p $O
sed "s/^model = .*/model = \"$M\"/; s/^name = .*/name = \"spectrum-gpu-$M\"/" experiments/spectrum-gpu.toml > $O/spec.toml
# ppl and niah print one line per finished window/haystack and resume from
# $O/{ppl,niah}.rows.jsonl when rerun after a timeout.
$B spectrum probe $O/spec.toml --out $O > $O/probe.log 2>&1
$B spectrum ppl $O/spec.toml --out $O > $O/ppl.log 2>&1
$B spectrum niah $O/spec.toml --out $O > $O/niah.log 2>&1
# TTFT: decode worker and prefill worker are two processes over loopback. The worker serves
# without a request cap; this script stops it (by its pid) after the last send.
$B spectrum serve --model $M --dtype bf16 --device cuda --bind 127.0.0.1:7070 > $O/serve.log 2>&1 &
SERVE=$!
# (an empty connection: the worker does not count it as a request)
until (: > /dev/tcp/127.0.0.1/7070) 2>/dev/null; do sleep 1; done
for link in "" "--bandwidth-mbps 1000"; do
  tag=${link:+-1gbit}
  $B spectrum send --model $M --dtype bf16 --device cuda --context 4096 --b 0.5 --repeats 3 $link \
    --out $O/ttft${tag:-}.parquet > $O/ttft${tag:-}.log 2>&1
done
$B spectrum send --model $M --dtype bf16 --device cuda --context 4096 --b 0.5 --repeats 3 \
  --tier-policy pdtrim --out $O/ttft-pdtrim.parquet > $O/ttft-pdtrim.log 2>&1
kill $SERVE
wait $SERVE
tail -n 30 $O/*.log
