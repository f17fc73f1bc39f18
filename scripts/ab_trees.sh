#!/usr/bin/env bash
# A/B of two source trees on one machine: the same benchmark command run by each tree's gpt_fast in turn, in fresh
# processes, alternating A B A B ... so that drift of the machine falls on both sides alike. Every `measured:` line
# the benchmarks print is kept, prefixed with the side and round, in OUT_DIR/ab.txt. Each side builds the C++ kernels
# of its tree once, into its own TORCH_EXTENSIONS_DIR (OUT_DIR/ext_A, OUT_DIR/ext_B).
#
# usage: scripts/ab_trees.sh A_ROOT B_ROOT ROUNDS OUT_DIR -- COMMAND...
#   A_ROOT, B_ROOT: folders holding a gpt_fast package (e.g. an old commit's `git archive HEAD~1 gpt_fast` and this
#   checkout); COMMAND is run with PYTHONPATH set to each, e.g.
#   scripts/ab_trees.sh /tmp/old . 2 /tmp/ab -- python -m gpt_fast.bench_decode --shape llama-2-7b --repeats 3 --no_peers
set -uo pipefail
[ $# -ge 6 ] && [ "$5" = "--" ] || { echo "usage: $0 A_ROOT B_ROOT ROUNDS OUT_DIR -- COMMAND..." >&2; exit 2; }
a_root=$(cd "$1" && pwd) b_root=$(cd "$2" && pwd) rounds=$3 out=$4
shift 5
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  for side in A B; do
    root=$a_root; [ "$side" = B ] && root=$b_root
    log="$out/${side}_${round}.log"
    echo "=== $side round $round $(date -u +%T): PYTHONPATH=$root $*" | tee -a "$out/ab.txt"
    PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" TORCH_EXTENSIONS_DIR="$out/ext_$side" PYTHONUNBUFFERED=1 \
      "$@" > "$log" 2>&1
    echo "rc $? $(date -u +%T)" | tee -a "$out/ab.txt"
    grep -E "^measured:|^\|" "$log" | sed "s/^/$side$round /" >> "$out/ab.txt"
  done
done
grep -E "^[AB][0-9]+ measured:" "$out/ab.txt"
