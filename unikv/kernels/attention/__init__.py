"""Attention and the K/V store: paged decode, extend and fresh-prompt attention (Triton,
Gluon on Hopper, SDPA), the K/V row store with and without rope, and their torch references
(``ref``)."""
