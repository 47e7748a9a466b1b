# The replica-floor study (docs/replica-floor.md): the noise table (which schedule dimensions
# change a row's bits, per shape and dtype; no model needed), then, once the 1.5B model has
# arrived, the floor campaigns at once (each is latency-bound): zero-shot and 8-shot CoT with
# the default engine, and the zero-shot one's first half of its problem groups with
# --engine eager.  Run: bash experiments/gpu-run.sh experiments/gpu-jobs/floor.sh setup|piece|poll
run_jobs() {
  mkdir -p $R/noise
  for shape in qwen2.5-1.5b qwen2.5-0.5b; do
    for dtype in bf16 fp16; do
      step noise-$shape-$dtype timeout 300 $B bench noise --synthetic $shape --dtype $dtype \
        --device cuda --pads 1,3,4,7,8,16,64,256 --out $R/noise
    done
  done
  wait_model qwen2.5-coder-1.5b-instruct
  campaign floor-qwen15-zs-bf16-eager experiments/floor-qwen15-zs-bf16.toml --engine eager --shard 0/2 &
  campaign floor-qwen15-zs-bf16 experiments/floor-qwen15-zs-bf16.toml &
  campaign floor-qwen15-cot-bf16 experiments/floor-qwen15-cot-bf16.toml &
  wait
}
