"""OpenAI request bodies (pydantic) and their translation to SamplingParams.

The fields are OpenAI's, plus vLLM's extra sampling fields (``top_k``,
``min_p``, ``min_tokens``, ``ignore_eos``, ``repetition_penalty``,
``stop_token_ids``, ``skip_special_tokens``, ``include_stop_str_in_output``,
``prompt_logprobs``) and chat template fields (``chat_template``,
``chat_template_kwargs``, ``continue_final_message``, ``add_generation_prompt``,
``tools``). An unknown field is a 400 naming it (never silently ignored). Types are strict (pydantic's strict
mode on the JSON body: ``"10"`` is not an int, ``"yes"`` not a bool, ``true``
not a token id; an int is a float), floats must be finite, and ranges are
checked here so that a bad value is a 400 naming its field, what it expects
and what it got (``validation_message``); ``SamplingParams`` checks them again.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from unikv.engine.prompts import media_refusal
from unikv.engine.sampling import INT64_MAX, INT64_MIN, MAX_INT_PARAM, SamplingParams

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
# what a field whose type is a union expects (pydantic names one member only)
EXPECTED = {
    "prompt": "a string, a list of strings, a list of int token ids or a list of such lists",
    "stop": "a string, a list of strings or null",
    "content": "a string, a list of content parts or null",
}


def _is_type_tag(part) -> bool:
    """pydantic's name of a union member in an error's location ('list[int]')."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


