"""Multi-head latent attention over the MLA sub-pool: the decode kernels and their plan, the
prefill (extend) kernel, and the torch references (``ref``)."""
