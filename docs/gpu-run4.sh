#!/bin/bash
# The second 2026-12-01 H200 session. Models arrive in pieces under /tmp/m (earlier calls);
# the release binary, the hardening test binary and the gguf wheel came in the first call to /tmp/bin. Then
#   bash docs/gpu-run4.sh div    # divergence studies of four models + the HF reference
#   bash docs/gpu-run4.sh spec   # SpectrumKV grids of four models, TTFT, OOM and CUDA NaN checks
# Each step runs under a timeout so one failure still leaves the others' results; everything
# lands in one tarball under $OUT.
set -u
export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/torch/lib
export KVCREDIT_HOME=/tmp/kvhome PYTHONUNBUFFERED=1
B=/tmp/kvcredit
R=/tmp/res-$1
mkdir -p $R $KVCREDIT_HOME/models
[ -x $B ] || { gunzip -c /tmp/bin/kvcredit.gz > $B && chmod +x $B; }
[ -x /tmp/hardening ] || { gunzip -c /tmp/bin/hardening.gz > /tmp/hardening && chmod +x /tmp/hardening; }
MODELS="${MODELS:-smollm2-135m-instruct gemma-3-270m qwen2.5-coder-0.5b-instruct qwen2.5-coder-1.5b-instruct}"
for m in $MODELS; do
  f=$KVCREDIT_HOME/models/$m/$m.gguf
  if [ ! -e $f ] && ls /tmp/m/$m.gguf.part* >/dev/null 2>&1; then
    mkdir -p $(dirname $f) && cat /tmp/m/$m.gguf.part* > $f
  fi
done
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; $B --version; $B models list; } > $R/env.txt 2>&1
step() { local t=$1 name=$2; shift 2; local s=$(date +%s); timeout $t "$@" > $R/$name.log 2>&1; echo "$name: exit $? in $(( $(date +%s) - s )) s" | tee -a $R/steps.txt; }
END=$(( $(date +%s) + ${BUDGET_S:-560} ))
left() { echo $(( END - $(date +%s) )); }
declare -A SHORT=([smollm2-135m-instruct]=smollm2 [gemma-3-270m]=gemma3 [qwen2.5-coder-0.5b-instruct]=qwen05 [qwen2.5-coder-1.5b-instruct]=qwen15)
if [ "$1" = final ]; then
  # What the first two calls left: the 0.5B study resumes from its shards; Gemma-3 and the 1.5B
  # stopped at fp16 with non-finite logits (one-line error, nothing lost), so they run bf16 and
  # fp32; SpectrumKV grids of the four models; the OOM and CUDA NaN checks. All side by side.
  D=/tmp/res-div; mkdir -p $R/specs
  step 60 oom $B campaign run experiments/gpu-oom.toml --device cuda --allow-extrapolation --out $R/oom --quiet
  { echo "files after the OOM:"; ls -la $R/oom; cat $R/oom/manifest.json; } >> $R/oom.log 2>&1
  mkdir -p /work && ln -sfn $PWD /work/main
  step 120 nan-cuda /tmp/hardening non_finite --nocapture
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/bin/*.whl && export PYTHONPATH=/tmp/site
  hf() { local s=$1 m=$2; [ -e $D/div-$s/pairs.parquet ] && step $(left) hf-div-$s python3 benches/hf_divergence.py --gguf $KVCREDIT_HOME/models/$m/$m.gguf \
      --pairs $D/div-$s/pairs.parquet --dtypes fp16,fp32 --strategies greedy --problems 16 --out $D/div-$s/hf-div.json; }
  ( step $(left) div-smollm2 $B divergence run experiments/divergence-gpu-smollm2.toml --out $D/div-smollm2; hf smollm2 smollm2-135m-instruct ) &
  ( step $(left) div-qwen05 $B divergence run experiments/divergence-gpu-qwen05.toml --out $D/div-qwen05; hf qwen05 qwen2.5-coder-0.5b-instruct ) &
  for s in ${FP16_OVERFLOWS:-gemma3 qwen15}; do
    sed 's/^dtypes = .*/dtypes = ["bf16", "fp32"]/' experiments/divergence-gpu-$s.toml > $R/specs/divergence-gpu-$s.toml
    ( step $(left) div-$s $B divergence run $R/specs/divergence-gpu-$s.toml --out $D/div-$s ) &
  done
  for m in $MODELS; do
    O=$R/spectrum-$m; mkdir -p $O
    sed "s/^model = .*/model = \"$m\"/; s/^name = .*/name = \"spectrum-gpu-$m\"/" experiments/spectrum-gpu.toml > $O/spec.toml
    ( step 60 probe-$m $B spectrum probe $O/spec.toml --out $O
      step 150 ppl-$m $B spectrum ppl $O/spec.toml --out $O
      step $(left) niah-$m $B spectrum niah $O/spec.toml --out $O ) &
  done
  wait
  cat $R/steps.txt
  # At most 8 files of 16 MiB come back: tables without the per-problem shards, drift apart.
  tar czf $OUT/spectrum.tgz -C /tmp --exclude='res-final/res-*' res-final
  tar czf $OUT/div-tables.tgz -C /tmp --exclude=shards --exclude=drift.parquet res-div
  for s in smollm2 qwen05 gemma3 qwen15; do
    f=$D/div-$s/drift.parquet; [ -e $f ] && cp $f $OUT/drift-$s.parquet
    [ -e $D/div-$s/pairs.parquet ] || tar czf $OUT/shards-$s.tgz -C $D div-$s/shards div-$s/manifest.json 2>/dev/null
  done
  ls -la $OUT
  exit 0