def validation_message(err: ValidationError) -> tuple[str, str | None]:
    """(message, param) of pydantic's first error on a request body: the field's
    path, what it expects and what it got."""
    errors = err.errors(include_url=False)
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [p for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON (UTF-8): {first.get('msg', '')}", None
    if not loc:
        return f"the body must be a JSON object: {first.get('msg', '')}", None
    path = ".".join(str(p) for p in loc if not _is_type_tag(p))
    field = next((str(p) for p in reversed(loc) if str(p) in EXPECTED), None)
    msg = first.get("msg", "invalid value")
    if first.get("type") == "extra_forbidden":
        return f"{path}: unknown field (unikv does not support it)", str(loc[0])
    if field is not None and first.get("type", "").endswith("_type"):
        msg = f"expected {EXPECTED[field]}"
    given = first.get("input")
    got = "" if first.get("type") == "missing" else f" (got {given!r:.80})"
    return f"{path or loc[0]}: {msg}{got}", str(loc[0])


class BadRequest(ValueError):
    """A request the server refuses with HTTP 400; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def parse_body(raw: bytes, model):
    """``raw`` JSON as ``model`` (strict pydantic), or BadRequest naming the field."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as err:
        message, param = validation_message(err)
        raise BadRequest(message, param) from None


class ChatTemplateFields(BaseModel):
    """vLLM's per-request chat template fields (chat completions and /tokenize)."""

    model_config = STRICT

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    tools: list[dict] | None = None

    def template_kwargs(self) -> dict:
        """Keyword arguments of ``PromptMaker.chat``."""
        if self.continue_final_message and self.add_generation_prompt:
            raise BadRequest(
                "continue_final_message and add_generation_prompt cannot both be true "
                "(pass add_generation_prompt: false to continue the last message)",
                "continue_final_message",
            )
        extra = dict(self.chat_template_kwargs or {})
        reserved = {"messages", "tools", "add_generation_prompt", "continue_final_message",
                    "chat_template", "tokenize"} & set(extra)  # fmt: skip
        if reserved:
            raise BadRequest(
                f"chat_template_kwargs: {sorted(reserved)} are set by their own fields",
                "chat_template_kwargs",
            )
        return {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "chat_template": self.chat_template,
            "tools": self.tools,
            "extra": extra,
        }


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = STRICT

    name: str | None = None
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: text, json_object or json_schema."""

    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's ``structured_outputs``: one of json (a schema), regex, choice,
    grammar (EBNF), json_object."""

    model_config = STRICT

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None


def _schema_text(schema) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = STRICT

    model: str
    n: int = Field(1, ge=1, le=64)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)  # vLLM's int64 bounds
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, le=MAX_INT_PARAM)
    min_p: float = Field(0.0, ge=0, le=1)
    min_tokens: int = Field(0, ge=0, le=MAX_INT_PARAM)
    ignore_eos: bool = False
    repetition_penalty: float = Field(1.0, gt=0)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool = False
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)  # prefix-cache tenant
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    _parser: object = PrivateAttr(default=None)  # chat: parsers.OutputParser, or None

    @property
    def parser(self):
        """The chat output parser (reasoning, tool calls) of this request, or None."""
        return self._parser

    def structured_spec(self) -> tuple[str, str, str] | None:
        """(kind, spec, field) of the request's one structured-output constraint."""
        found = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("json_object", "", "response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise BadRequest(
                    "response_format: type json_schema needs a json_schema", "response_format"
                )
            found.append(("json", _schema_text(rf.json_schema.schema_), "response_format"))
        so = self.structured_outputs
        if so is not None:
            for kind, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                ("grammar", so.grammar)):  # fmt: skip
                if value is not None:
                    found.append((kind, value, "structured_outputs"))
            if so.json_object:
                found.append(("json_object", "", "structured_outputs"))
        for kind, name in (("json", "guided_json"), ("regex", "guided_regex"),
                           ("choice", "guided_choice"), ("grammar", "guided_grammar")):  # fmt: skip
            value = getattr(self, name)
            if value is not None:
                found.append((kind, value, name))
        if len(found) > 1:
            raise BadRequest(
                f"only one structured-output constraint per request, got {[f[2] for f in found]}",
                found[1][2],
            )
        if not found:
            return None
        kind, value, name = found[0]
        if kind == "json":
            value = _schema_text(value)
        elif kind == "choice":
            value = json.dumps(value)
        return kind, value, name

    def structured(self, llm):
        """The compiled constraint (``engine.structured.StructuredOutputs``) or None."""
        spec = self.structured_spec()
        if spec is None:
            return None
        kind, value, name = spec
        try:
            from unikv.engine.structured import compile_structured

            return compile_structured(llm, kind, value)
        except ImportError as err:
            raise BadRequest(f"{name}: structured outputs need xgrammar ({err})", name) from err
        except Exception as err:  # xgrammar's own errors on a bad schema, regex or grammar
            raise BadRequest(f"{name}: invalid {kind}: {err}", name) from err

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        llm=None,
    ) -> SamplingParams:
        """The engine's SamplingParams (OpenAI's defaults: temperature 1, top_p 1);
        ``llm``: compiles a structured-output constraint (else one is refused)."""
        structured = None
        if llm is not None:
            structured = self.structured(llm)
        elif self.structured_spec() is not None:
            raise BadRequest("structured outputs are not available here", "response_format")
        if self.logit_bias:
            raise BadRequest("logit_bias is not supported by unikv", "logit_bias")
        bad_ids = [t for t in self.stop_token_ids or () if not 0 <= t <= MAX_INT_PARAM]
        if bad_ids:
            raise BadRequest(
                f"stop_token_ids: expected token ids in [0, {MAX_INT_PARAM}], got {bad_ids[:4]}",
                "stop_token_ids",
            )
        if max_tokens is not None and max_tokens < self.min_tokens:
            raise BadRequest(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({max_tokens})",
                "min_tokens",
            )
        try:
            return SamplingParams(
                n=self.n,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=max(self.top_k or 0, 0),  # vLLM: -1 or 0 = off
                min_p=self.min_p,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                seed=self.seed,
                stop=self.stop,
                stop_token_ids=tuple(self.stop_token_ids or ()),
                include_stop_str_in_output=self.include_stop_str_in_output,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                structured=structured,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                skip_special_tokens=self.skip_special_tokens,
            )
        except ValueError as err:
            field = str(err).split(" ", 1)[0]
            raise BadRequest(str(err), field if field in type(self).model_fields else None) from err


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0, le=MAX_INT_PARAM)  # 0: echo only
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=64)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)

    def params(self, llm=None) -> SamplingParams:
        """SamplingParams: ``echo`` with ``logprobs`` asks for the prompt's logprobs
        too; ``max_tokens`` 0 (echo only) samples one token, dropped from the answer."""
        if self.max_tokens == 0 and not self.echo:
            raise BadRequest("max_tokens: 0 is only allowed with echo: true", "max_tokens")
        if self.prompt_logprobs is not None and self.stream:
            raise BadRequest(
                "prompt_logprobs is not supported with stream: true", "prompt_logprobs"
            )
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None)]
        wanted = [k for k in wanted if k is not None]
        plp = max(wanted) if wanted else None
        return self.sampling_params(self.max_tokens or 1, self.logprobs, plp, llm)

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a str or a list of token ids (at least one)."""
        p = self.prompt
        if self.suffix:
            raise BadRequest("suffix is not supported by unikv", "suffix")
        if self.best_of not in (None, self.n):
            raise BadRequest("best_of must equal n (unikv samples n completions)", "best_of")
        if isinstance(p, str):
            return [p]
        if not p:
            raise BadRequest("prompt must not be empty", "prompt")
        if isinstance(p[0], int):  # (validated: a list holds ints only, or none)
            return [list(p)]
        return list(p)


class ChatMessage(BaseModel):
    """A message: its other fields (``tool_calls``, ``tool_call_id``, ``name``,
    ``reasoning_content``) reach the chat template as they are."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    role: str
    content: str | list[dict] | None = None

    def as_dict(self) -> dict:
        return {**(self.model_extra or {}), "role": self.role, "content": self.text()}

    def text(self) -> str:
        """The message's text (a list of content parts: their "text" parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(
                    f"messages: only text content parts are supported; "
                    f"{media_refusal('a content part', part)}",
                    "messages",
                )
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(ChatTemplateFields, _Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT_PARAM)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT_PARAM)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's: the answer's top level

    def use_parser(self, llm, prompt: str, params: SamplingParams, options=None) -> SamplingParams:
        """Choose the output parser from the chat template in use; the params to
        run with (harmony's parser reads the special tokens: they are kept)."""
        from unikv.serving.parsers import ForcedToolParser, OutputParser

        forced = self.forced_tools()
        if forced is not None:  # the grammar wrote the call: parse it as such
            self._parser = ForcedToolParser(forced[0], self.tool_choice == "required")
            return params
        tok = getattr(llm, "tokenizer", None)
        template = self.chat_template or getattr(tok, "chat_template", None)
        if isinstance(template, dict):  # named templates: the default, or all of them
            template = template.get("default") or " ".join(template.values())
        self._parser = OutputParser.for_request(
            template, prompt, self, getattr(options, "tool_call_parser", None),
            getattr(options, "reasoning_parser", None),
        )  # fmt: skip
        if self._parser is not None and self._parser.harmony:
            return dataclasses.replace(params, skip_special_tokens=False)
        return params

    def forced_tools(self) -> tuple[list[str], dict] | None:
        """(tool names, the JSON schema of the output) when ``tool_choice`` forces a
        call: a named function (the output is its arguments) or "required" (a list
        of {"name", "parameters"}, vLLM's form; one call at most without
        ``parallel_tool_calls``); None for none / auto."""
        choice = self.tool_choice
        if choice in (None, "none", "auto"):
            return None
        tools = {}
        for t in self.tools or ():
            fn = t.get("function") if isinstance(t, dict) else None
            if t.get("type") != "function" or not isinstance(fn, dict) or "name" not in fn:
                raise BadRequest(f"tools: each tool is a function with a name, got {t!r:.80}",
                                 "tools")  # fmt: skip
            tools[fn["name"]] = fn.get("parameters") or {"type": "object"}
        if choice == "required":
            if not tools:
                raise BadRequest("tool_choice: 'required' needs tools", "tool_choice")
            items = [{"type": "object", "properties": {"name": {"enum": [name]},
                      "parameters": schema}, "required": ["name", "parameters"]}
                     for name, schema in tools.items()]  # fmt: skip
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
            if not self.parallel_tool_calls:
                schema["maxItems"] = 1
            return list(tools), schema
        name = None
        if isinstance(choice, dict) and choice.get("type") == "function":
            name = (choice.get("function") or {}).get("name")
        if name is None or name not in tools:
            raise BadRequest(
                "tool_choice: expected 'none', 'auto', 'required' or {'type': 'function', "
                f"'function': {{'name': one of {sorted(tools)}}}}}, got {choice!r:.80}",
                "tool_choice",
            )
        return [name], tools[name]

    def structured_spec(self) -> tuple[str, str, str] | None:
        spec = super().structured_spec()
        forced = self.forced_tools()
        if forced is None:
            return spec
        if spec is not None:
            raise BadRequest(f"tool_choice cannot be combined with {spec[2]}", "tool_choice")
        return "json", json.dumps(forced[1]), "tool_choice"

    def conversation(self) -> list[dict]:
        self.forced_tools()  # a bad tool_choice is a 400 before the template runs
        return [m.as_dict() for m in self.messages]

    def limits(self) -> tuple[int | None, int | None, int | None]:
        """(max_tokens, logprobs, prompt_logprobs) for SamplingParams."""
        max_tokens = self.max_completion_tokens or self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        if self.prompt_logprobs is not None and self.stream:
            raise BadRequest(
                "prompt_logprobs is not supported with stream: true", "prompt_logprobs"
            )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return max_tokens, logprobs, self.prompt_logprobs
