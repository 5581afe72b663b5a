"""Engine-side incremental detokenization cost: us per token of the Rust
``DecodeStream`` path (``StreamDetokenizer``) against the ``tokenizer.decode``
fallback (``IncrementalDetokenizer``), one token per update as the engine loop
feeds them, and the cost of making one (per request).

Tokenizers: tiny ones built here with ``tokenizers`` (byte-level BPE, GPT-2
style; Llama 2 style SentencePiece with byte fallback; word level), and every
``tokenizer.json`` found under ``~/.cache/huggingface`` or given with
``--tokenizer DIR`` (a checkpoint directory). The text is a fixed mixed
English/accented/CJK/emoji paragraph, repeated; both classes must give the same
text (checked, printed). The figures are medians of ``--repeats`` runs.

Usage: ``python benchmarks/bench_detokenize.py [--tokenizer DIR ...] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from unikv.engine.detokenize import (
    IncrementalDetokenizer,
    StreamDetokenizer,
    decodes_in_rust,
)

PARAGRAPH = (
    "The quick brown fox jumps over the lazy dog. Pages move, requests keep their "
    "virtual ids; héllo wörld, ça va? 日本語のテキストも少し。 Emoji 😀🚀 and code: "
    "def f(x):\n    return x * 2  # done\n"
)
CORPUS = [  # the tiny tokenizers' training text (not the measured paragraph)
    "Hello, how are you today? I am fine, thank you. The dog sleeps over there.",
    "unikv serves models over one unified pool of pages; a stop string cuts the text.",
    "Ça va très bien. 日本 is Japan. return the value of x times two",
]


def tiny_tokenizers() -> dict:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=alphabet, show_progress=False
    )
    bpe.train_from_iterator(CORPUS * 4, trainer)
    sp = Tokenizer(models.BPE(unk_token="<unk>"))
    sp.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False)
    sp.train_from_iterator(CORPUS * 4, trainer)
    model = json.loads(sp.to_str())["model"]
    vocab = model["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    llama = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    llama.normalizer = sp.normalizer
    llama.add_special_tokens(specials)
    llama.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + [decoders.Strip(" ", 1, 0)]
    )
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(2000)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.WordPiece(prefix="##")
    wrap = PreTrainedTokenizerFast
    return {
        "tiny byte-level BPE": wrap(tokenizer_object=bpe, eos_token="</s>"),
        "tiny llama2 byte-fallback": wrap(tokenizer_object=llama, eos_token="</s>"),
        "tiny word-level": wrap(tokenizer_object=words),
    }


def cached_tokenizers(extra: list[str]) -> dict:
    """Real tokenizers: ``extra`` directories and the Hugging Face cache's snapshots."""
    from transformers import AutoTokenizer

    hub = os.path.expanduser("~/.cache/huggingface/hub")
    dirs = list(extra) + sorted(
        {os.path.dirname(p) for p in glob.glob(f"{hub}/*/snapshots/*/tokenizer.json")}
    )
    found = {}
    for d in dirs:
        try:
            found[os.path.basename(d.rstrip("/").split("/snapshots/")[0])] = (
                AutoTokenizer.from_pretrained(d)
            )
        except Exception as e:  # noqa: BLE001  (a broken snapshot: say so and go on)
            print(f"skipped {d}: {e}")
    return found


def per_token_us(cls, tok, prompt: list[int], ids: list[int], repeats: int) -> tuple[float, str]:
    """(median us per token over ``repeats`` runs, the text)."""
    times, text = [], ""
    for _ in range(repeats):
        start = time.perf_counter()
        detok = cls(tok, prompt, True)
        for t in ids:
            detok.update([t])
        detok.flush()
        times.append((time.perf_counter() - start) / len(ids) * 1e6)
        text = detok.text
    return statistics.median(times), text


def make_us(cls, tok, prompt: list[int], repeats: int) -> float:
    """Median us to make one detokenizer (per request), warm."""
    n = 200
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(n):
            cls(tok, prompt, True)._prefix()  # the fallback seeds lazily: count it
        times.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(times)


def bench(name: str, tok, repeats: int) -> dict:
    word = name == "tiny word-level"  # its vocabulary is w0 ... w1999
    text = " ".join(f"w{i % 2000}" for i in range(0, 9000, 7)) if word else PARAGRAPH * 8
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("w1 w2 w3" if word else "Once upon a time,", add_special_tokens=False)
    slow_us, slow_text = per_token_us(IncrementalDetokenizer, tok, prompt, ids, repeats)
    row = {"tokenizer": name, "num_tokens": len(ids), "decode_us": slow_us}
    row["make_decode_us"] = make_us(IncrementalDetokenizer, tok, prompt, repeats)
    row["streams"] = decodes_in_rust(tok)
    if row["streams"]:
        fast_us, fast_text = per_token_us(StreamDetokenizer, tok, prompt, ids, repeats)
        row.update(stream_us=fast_us, speedup=slow_us / fast_us, same_text=fast_text == slow_text)
        row["make_stream_us"] = make_us(StreamDetokenizer, tok, prompt, repeats)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", action="append", default=[], help="a checkpoint directory")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    tokenizers = tiny_tokenizers() | cached_tokenizers(args.tokenizer)
    rows = [bench(name, tok, args.repeats) for name, tok in tokenizers.items()]
    head = f"{'tokenizer':34} {'tokens':>6} {'decode us/tok':>13} {'stream us/tok':>13}"
    print(head + f" {'speedup':>7} {'same':>5} {'make us (dec/str)':>18}")
    for r in rows:
        stream = f"{r['stream_us']:13.2f} {r['speedup']:6.1f}x {r['same_text']!s:>5}"
        stream = stream if r["streams"] else f"{'(fallback)':>13} {'':7} {'':5}"
        make = f"{r['make_decode_us']:.1f}/{r.get('make_stream_us', float('nan')):.1f}"
        name = r["tokenizer"][:34]
        print(f"{name:34} {r['num_tokens']:6d} {r['decode_us']:13.2f} {stream} {make:>18}")
    if args.out:
        meta = {"python": platform.python_version(), "machine": platform.processor()}
        import tokenizers
        import transformers

        meta |= {"tokenizers": tokenizers.__version__, "transformers": transformers.__version__}
        Path(args.out).write_text(json.dumps(meta | {"rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
