#!/bin/bash
# GPU call 1: crosscheck, invariance (BI and stock), BI cost.
export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/torch/lib
B=./gpu/kvcredit; F=tests/fixtures/hf; L=$OUT/run1.log
{
echo "== crosscheck synthetic qwen2.5-0.5b (std 0.02)"; $B crosscheck --synthetic qwen2.5-0.5b --device cuda --dtype fp16,bf16
echo "== crosscheck fixtures"; for m in llama qwen2 gemma2; do $B crosscheck --model $F/$m --device cuda --dtype fp16,bf16 --tol 10 | sed "s/^/$m /"; done
echo "== invariance fixtures"
for m in llama qwen2 gemma2 gemma3 mistral_sw qwen3; do for d in fp16 bf16; do for p in batch_invariant stock; do
  $B invariance --model $F/$m --device cuda --dtype $d --trials 4 --max-len 200 --policy $p 2>&1 | sed "s/^/[$m $d $p] /"; echo "[$m $d $p] rc=${PIPESTATUS[0]}"
done; done; done
echo "== invariance synthetic"
for d in bf16 fp16; do for p in batch_invariant stock; do
  $B invariance --synthetic qwen2.5-0.5b --device cuda --dtype $d --policy $p --trials 3 --max-len 300 --decode-steps 8 2>&1 | sed "s/^/[syn $d $p] /"; echo "[syn $d $p] rc=${PIPESTATUS[0]}"
done; done
echo "== bi bench"; $B invariance --synthetic qwen2.5-0.5b --device cuda --dtype bf16 --bench --bench-only
} > $L 2>&1
grep -E "crosscheck|vs cpu|rc=|bitwise|max|decode|prefill|==" $L | head -150
