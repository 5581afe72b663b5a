"""A tiny instruct-style checkpoint for the serving tests: a random-init Llama
(transformers' own, saved with save_pretrained) whose tokenizer is a byte-level
BPE trained here on a few sentences (the ``tokenizers`` library), wrapped in
``transformers.PreTrainedTokenizerFast`` with ChatML special tokens, an EOS and
a ChatML chat template; plus a ``unikv serve`` subprocess on a free loopback
port, always killed at the end; and a scripted engine stand-in (no model, the
test steps it) with the app on uvicorn in a thread, for the streaming path.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

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
    """``unikv serve`` in a subprocess on 127.0.0.1; ``stop()`` always kills it.
    The engine runs in its own process (the default) unless ``extra`` holds
    ``--in-process-engine``; ``env``: more environment variables (a test fault)."""

    def __init__(
        self, model_dir: str, *extra: str, startup_s: float = 120.0, env: dict | None = None
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "unikv.cli", "serve", "--model", model_dir]
        cmd += ["--port", str(self.port), "--device", "cpu", "--page-size", "4", *extra]
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
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

    def engine_pid(self) -> int:
        """The pid of the server's engine process (process mode; Linux /proc)."""
        for task in os.listdir(f"/proc/{self.proc.pid}/task"):
            with open(f"/proc/{self.proc.pid}/task/{task}/children") as f:
                for pid in f.read().split():
                    with open(f"/proc/{pid}/cmdline", "rb") as c:
                        if b"unikv.serving.engine_core" in c.read():
                            return int(pid)
        raise AssertionError("the server has no engine process")

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


def metric_values(text: str, name: str, model_name: str | None = None) -> dict[str, float]:
    """{label string: value} of one Prometheus metric in exposition ``text``; the
    ``model_name`` label is left out of the key (given: a sample must carry one,
    and only that model's samples are kept: /metrics lists every served model's)."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            rest = key[len(name) :]
            if rest and not rest.startswith("{"):
                continue  # another metric sharing the prefix
            found = re.search(r'model_name="([^"]*)",?', rest)
            if model_name is not None:
                assert found, (line, model_name)
                if found.group(1) != model_name:
                    continue  # another served model's sample
            if found:
                rest = rest.replace(found.group(0), "").replace(",}", "}")
            out["" if rest == "{}" else rest] = float(value)
    return out


class ScriptedGroup:
    """A request group of ``ScriptedLLM``: ``n`` completions of ``max_tokens``."""

    def __init__(self, ids: list[int], n: int, max_tokens: int, sink) -> None:
        self.ids, self.sink, self.max_tokens = ids, sink, max_tokens
        self.tracks = list(range(n))
        self.num_sent = self.num_done = 0
        self.aborted = False

    @property
    def done(self) -> bool:
        return self.num_done == len(self.tracks)

    def text(self, index: int, k: int) -> str:
        """The text of token ``k`` of completion ``index`` (quotes, escapes, non-ASCII)."""
        return f' p{self.ids[0]}c{index}t{k}"\\é'


class ScriptedLoop:
    """EngineLoop's surface for the app, with no thread and no model: the test
    calls ``step()`` (from its own thread, as the engine thread would) to
    publish one token for every completion of every group submitted so far."""

    def __init__(self) -> None:
        self.max_waiting = self.error = self.publish = None
        self.running = False
        self.groups: list[ScriptedGroup] = []
        self._inbox: list = []
        self.lock = threading.Lock()

    def submit(self, group, bounded: bool = True):
        with self.lock:
            self.groups.append(group)
        return group

    def submit_all(self, groups, bounded: bool = True) -> None:
        for group in groups:
            self.submit(group, bounded)

    def abort(self, group) -> None:
        group.aborted = True

    def call(self, fn):
        future: Future = Future()
        future.set_result(fn())
        return future

    def start(self) -> None:
        self.running = True

    def shutdown(self, drain: bool = False) -> None:
        self.running = False

    def step(self) -> list:
        """Publish one step; returns its (sink, Delta) pairs."""
        from unikv.engine.tracks import Delta

        pairs = []
        with self.lock:
            live = [g for g in self.groups if not g.done]
        for g in live:
            k = g.num_sent
            g.num_sent += 1
            last = g.aborted or g.num_sent >= g.max_tokens
            reason = ("abort" if g.aborted else "length") if last else None
            for i in g.tracks:
                pairs.append((g.sink, Delta(i, [k], g.text(i, k), None, reason)))
            if last:
                g.num_done = len(g.tracks)
        self.publish(pairs)
        return pairs


class ScriptedLLM:
    """What ``create_app`` reads of an LLM, with ``ScriptedLoop`` as its engine;
    prompts are lists of token ids."""

    max_model_len = 1 << 16

    def __init__(self) -> None:
        self.engine = ScriptedLoop()
        self.prompts = self.requests = self  # PromptMaker's and RequestMaker's verbs
        self.core = self  # what the metrics' snapshot reads
        self.tokenizer_lock = threading.Lock()

    def reset_prefix_cache(self) -> bool:
        return False  # no prefix cache

    def token_ids(self, prompt) -> list[int]:
        return list(prompt)

    def chat(self, messages, add_generation_prompt: bool = True, **kw) -> tuple[str, list[int]]:
        """(prompt text, token ids): one id per message."""
        return "".join(m["content"] for m in messages), [len(m["content"]) for m in messages]

    def make_group(self, ids, params, *, text=None, sink=None) -> ScriptedGroup:
        return ScriptedGroup(list(ids), params.n, params.max_tokens, sink)


class AppThread:
    """``app`` on uvicorn in a thread of this process, on a free loopback port."""

    def __init__(self, app) -> None:
        import uvicorn

        self.url = f"http://127.0.0.1:{free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self.server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
