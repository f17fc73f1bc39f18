#!/usr/bin/env bash
# Perplexity of the default model (SmolLM2-135M-Instruct, float32, on the CPU) in float and quantized by round to
# nearest and by GPTQ, with `gpt-fast quantize` and `gpt-fast eval` (the offline default text, pydoc_data.topics,
# its first 2048 tokens, windows of 1024 every 512). Prints each command with its output, then a table:
#   PATH=.venv/bin:$PATH scripts/quant_gptq_perplexity_cpu.sh > docs/bench/quant_gptq_perplexity_cpu_s6.txt
# Python (for the versions and the table): $PYTHON, else python3. The quantized copies go to a temporary folder.
set -euo pipefail
python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
eval_args=(--max_tokens 2048 --window 1024 --stride 512 --json)

echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), load $(cut -d' ' -f1-3 /proc/loadavg)"
"$python" -c "import sys, torch, gpt_fast; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'threads', torch.get_num_threads(), 'gpt_fast', gpt_fast.__file__)"
echo "commit: $(git -C "$(dirname "$0")" rev-parse --short HEAD)"

row() {  # NAME [QUANTIZE ARGS...]: quantize the default model (unless no arguments), then score it
    local name=$1 checkpoint=() start end shown
    shift
    if (($#)); then
        echo; echo "\$ gpt-fast quantize $* --output_dir \$WORK/$name"
        start=$(date +%s.%N)
        gpt-fast quantize "$@" --output_dir "$work/$name"
        end=$(date +%s.%N)
        awk -v start="$start" -v end="$end" 'BEGIN { printf "%.1f\n", end - start }' >"$work/$name.wall"
        echo "wall time: $(cat "$work/$name.wall") s"
        checkpoint=(--checkpoint_path "$work/$name")
    fi
    shown=(gpt-fast eval "${checkpoint[@]/#$work/\$WORK}" "${eval_args[@]}")
    echo; echo "\$ ${shown[*]}"
    gpt-fast eval "${checkpoint[@]}" "${eval_args[@]}" | tee "$work/$name.json"
    echo "$name" >>"$work/rows"
}

row float
row int8 --mode int8
for group in 128 64 32; do
    row "int4-g$group" --mode int4 --group_size "$group"
done
for group in 128 64; do
    row "int4-g$group-gptq" --mode int4 --group_size "$group" --calibrate gptq
    row "int4-g$group-gptq-act_order" --mode int4 --group_size "$group" --calibrate gptq --act_order
done

echo
"$python" - "$work" <<'EOF'
import json, sys
from pathlib import Path

work = Path(sys.argv[1])
rows = {name: json.loads((work / f"{name}.json").read_text()) for name in (work / "rows").read_text().split()}
base = rows["float"]["perplexity"]
print("| checkpoint | perplexity | vs float | tokens scored | quantize wall (s) |\n|---|---|---|---|---|")
for name, row in rows.items():
    wall = work / f"{name}.wall"
    seconds = f"{float(wall.read_text()):.1f}" if wall.exists() else "—"
    print(f"| {name} | {row['perplexity']:.4f} | {100 * (row['perplexity'] / base - 1):+.2f} % | {row['tokens']} | {seconds} |")
EOF
