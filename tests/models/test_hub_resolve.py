"""``LLM(model="org/name")`` and ``unikv serve --model org/name`` resolve a Hugging
Face repo id from the local hub cache, never the network (``models/hub.py``).

The cache here is a fake directory laid out as ``huggingface_hub`` lays it out:
``models--acme--tiny-llama/refs/main`` naming a commit, ``snapshots/{commit}/`` whose
files are symlinks into ``blobs/`` (each blob named by its content's sha256). The
model saved there is a tiny transformers Llama; tokens are checked against it.
"""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest
from engine_fixtures import hf_greedy, save_tiny_model

from unikv.engine import LLM, SamplingParams

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "acme/tiny-llama"


def lay_out_hub_cache(cache: str, repo: str, files_dir: str) -> str:
    """Put ``files_dir``'s files into ``cache`` as the hub does; returns the snapshot dir."""
    root = os.path.join(cache, "models--" + repo.replace("/", "--"))
    snapshot = os.path.join(root, "snapshots", COMMIT)
    os.makedirs(os.path.join(root, "blobs"))
    os.makedirs(os.path.join(root, "refs"))
    os.makedirs(snapshot)
    with open(os.path.join(root, "refs", "main"), "w") as f:
        f.write(COMMIT)
    for name in os.listdir(files_dir):
        with open(os.path.join(files_dir, name), "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        blob = os.path.join(root, "blobs", digest)
        shutil.copy(os.path.join(files_dir, name), blob)
        os.symlink(os.path.relpath(blob, snapshot), os.path.join(snapshot, name))
    return snapshot


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    """(HF_HOME dir, the snapshot dir, transformers' model) of the fake cache."""
    files = str(tmp_path_factory.mktemp("files"))
    hf = save_tiny_model("llama", files)
    home = str(tmp_path_factory.mktemp("hf_home"))
    snapshot = lay_out_hub_cache(os.path.join(home, "hub"), REPO, files)
    return home, snapshot, hf


@pytest.fixture
def env(monkeypatch, cached):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", cached[0])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a network call would fail loudly
    return monkeypatch


def test_a_cached_repo_id_runs_its_snapshot(env, cached):
    from unikv.models.hub import resolve_model

    _, snapshot, hf = cached
    assert os.path.realpath(resolve_model(REPO)) == os.path.realpath(snapshot)
    llm = LLM(model=REPO, device="cpu", page_size=4, max_model_len=64, max_num_seqs=2)
    prompt = [5, 17, 33, 60, 2, 9, 100]
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))
    assert out[0].output_ids == hf_greedy(hf, prompt, 8)


def test_hf_hub_cache_wins_over_hf_home(env, cached, tmp_path):
    from unikv.env import hub_cache_dir
    from unikv.models.hub import resolve_model

    assert hub_cache_dir() == os.path.join(cached[0], "hub")
    env.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty cache: the repo is not there
    assert hub_cache_dir() == str(tmp_path)
    with pytest.raises(ValueError, match=str(tmp_path / "models--acme--tiny-llama")):
        resolve_model(REPO)


def test_an_uncached_repo_says_where_it_looked(env, cached):
    where = os.path.join(cached[0], "hub", "models--acme--absent")
    with pytest.raises(ValueError, match=f"not in the Hugging Face cache: looked for {where}"):
        LLM(model="acme/absent", device="cpu")


def test_a_path_is_not_taken_for_a_repo_id(env, cached, tmp_path):
    """A local directory wins even when its name looks like a repo id; a missing
    path that is no repo id gets the loader's own error."""
    from unikv.models.hub import resolve_model

    os.makedirs(tmp_path / "acme" / "tiny-llama")
    env.chdir(tmp_path)  # undone after the test
    assert resolve_model(REPO) == REPO  # the relative directory, not the cache
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model=str(tmp_path / "nowhere" / "at" / "all"), device="cpu")


def test_serve_resolves_the_repo_id_and_reports_an_uncached_one(env, cached, capsys):
    from unikv.engine.cli import llm_from_args
    from unikv.serving.cli import _parser, serve_main

    args = _parser().parse_args(["--model", REPO, "--device", "cpu", "--max-model-len", "64"])
    llm = llm_from_args(args)
    assert llm.config.architecture == "LlamaForCausalLM"
    assert serve_main(["--model", "acme/absent", "--device", "cpu"]) == 2
    assert "models--acme--absent" in capsys.readouterr().err


def test_inspect_plans_a_cached_repo_id(env, cached, capsys):
    from unikv.inspect import main

    assert main([REPO, "--budget", "64MiB"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"model {REPO} (llama): 2 layers: 2 full")
    assert "engine: runs it (family 'llama')" in out
    assert main(["acme/absent"]) == 2
    assert "models--acme--absent" in capsys.readouterr().err
