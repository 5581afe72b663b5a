"""Linear layers and the decode step's elementwise work: GEMV (with fused norms, SwiGLU and
argmax), block-scaled FP8 GEMM, RMSNorm / rope / SwiGLU / output-gate / relu2 kernels,
greedy argmax, and their torch references (``ref``, ``fp8_gemm_ref``)."""
