# SpectrumKV on one GPU: masked rows under the graph engine (synthetic 1.5B shape, then the
# real 1.5B), credit under compressed KV at scale (experiments/spectrum-credit/*.toml: 1.5B,
# 80 problems, spectrum | snapkv | pdtrim at b = 0.3 and 0.5, each with exact and the replica
# floor), and the perplexity and NIAH grids (experiments/spectrum-gpu.toml) on every model as
# it arrives. Run: bash experiments/gpu-run.sh experiments/gpu-jobs/spectrum.sh setup|piece|poll
grid() { # model: the perplexity and NIAH grids of experiments/spectrum-gpu.toml for one model
  local m=$1 o=$R/runs/spectrum-$1
  wait_model $m
  mkdir -p $o
  sed "s/^model = .*/model = \"$m\"/; s/^name = .*/name = \"spectrum-gpu-$m\"/" \
    experiments/spectrum-gpu.toml > $o/spec.toml
  step ppl-$m $B spectrum ppl $o/spec.toml --out $o
  step niah-$m $B spectrum niah $o/spec.toml --out $o
}

run_jobs() {
  for engine in graph static; do
    for policy in batch_invariant stock; do
      step masks-synthetic-$engine-$policy $B invariance --synthetic qwen2.5-1.5b --device cuda \
        --dtype bf16 --policy $policy --trials 1 --max-len 40 --masks --mask-engine $engine
    done
  done
  local q=qwen2.5-coder-1.5b-instruct
  wait_model $q
  step masks-$q-graph $B invariance --model $q --device cuda --dtype bf16 \
    --policy batch_invariant --trials 1 --max-len 40 --masks --mask-engine graph
  for f in experiments/spectrum-credit/*.toml; do
    campaign $(basename $f .toml) $f &
  done
  grid $q &
  for m in smollm2-135m-instruct gemma-3-270m qwen2.5-coder-0.5b-instruct; do
    grid $m &
  done
  wait
}
