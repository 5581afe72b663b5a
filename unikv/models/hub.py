"""A model given as a Hugging Face repo id (``org/name``), resolved to its snapshot
directory in the local Hugging Face cache, never downloaded.

The cache is where ``huggingface_hub`` puts it, read from the environment at each
call (so a process that sets it late is honoured): ``HF_HUB_CACHE`` (or the legacy
``HUGGINGFACE_HUB_CACHE``), else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``.
A repo there is ``models--{org}--{name}/`` with ``refs/main`` naming the commit whose
files are under ``snapshots/{commit}/`` (``huggingface_hub.snapshot_download`` with
``local_files_only=True`` reads it without the network).
"""

from __future__ import annotations

import os
import re

from unikv import env

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_model(model: str) -> str:
    """``model`` itself where it exists on disk or is no repo id; else the snapshot
    directory of repo id ``model`` in the local cache. ValueError, saying where it
    looked, when the repo is not cached (nothing is downloaded)."""
    if os.path.exists(model) or not REPO_ID.fullmatch(model):
        return model
    from huggingface_hub import snapshot_download

    cache = env.hub_cache_dir()
    try:
        return snapshot_download(model, cache_dir=cache, local_files_only=True)
    except OSError as err:  # LocalEntryNotFoundError: not cached (or no refs/main)
        where = os.path.join(cache, "models--" + model.replace("/", "--"))
        raise ValueError(
            f"{model!r} is no local directory and not in the Hugging Face cache: looked for "
            f"{where} (the cache is HF_HUB_CACHE, else $HF_HOME/hub); unikv does not "
            f"download: fetch it first (huggingface-cli download {model}) or pass the "
            f"checkpoint directory"
        ) from err
