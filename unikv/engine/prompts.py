"""Prompts into validated token ids: text through the checkpoint's tokenizer,
conversations through its chat template, token-id lists checked as they are.

The tokenizer is shared with the engine loop's thread (which decodes), so every
use here holds the engine's ``tokenizer_lock``.
"""

from __future__ import annotations

from unikv.engine.sampling import SamplingParams

TEXT_ONLY = (
    "unikv runs the text decoder only (a multimodal checkpoint's vision tower is not "
    "loaded), so images and other media are refused; send the text alone"
)


def media_refusal(where: str, what) -> str:
    """The one message refusing a prompt part that is not text (LLM and server)."""
    return f"{where}: {what!r:.60} is not text: {TEXT_ONLY}"


def check_text_parts(messages) -> None:
    """ValueError for a message whose content is a list holding a part that is not
    {"type": "text", "text": str} (an image, audio, a video): chat templates of
    multimodal checkpoints would render it as placeholder tokens with no pixels."""
    for i, m in enumerate(messages):
        content = m.get("content")
        for part in content if isinstance(content, (list, tuple)) else ():
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise ValueError(media_refusal(f"messages[{i}].content", part))


def _is_ids(prompt) -> bool:
    """A list or tuple of ints (bools are not token ids). The element types are
    collected in C (``set(map(type, ...))``): a 512-token prompt costs microseconds."""
    return isinstance(prompt, (list, tuple)) and all(
        issubclass(t, int) and t is not bool for t in set(map(type, prompt))
    )


class PromptMaker:
    """Prompt handling of one engine: its tokenizer (None without tokenizer files)
    and the lock every use of it holds, its model config (vocabulary, media token
    ids) and its context ``max_model_len``."""

    def __init__(self, tokenizer, tokenizer_lock, config, max_model_len: int) -> None:
        self.tokenizer, self.tokenizer_lock = tokenizer, tokenizer_lock
        self.config, self.max_model_len = config, max_model_len

    def normalize(
        self, prompts, sampling_params=None
    ) -> list[tuple[list[int], str | None, SamplingParams]]:
        """``generate``'s arguments as (token ids, text or None, params) per prompt,
        all validated before any is returned.

        prompts: a str, a list of int token ids, or a non-empty list of either;
        sampling_params: None (defaults), one SamplingParams, or one per prompt."""
        if isinstance(prompts, (str, dict)) or (_is_ids(prompts) and prompts):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise TypeError(
                "prompts must be a str, a list of int token ids, or a non-empty list of "
                f"those; got {type(prompts).__name__} {prompts!r:.60}"
            )
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        bad = [type(sp).__name__ for sp in params if not isinstance(sp, SamplingParams)]
        if bad:
            raise TypeError(f"sampling_params must be SamplingParams, got {bad[:3]}")
        return [
            (self.token_ids(p), p if isinstance(p, str) else None, sp)
            for p, sp in zip(prompts, params)
        ]

    def token_ids(self, prompt) -> list[int]:
        """Validated token ids of one prompt (a str or a list of int token ids)."""
        if isinstance(prompt, str):
            tok = self._tokenizer("prompts must be lists of token ids, got a str")
            with self.tokenizer_lock:
                ids = tok.encode(prompt)
        elif _is_ids(prompt):
            ids = list(prompt)
        elif isinstance(prompt, dict) and prompt.keys() & {"multi_modal_data", "images", "image"}:
            raise ValueError(media_refusal("prompt", sorted(prompt)))
        else:
            raise TypeError(
                f"a prompt is a str or a list of int token ids, got {type(prompt).__name__}"
            )
        return self.check(ids)

    def check(self, ids: list[int]) -> list[int]:
        if not ids:
            raise ValueError("a prompt must hold at least one token, got an empty prompt")
        media = set(self.config.media_token_ids).intersection(ids)
        if media:
            raise ValueError(media_refusal("prompt", f"image placeholder token {sorted(media)}"))
        vocab = self.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            bad = [t for t in ids if not 0 <= t < vocab]
            raise ValueError(f"token ids must be in [0, {vocab}), got {bad[:8]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens is too long: the model's context is "
                f"{self.max_model_len} tokens and at least one must be left to generate; "
                "shorten the prompt (or raise max_model_len up to the model's limit)"
            )
        return ids

    def chat(
        self,
        messages,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
        extra: dict | None = None,
        check: bool = True,
    ) -> tuple[str, list[int]]:
        """(rendered text, validated token ids) of one conversation: a list of
        {"role": str, "content": str} dicts, rendered by the tokenizer's chat
        template (``apply_chat_template``) and tokenized without adding special
        tokens again.

        continue_final_message: the last message is left open (no end-of-turn), for
        the model to continue; chat_template: a Jinja template used instead of the
        tokenizer's; tools: JSON schemas of the tools, given to the template;
        extra: more template variables (e.g. ``enable_thinking``); check: False
        returns the ids unchecked (no length limit)."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError(f"messages must be a non-empty list of dicts, got {messages!r:.60}")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
                raise ValueError(
                    f"messages[{i}] must be a dict with a str 'role' and a 'content', got {m!r:.60}"
                )
        check_text_parts(messages)
        tok = self._tokenizer("chat needs a tokenizer with a chat template")
        if chat_template is None and getattr(tok, "chat_template", None) is None:
            raise ValueError(
                "the checkpoint's tokenizer has no chat template (tokenizer_config.json "
                "'chat_template' or chat_template.jinja); pass the formatted prompt instead"
            )
        with self.tokenizer_lock:
            text = tok.apply_chat_template(
                list(messages),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=chat_template,
                tools=tools,
                **(extra or {}),
            )
            ids = tok.encode(text, add_special_tokens=False)
        return text, self.check(ids) if check else ids

    def _tokenizer(self, why: str):
        tok = self.tokenizer
        if tok is None:
            raise ValueError(f"this checkpoint has no tokenizer files, so {why}")
        return tok
