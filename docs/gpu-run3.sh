#!/bin/bash
# The 2026-12-01 H200 session: models arrive in pieces under /tmp/m (earlier calls), then
#   bash docs/gpu-run3.sh a   # credit campaign (issue 11 columns) + divergence studies + HF reference
#   bash docs/gpu-run3.sh b   # SpectrumKV: probe, perplexity, NIAH, two-process TTFT
# Each step runs under a timeout so one failure still leaves the others' results; everything
# lands in one tarball under $OUT.
set -u
export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/torch/lib
export KVCREDIT_HOME=/tmp/kvhome PYTHONUNBUFFERED=1
B=/tmp/kvcredit
R=/tmp/res-$1
mkdir -p $R $KVCREDIT_HOME/models
if [ ! -x $B ]; then gunzip -c gpu/bin/kvcredit.gz > $B && chmod +x $B; fi
for m in smollm2-135m-instruct gemma-3-270m qwen2.5-coder-0.5b-instruct; do
  f=$KVCREDIT_HOME/models/$m/$m.gguf
  if [ ! -e $f ] && ls /tmp/m/$m.gguf.part* >/dev/null 2>&1; then
    mkdir -p $(dirname $f) && cat /tmp/m/$m.gguf.part* > $f
  fi
done
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; $B --version; $B models list; } > $R/env.txt 2>&1
step() { local t=$1 name=$2; shift 2; local s=$(date +%s); timeout $t "$@" > $R/$name.log 2>&1; echo "$name: exit $? in $(( $(date +%s) - s )) s" | tee -a $R/steps.txt; }
if [ "$1" = a ]; then
  step 170 campaign $B campaign run experiments/gpu-trust.toml --out $R/gpu-trust --quiet
  step 30 analyze $B analyze $R/gpu-trust
  step 30 check $B check $R/gpu-trust
  for m in qwen05 smollm2 gemma3 smollm2-bi; do
    step 110 div-$m $B divergence run experiments/divergence-gpu-$m.toml --out $R/div-$m --quiet
  done
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site gpu/bin/*.whl && export PYTHONPATH=/tmp/site
  step 60 hf-div python3 benches/hf_divergence.py --gguf $KVCREDIT_HOME/models/smollm2-135m-instruct/smollm2-135m-instruct.gguf \
    --pairs $R/div-smollm2/pairs.parquet --dtypes fp16,fp32 --problems 10 --strategies greedy --out $R/hf-div-smollm2.json
else
  for m in qwen2.5-coder-0.5b-instruct smollm2-135m-instruct gemma-3-270m; do
    O=$R/spectrum-$m; mkdir -p $O
    sed "s/^model = .*/model = \"$m\"/; s/^name = .*/name = \"spectrum-gpu-$m\"/" experiments/spectrum-gpu.toml > $O/spec.toml
    step 60 probe-$m $B spectrum probe $O/spec.toml --out $O --quiet
    step 60 ppl-$m $B spectrum ppl $O/spec.toml --out $O --quiet
    step 100 niah-$m $B spectrum niah $O/spec.toml --out $O --quiet
  done
  m=qwen2.5-coder-0.5b-instruct; O=$R/spectrum-$m
  $B spectrum serve --model $m --dtype bf16 --device cuda --bind 127.0.0.1:7070 --max-requests 18 > $O/serve.log 2>&1 &
  for i in $(seq 60); do (echo > /dev/tcp/127.0.0.1/7070) 2>/dev/null && break; sleep 1; done
  step 60 ttft $B spectrum send --model $m --dtype bf16 --device cuda --context 4096 --b 0.5 --repeats 3 --out $O/ttft.parquet
  step 60 ttft-1gbit $B spectrum send --model $m --dtype bf16 --device cuda --context 4096 --b 0.5 --repeats 3 --bandwidth-mbps 1000 --out $O/ttft-1gbit.parquet
  step 60 ttft-pdtrim $B spectrum send --model $m --dtype bf16 --device cuda --context 4096 --b 0.5 --repeats 3 --tier-policy pdtrim --out $O/ttft-pdtrim.parquet
  kill %1 2>/dev/null
fi
cat $R/steps.txt
tar czf $OUT/results-$1.tgz -C /tmp res-$1
ls -la $OUT
