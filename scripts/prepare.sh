#!/usr/bin/env bash
# Download a Hugging Face model and convert it for gpt-fast, under ./checkpoints of the current directory:
#   ./scripts/prepare.sh openlm-research/open_llama_7b
# Python: $PYTHON, else the repository's .venv when no virtualenv is active, else python3.
set -euo pipefail

usage="usage: $0 REPO_ID [--hf_token TOKEN] [--revision REVISION]"
if [[ $# -lt 1 || $1 == -* ]]; then
    if [[ $# -ge 1 && ( $1 == -h || $1 == --help ) ]]; then
        echo "$usage"
        exit 0
    fi
    echo "$usage" >&2
    exit 2
fi
repo_id=$1
shift

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -n ${PYTHON:-} ]]; then
    python=$PYTHON
elif [[ -z ${VIRTUAL_ENV:-} && -x $repo_root/.venv/bin/python ]]; then
    python=$repo_root/.venv/bin/python
else
    python=python3
fi

"$python" -m gpt_fast download "$repo_id" "$@"
"$python" -m gpt_fast convert "checkpoints/$repo_id/hf" --output_dir "checkpoints/$repo_id"
