"""The choices and defaults of the command line that modules above share, in a module that imports nothing (the
kernels' choices are :mod:`gpt_fast.accel.options`'): the command line builds its options (``--help``, argument
errors) without importing torch, and the modules that use a value import it from here."""

from __future__ import annotations

COMPILE_MODES = ("none", "default", "reduce-overhead", "max-autotune")
# How inductor picks each generated kernel's block sizes and warps: coordinate-descent tuning benchmarks neighbouring
# configurations at the first run (the faster kernels; most of a cold compile), heuristic takes its own choice.
COORDINATE_DESCENT, HEURISTIC = "coordinate-descent", "heuristic"
KERNEL_TUNINGS = (COORDINATE_DESCENT, HEURISTIC)  # the first is the default
DTYPE_NAMES = ("float32", "bfloat16", "float16")
KV_CACHES = ("paged", "static")  # the server's KV cache layouts, the default first
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)  # auto: bfloat16 on a GPU (float16 where it has no bfloat16), float32 on the CPU
FLOAT8_KV = "float8_e4m3fn"  # a KV cache of 8-bit floats (4 exponent bits, 3 of mantissa, at most 448 in size)
KV_DTYPE_NAMES = (*DTYPE_NAMES, FLOAT8_KV)
KV_DTYPE_CHOICES = ("auto", *KV_DTYPE_NAMES)  # the KV cache's dtype; auto: the model's
DEFAULT_MAX_NEW_TOKENS = 200
DEFAULT_NUM_SAMPLES = 5
DEFAULT_PROMPT = "Hello, my name is"
DEFAULT_SPECULATE_K = 4
EVAL_DATASETS = ("wikitext-2",)
EVAL_MAX_TOKENS, EVAL_WINDOW = 8192, 1024  # the window: at most the model's context
CALIBRATION_TEXT = "stdlib docstrings (gpt_fast.quant.calibrate.CALIBRATION_MODULES)"
CALIBRATION_TOKENS = 4096
