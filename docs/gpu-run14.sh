#!/bin/bash
# A real batch-invariant campaign under both kernel sets on the H200 (#15): the 0.5B zero-shot
# settings of experiments/bench-campaign-qwen05-8.toml (8 problems, one pool) timed by
# `kvcredit bench campaign` under --policy batch_invariant with the fused kernels (the CUDA
# default) and with --tiles kernels=aten, and under stock, one after the other, alone on the GPU.
# The GGUF (491 MB) ships in 55 MB pieces: `split -b 55M -d` into gpu/ship/, one piece per
# `piece` call (carry ["gpu/ship"], with docs/runs and tests/fixtures moved aside so the tree
# fits), then one `campaign` call (carry ["gpu"]).
#   bash docs/gpu-run14.sh piece      # keep the carried piece under /tmp/m
#   bash docs/gpu-run14.sh campaign [RUNS]   # join, verify, run the campaigns (default
#                                            # bi-fused,bi-aten,stock) and `kvcredit check`
set -u
export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/torch/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export KVCREDIT_HOME=/tmp/kvhome
M=qwen2.5-coder-0.5b-instruct
SHA=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
B=/tmp/kvcredit
case "$1" in
piece)
  mkdir -p /tmp/m && cp gpu/ship/* /tmp/m/ && ls -la /tmp/m
  ;;
campaign)
  mkdir -p /tmp/m && cp gpu/ship/* /tmp/m/ 2>/dev/null  # the last piece may come with this call
  [ -x $B ] || { gunzip -c gpu/bin/kvcredit.gz > $B && chmod +x $B; }
  f=$KVCREDIT_HOME/models/$M/$M.gguf
  mkdir -p $(dirname $f)
  [ -e $f ] || cat /tmp/m/$M.gguf.part* > $f
  echo "$SHA  $f" | sha256sum -c || exit 1
  S=experiments/bench-campaign-qwen05-8.toml
  R=/tmp/R && rm -rf $R && mkdir -p $R
  runs=${2:-bi-fused,bi-aten,stock}
  for c in "bi-fused" "bi-aten --tiles kernels=aten" "stock"; do
    case ",$runs," in *,${c%% *},*) ;; *) continue ;; esac
    set -- $c; d=$1; shift
    spec=${S%.toml}-bi.toml; [ $d = stock ] && spec=$S
    echo "== $d"
    timeout 240 $B bench campaign $spec --out $R/$d --json $R/$d.json "$@" 2>&1 | grep -v "^\s*$" | tail -25
    echo "[$d] rc=${PIPESTATUS[0]}"
  done
  for d in bi-fused bi-aten; do
    [ -d $R/$d ] || continue
    echo "== check $d"; timeout 60 $B check $R/$d 2>&1 | tail -5
  done
  # Same spec and seed; the kernel sets have different numerics, so any table may differ.
  for t in rollouts pivots continuations estimates; do
    cmp -s $R/bi-fused/$t.parquet $R/bi-aten/$t.parquet && echo "$t: identical" || echo "$t: differ"
  done
  tar czf $OUT/results.tgz -C /tmp R  # one file back (a call returns only a few)
  ;;
esac
