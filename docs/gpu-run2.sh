#!/bin/bash
export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/torch/lib KVCREDIT_HOME=$PWD/gpu/home
B=./gpu/kvcredit
$B crosscheck --synthetic tiny-qwen2 --device cuda --dtype fp16,bf16 > $OUT/crosscheck-tiny.log 2>&1
$B campaign run experiments/gpu-bf16.toml --out $OUT/gpu-bf16 --quiet > $OUT/gpu-bf16.log 2>&1
$B analyze $OUT/gpu-bf16 >> $OUT/gpu-bf16.log 2>&1; $B check $OUT/gpu-bf16 >> $OUT/gpu-bf16.log 2>&1
$B eval gsm8k --model qwen2.5-coder-0.5b-instruct --limit 50 --batch-size 50 --device cuda --out $OUT/eval-qwen0.5b-fp32-cuda.parquet > $OUT/eval.log 2>&1
tail -3 $OUT/*.log
