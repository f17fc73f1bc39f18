"""Weight-only int8 and int4 quantization: the schemes (:mod:`.schemes`), which tensors a quantized checkpoint
holds (:mod:`.layout`), the linear layers that compute with them (:mod:`.linear`, :mod:`.kernels`,
:mod:`.triton_gemv`) and the ``quantize`` command's work (:mod:`.quantize`)."""
