"""The fused mixture-of-experts: Triton launchers and bodies, the Hopper MXFP4 kernel, the
alignment by expert, the MXFP4 formats and the torch reference (``ref``)."""
