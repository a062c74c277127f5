#!/bin/sh
# The measurements behind docs/PERFORMANCE.md, one after another (never two at once).
# Run on a quiet machine from the repository root:  sh benchmarks/performance.sh
# Writes docs/perf/*.json and *.png and prints the markdown tables.
set -e
out=${1:-docs/perf}
mkdir -p "$out"
# 1. plait's API against gloo and Open MPI, allreduce, the default sweep (8 B .. 64 MiB, x2)
plait bench --ops allreduce --compare gloo,mpi \
    --json "$out/allreduce_api.json" --plot "$out/allreduce_api.png"
# 2. torch.distributed on plait against gloo, the five bandwidth-target collectives
plait bench --api torch --ops allreduce,allgather,reduce_scatter,alltoall,broadcast \
    -b 4 -e 64M -f 4 --compare gloo --json "$out/torch.json" --plot "$out/torch.png"
# 3. 4 ranks on the 2 cores (oversubscribed), torch.distributed on plait against gloo
plait bench -n 4 --api torch --ops allreduce -b 4 -e 64M -f 4 --compare gloo \
    --json "$out/allreduce_4ranks.json" --plot "$out/allreduce_4ranks.png"
for f in allreduce_api torch allreduce_4ranks; do python -m plait.bench.markdown "$out/$f.json"; done
