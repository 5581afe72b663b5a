import os

import torch

# Without a GPU, run every Triton kernel through Triton's CPU interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