elif [ "$1" = div ]; then
  # The timed study first, alone on the GPU; then the other three side by side.
  step 200 div-qwen05 $B divergence run experiments/divergence-gpu-qwen05.toml --out $R/div-qwen05
  for m in smollm2 gemma3 qwen15; do
    step 360 div-$m $B divergence run experiments/divergence-gpu-$m.toml --out $R/div-$m &
  done
  wait
else
  # Two-process TTFT (0.5B) alone on the GPU: tiered b = 0.5 vs FP16, unlimited and 1 Gbit/s, PDTrim.
  m=qwen2.5-coder-0.5b-instruct; O=$R/ttft; mkdir -p $O
  $B spectrum serve --model $m --dtype bf16 --device cuda --bind 127.0.0.1:7070 > $O/serve.log 2>&1 &
  SP=$!
  for i in $(seq 90); do (: > /dev/tcp/127.0.0.1/7070) 2>/dev/null && break; sleep 1; done
  step 60 ttft $B spectrum send --model $m --dtype bf16 --device cuda --context 4096 --b 0.5 --repeats 3 --out $O/ttft.parquet
  step 60 ttft-1gbit $B spectrum send --model $m --dtype bf16 --device cuda --context 4096 --b 0.5 --repeats 3 --bandwidth-mbps 1000 --out $O/ttft-1gbit.parquet
  step 60 ttft-pdtrim $B spectrum send --model $m --dtype bf16 --device cuda --context 4096 --b 0.5 --repeats 3 --tier-policy pdtrim --out $O/ttft-pdtrim.parquet
  kill $SP
  # Out of memory on the GPU (issue 18): one line naming the batch size, the run dir intact.
  step 60 oom $B campaign run experiments/gpu-oom.toml --device cuda --allow-extrapolation --out $R/oom --quiet
  echo "exit code and files after the OOM:" >> $R/oom.log; ls -la $R/oom >> $R/oom.log 2>&1; cat $R/oom/manifest.json >> $R/oom.log 2>&1
  # Planted NaN weights on every CUDA engine, graph replay included.
  mkdir -p /work && ln -sfn $PWD /work/main
  step 120 nan-cuda /tmp/hardening non_finite --nocapture
  # SpectrumKV grids, the four models side by side (a rerun resumes from the journals).
  for m in $MODELS; do
    O=$R/spectrum-$m; mkdir -p $O
    sed "s/^model = .*/model = \"$m\"/; s/^name = .*/name = \"spectrum-gpu-$m\"/" experiments/spectrum-gpu.toml > $O/spec.toml
    ( step 60 probe-$m $B spectrum probe $O/spec.toml --out $O
      step 150 ppl-$m $B spectrum ppl $O/spec.toml --out $O
      step 300 niah-$m $B spectrum niah $O/spec.toml --out $O ) &
  done
  # The Hugging Face cache-ON/OFF reference on the divergence runs' greedy problems.
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/bin/*.whl && export PYTHONPATH=/tmp/site
  for m in $MODELS; do
    s=${SHORT[$m]}
    [ -e /tmp/res-div/div-$s/pairs.parquet ] && step 300 hf-div-$s python3 benches/hf_divergence.py --gguf $KVCREDIT_HOME/models/$m/$m.gguf \
      --pairs /tmp/res-div/div-$s/pairs.parquet --dtypes fp16,fp32 --strategies greedy --problems 16 --out $R/hf-div-$s.json &
  done
  wait
fi
cat $R/steps.txt
tar czf $OUT/results-$1.tgz -C /tmp res-$1
ls -la $OUT
