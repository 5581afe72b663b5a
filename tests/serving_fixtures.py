"""A tiny instruct-style checkpoint for the serving tests: a random-init Llama
(transformers' own, saved with save_pretrained) whose tokenizer is a byte-level
BPE trained here on a few sentences (the ``tokenizers`` library), wrapped in
``transformers.PreTrainedTokenizerFast`` with ChatML special tokens, an EOS and
a ChatML chat template; plus a ``unikv serve`` subprocess on a free loopback
port, always killed at the end.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, how are you today? I am fine, thank you.",
    "unikv serves models over one unified pool of pages.",
    "A stop string cuts the text where it begins.",
    "Pages move, requests keep their virtual ids; the boundary between bands moves too.",
]


def build_tokenizer(vocab_size: int = 320):
    """A PreTrainedTokenizerFast: byte-level BPE, ids 0-2 the special tokens,
    EOS ``<|im_end|>`` (id 2), pad ``<|endoftext|>``, a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def save_instruct_llama(path: str, seed: int = 0, generation_eos=None, **overrides):
    """Save the tiny Llama + tokenizer to ``path``; returns the fp32 eval
    transformers model. ``generation_eos``: written to generation_config.json
    (with the config's EOS 2 first), None: transformers' default file."""
    import transformers as tf

    tokenizer = build_tokenizer()
    kw = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "initializer_range": 0.1,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None,
        "pad_token_id": tokenizer.pad_token_id,
    }
    kw.update(overrides)
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**kw)).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if generation_eos is not None:
        gen = {"eos_token_id": list(generation_eos), "pad_token_id": tokenizer.pad_token_id}
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump(gen, f)
        model.generation_config = tf.GenerationConfig.from_pretrained(path)
    return model


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``unikv serve`` in a subprocess on 127.0.0.1; ``stop()`` always kills it."""

    def __init__(self, model_dir: str, *extra: str, startup_s: float = 120.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "unikv.cli", "serve", "--model", model_dir]
        cmd += ["--port", str(self.port), "--device", "cpu", "--page-size", "4", *extra]
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True
        )
        self._wait_healthy(startup_s)

    def _wait_healthy(self, startup_s: float) -> None:
        import httpx

        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"unikv serve exited: {self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("unikv serve did not become healthy in time")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> str:
        """Terminate (then kill) the server; returns its output."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.stdout.read() if self.proc.stdout else ""


def metric_values(text: str, name: str) -> dict[str, float]:
    """{label string: value} of one Prometheus metric in exposition ``text``."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            rest = key[len(name) :]
            if rest and not rest.startswith("{"):
                continue  # another metric sharing the prefix
            out[rest] = float(value)
    return out
