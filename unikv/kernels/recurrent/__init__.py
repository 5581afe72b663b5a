"""Recurrent-state ops in place in the Mamba sub-pool (causal conv, gated delta rule with GDN
or KDA gates, Mamba-2 SSD): Triton kernels, fla-core prefill, host checks, torch references."""
