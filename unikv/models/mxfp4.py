"""gpt-oss's MXFP4 format; its definition and dequantisation live with the MoE
kernels' references (``unikv/kernels/moe/mxfp4_ref.py``), which models import."""

from unikv.kernels.moe.mxfp4_ref import FP4_VALUES, dequantize_mxfp4

__all__ = ["FP4_VALUES", "dequantize_mxfp4"]
