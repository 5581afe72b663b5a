"""vLLM's serving surface beyond the basics, against ``unikv serve`` in a
subprocess driven by the official ``openai`` client (and httpx for the routes the
client has no method for).

Oracles: the checkpoint's tokenizer (``/tokenize``, ``/detokenize``, chat
templates rendered by transformers' ``apply_chat_template``), ``LLM.generate``
in-process (tokens and logprobs), transformers' own log_softmax of the prompt
(``echo`` and ``prompt_logprobs``), a JSON parse of structured outputs.
"""

from __future__ import annotations

import math
import re

import httpx
import pytest
import torch
from engine_fixtures import one_thread  # noqa: F401  (a fixture)
from serving_fixtures import ServerProcess, save_instruct_llama

from unikv.engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
openai = pytest.importorskip("openai")
MAX_LEN = 256
THINK_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    "{% if tools %}<tools>{{ tools | length }}</tools>{% endif %}"
    "{% if add_generation_prompt %}[assistant]{% if enable_thinking %}<think>{% endif %}"
    "{% endif %}"
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("surface"))
    hf = save_instruct_llama(path)
    llm = LLM(path, device="cpu", page_size=4, max_model_len=MAX_LEN)
    return path, hf, llm


@pytest.fixture(scope="module")
def server(ckpt):
    proc = ServerProcess(ckpt[0], "--max-model-len", str(MAX_LEN), "--served-model-name", "tiny")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=60, max_retries=0)


def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + route, json=body, timeout=60)


def test_tokenize_detokenize_version(ckpt, server):
    tok = ckpt[2].tokenizer
    text = "The quick brown fox"
    r = _post(server, "/tokenize", {"model": "tiny", "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tok.encode(text)
    assert body == {"count": len(ids), "max_model_len": MAX_LEN, "tokens": ids,
                    "token_strs": tok.convert_ids_to_tokens(ids)}  # fmt: skip
    messages = [{"role": "user", "content": "Hi!"}]
    r = _post(server, "/tokenize", {"messages": messages})
    want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert r.json()["tokens"] == tok.encode(want, add_special_tokens=False)
    assert r.json()["token_strs"] is None
    r = _post(server, "/detokenize", {"model": "tiny", "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": tok.decode(ids)}
    r = _post(server, "/detokenize", {"tokens": [10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = _post(server, "/tokenize", {"prompt": "x", "model": "other"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    r = httpx.get(server.url + "/version", timeout=10)
    assert r.status_code == 200 and isinstance(r.json()["version"], str)
    assert httpx.get(server.url + "/ping", timeout=10).status_code == 200


def test_per_request_chat_template_and_its_kwargs(ckpt, server, client):
    _, _, llm = ckpt
    tok = llm.tokenizer
    messages = [{"role": "user", "content": "Hello, how are you"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for kwargs in ({}, {"enable_thinking": True}):
        rendered = tok.apply_chat_template(
            messages, chat_template=THINK_TEMPLATE, tokenize=False, add_generation_prompt=True,
            tools=tools, **kwargs,
        )  # fmt: skip
        assert ("<think>" in rendered) == bool(kwargs) and "<tools>1</tools>" in rendered
        body = {"messages": messages, "chat_template": THINK_TEMPLATE, "tools": tools,
                "chat_template_kwargs": kwargs}  # fmt: skip
        got = _post(server, "/tokenize", body).json()["tokens"]
        assert got == tok.encode(rendered, add_special_tokens=False)
        want = llm.generate(got, SamplingParams(max_tokens=8, temperature=0.0))[0]
        out = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, temperature=0,
            extra_body={"chat_template": THINK_TEMPLATE, "chat_template_kwargs": kwargs,
                        "tools": tools, "tool_choice": "none"},
        )  # fmt: skip
        message = out.choices[0].message
        if kwargs:  # the template opened a think block: the text is reasoning
            assert message.content is None and message.reasoning_content == want.text
        else:
            assert message.content == want.text
        assert out.usage.prompt_tokens == len(got)
    # continue_final_message: the last (assistant) message is left open
    partial = messages + [{"role": "assistant", "content": "I am"}]
    rendered = tok.apply_chat_template(
        partial, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert rendered.endswith("I am")
    got = llm.chat(partial, SamplingParams(max_tokens=4, temperature=0.0),
                   add_generation_prompt=False, continue_final_message=True)[0]  # fmt: skip
    assert got.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    got = llm.chat(messages, chat_template=THINK_TEMPLATE, tools=tools,
                   chat_template_kwargs={"enable_thinking": True})[0]  # fmt: skip
    assert tok.decode(got.prompt_token_ids).endswith("<tools>1</tools>[assistant]<think>")
    body = {"messages": partial, "continue_final_message": True, "add_generation_prompt": False}
    assert _post(server, "/tokenize", body).json()["tokens"] == tok.encode(
        rendered, add_special_tokens=False
    )
    want = llm.generate(rendered, SamplingParams(max_tokens=6, temperature=0.0))[0]
    out = client.chat.completions.create(
        model="tiny", messages=partial, max_tokens=6, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )  # fmt: skip
    assert out.choices[0].message.content == want.text
    r = _post(server, "/v1/chat/completions", {"model": "tiny", "messages": partial,
                                               "continue_final_message": True})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_unknown_fields_are_a_400_naming_them(server):
    for route, body in (
        ("/v1/completions", {"model": "tiny", "prompt": "x", "best_of_n_beams": 2}),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "guided_foo": "a"},
        ),
    ):
        r = _post(server, route, body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] in body and "unknown field" in error["message"], error


def test_completion_logprobs_hold_the_sampled_token_and_offsets_continue(ckpt, client):
    _, _, llm = ckpt
    prompt = "Hello, how are you"
    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=5, logprobs=1, ignore_eos=True)
    ref = llm.generate(prompt, sp)[0].outputs[0]
    kw = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": 5,
          "logprobs": 1, "extra_body": {"ignore_eos": True}}  # fmt: skip
    plain = client.completions.create(**kw).choices[0].logprobs
    chunks = [c for c in client.completions.create(**kw, stream=True) if c.choices]
    streamed_offsets = [o for c in chunks if c.choices[0].logprobs
                        for o in c.choices[0].logprobs.text_offset]  # fmt: skip
    assert streamed_offsets == plain.text_offset
    offset = 0
    for k, (token, lps) in enumerate(zip(ref.token_ids, ref.logprobs)):
        chosen = plain.tokens[k]
        top = plain.top_logprobs[k]
        assert chosen in top and math.isclose(top[chosen], lps[token].logprob, abs_tol=1e-4)
        assert math.isclose(plain.token_logprobs[k], lps[token].logprob, abs_tol=1e-4)
        assert plain.text_offset[k] == offset
        offset += len(chosen)
    assert len({len(t) for t in plain.top_logprobs} - {1, 2}) == 0


def test_include_usage_on_completions(ckpt, client):
    _, _, llm = ckpt
    want = llm.generate("The quick brown fox", SamplingParams(max_tokens=5, temperature=0.0))[0]
    chunks = list(
        client.completions.create(
            model="tiny", prompt="The quick brown fox", max_tokens=5, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == len(want.output_ids)
    assert last.usage.prompt_tokens == len(want.prompt_ids)
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].text for c in chunks[:-1]) == want.text


def _hf_prompt_logprobs(hf, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_echo_and_prompt_logprobs_equal_transformers(ckpt, server):
    _, hf, llm = ckpt
    tok = llm.tokenizer
    texts = ["The quick brown fox jumps over the lazy dog.", "Hello, how are you today?"]
    ids = [tok.encode(t) for t in texts]
    # lm-eval's local-completions loglikelihood request, as it sends it
    body = {"model": "tiny", "prompt": ids, "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}  # fmt: skip
    got = _post(server, "/v1/completions", body).json()
    choices = sorted(got["choices"], key=lambda c: c["index"])
    for p, choice in zip(ids, choices):
        want = _hf_prompt_logprobs(hf, p)
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(p) + 1 and lp["token_logprobs"][0] is None
        for a, b in zip(lp["token_logprobs"][1 : len(p)], want):
            assert math.isclose(a, b, abs_tol=1e-4), (a, b)
        assert lp["tokens"][: len(p)] == [tok.decode([t]) for t in p]
        assert choice["text"].startswith(tok.decode(p))
        nxt = llm.generate(p, SamplingParams(max_tokens=1, temperature=0.0))[0].output_ids
        assert lp["tokens"][-1] == tok.decode(nxt)
        for k in range(1, len(p)):  # the chosen token is in its top dict
            assert lp["tokens"][k] in lp["top_logprobs"][k]
    # max_tokens 0: the prompt alone; prompt_logprobs: vLLM's per-token dicts
    body = {"model": "tiny", "prompt": texts[1], "max_tokens": 0, "echo": True, "logprobs": 0,
            "prompt_logprobs": 2, "temperature": 0}  # fmt: skip
    got = _post(server, "/v1/completions", body).json()
    choice, p = got["choices"][0], ids[1]
    assert choice["text"] == texts[1] and got["usage"]["completion_tokens"] == 0
    assert len(choice["logprobs"]["tokens"]) == len(p)
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(p)
    want = _hf_prompt_logprobs(hf, p)
    for k in range(1, len(p)):
        assert math.isclose(plp[k][str(p[k])]["logprob"], want[k - 1], abs_tol=1e-4)
        assert len(plp[k]) in (2, 3)
    r = _post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_llm_prompt_logprobs_with_chunks_and_the_prefix_cache(ckpt):
    path, hf, _ = ckpt
    llm = LLM(path, device="cpu", page_size=4, max_model_len=MAX_LEN, max_num_batched_tokens=8,
              enable_prefix_caching=True)  # fmt: skip
    prompt = "The quick brown fox jumps over the lazy dog."
    plain = SamplingParams(max_tokens=4, temperature=0.0)
    first = llm.generate(prompt, plain)[0]  # its pages are cached now
    out = llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1))[0]
    ids = out.prompt_token_ids
    assert out.output_ids == first.output_ids and out.num_cached_tokens == 0
    want = _hf_prompt_logprobs(hf, ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for k in range(1, len(ids)):
        assert math.isclose(out.prompt_logprobs[k][ids[k]].logprob, want[k - 1], abs_tol=1e-4)
    assert llm.generate(prompt, plain)[0].prompt_logprobs is None


SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["fox", "dog", "cat"]}},
    "required": ["ok", "pick"],
    "additionalProperties": False,
}


def _check_schema(value) -> None:
    assert isinstance(value, dict) and set(value) == {"ok", "pick"}, value
    assert isinstance(value["ok"], bool) and value["pick"] in ("fox", "dog", "cat"), value


def test_structured_outputs(ckpt, client):
    import json
    import re

    pytest.importorskip("xgrammar")
    rf = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}}
    for seed in range(3):  # sampled at temperature 1: the grammar alone keeps it valid
        out = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Pick one"}], max_tokens=40,
            temperature=1.0, seed=seed, response_format=rf,
        )  # fmt: skip
        _check_schema(json.loads(out.choices[0].message.content))
        assert out.choices[0].finish_reason == "stop"
    for extra in ({"structured_outputs": {"json": SCHEMA}}, {"guided_json": SCHEMA}):
        out = client.completions.create(
            model="tiny", prompt="The quick brown fox", max_tokens=40, temperature=1.0, seed=7,
            extra_body=extra,
        )  # fmt: skip
        _check_schema(json.loads(out.choices[0].text))
    out = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=10, temperature=1.0, seed=3, n=3,
        extra_body={"structured_outputs": {"regex": "(yes|no)-[0-9]"}},
    )  # fmt: skip
    assert all(re.fullmatch("(yes|no)-[0-9]", c.text) for c in out.choices), out.choices
    out = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=10, temperature=1.0, seed=1,
        extra_body={"guided_choice": ["alpha", "beta gamma"]},
    )  # fmt: skip
    assert out.choices[0].text in ("alpha", "beta gamma")
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=12,
        temperature=0, response_format={"type": "json_object"},
    )  # fmt: skip
    text = out.choices[0].message.content
    assert text.lstrip().startswith(("{", "[")) or text.strip() == "", text
    if out.choices[0].finish_reason == "stop":
        json.loads(text)
    # a bad schema, two constraints at once: a 400 naming the field
    for body, field in (
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body=body)
        assert err.value.body["param"] == field, err.value.body


TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }}{% endfor %}</tools>"
    "{% endif %}"
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
    "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}<tool_call>{{ c['function']['name'] }}"
    "</tool_call>{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% if enable_thinking %}<think>\n{% endif %}{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip


def _sse(server, body: dict) -> list[dict]:
    import json

    r = httpx.post(server.url + "/v1/chat/completions", json=body | {"stream": True}, timeout=60)
    lines = [x[6:] for x in r.text.splitlines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]", r.text
    return [json.loads(x) for x in lines[:-1]]


def test_tool_calls_and_reasoning_are_parsed(ckpt, server, client):
    import json

    pytest.importorskip("xgrammar")
    # the tiny model is steered by a regex into the text a tool-calling model writes
    forced = ('<think>\nHm.\n</think>\n\nOk. <tool_call>\n'
              '{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>')  # fmt: skip
    regex = re.escape(forced)
    messages = [{"role": "user", "content": "Paris?"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 110, "temperature": 1.0,
            "seed": 2, "tools": [WEATHER], "chat_template": TOOL_TEMPLATE,
            "structured_outputs": {"regex": regex}}  # fmt: skip
    out = _post(server, "/v1/chat/completions", body).json()
    choice = out["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls", out
    assert msg["reasoning_content"] == "Hm.\n" and msg["content"] == "Ok. "
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    # the openai client reads them; a tool result goes back through the template
    got = client.chat.completions.create(**{k: v for k, v in body.items() if k not in (
        "chat_template", "structured_outputs")}, extra_body={"chat_template": TOOL_TEMPLATE,
        "structured_outputs": {"regex": regex}})  # fmt: skip
    assert got.choices[0].message.tool_calls[0].function.name == "weather"
    follow = messages + [
        {"role": "assistant", "content": None, "tool_calls": msg["tool_calls"]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
    ]
    r = _post(server, "/tokenize", {"messages": follow, "chat_template": TOOL_TEMPLATE})
    assert r.status_code == 200, r.text
    text = ckpt[2].tokenizer.decode(r.json()["tokens"])
    assert "<tool_call>weather</tool_call>[tool]sunny" in text
    # streamed: the same reasoning, content and call
    chunks = _sse(server, body)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
    # (as OpenAI streams a call: its id and name first, then the arguments in pieces)
    calls = [t for d in deltas for t in d.get("tool_calls") or ()]
    assert {t["index"] for t in calls} == {0} and calls[0]["function"]["name"] == "weather"
    assert all("id" not in t for t in calls[1:])
    args = "".join(t["function"]["arguments"] for t in calls)
    assert args == call["function"]["arguments"] and json.loads(args) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # tool_choice "none" and no tools: no parsing; a template with no tags: none either
    plain = _post(server, "/v1/chat/completions", body | {"tool_choice": "none"}).json()
    assert "tool_calls" not in plain["choices"][0]["message"]
    assert plain["choices"][0]["message"]["reasoning_content"] == "Hm.\n"
    bare = _post(server, "/v1/chat/completions", {**body, "chat_template": THINK_TEMPLATE.replace(
        "<think>", "")}).json()  # fmt: skip
    assert bare["choices"][0]["message"]["content"] == forced


def test_reasoning_opened_by_the_template(server):
    pytest.importorskip("xgrammar")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 60,
            "temperature": 0, "chat_template": TOOL_TEMPLATE,
            "chat_template_kwargs": {"enable_thinking": True},
            "structured_outputs": {"regex": re.escape("hmm\n</think>\n\nHello")}}  # fmt: skip
    msg = _post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "Hello", "reasoning_content": "hmm\n"}
    deltas = [c["choices"][0]["delta"] for c in _sse(server, body) if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "hmm\n"
    assert "".join(d.get("content") or "" for d in deltas) == "Hello"


HARMONY_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}{% if m['role'] == 'assistant' %}"
    "<|channel|>final{% endif %}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def test_harmony_channels_and_tool_calls(server):
    import json

    pytest.importorskip("xgrammar")
    forced = ("<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant<|channel|>"
              'commentary to=functions.weather <|constrain|>json<|message|>{"city": "P"}<|call|>')  # fmt: skip
    body = {"model": "tiny", "messages": [{"role": "user", "content": "P?"}], "max_tokens": 150,
            "temperature": 0, "chat_template": HARMONY_TEMPLATE, "tools": [WEATHER],
            "structured_outputs": {"regex": re.escape(forced)}}  # fmt: skip
    choice = _post(server, "/v1/chat/completions", body).json()["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls", choice
    assert msg["reasoning_content"] == "Need it." and msg["content"] is None
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "P"}
    deltas = [c["choices"][0]["delta"] for c in _sse(server, body) if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Need it."
    assert not "".join(d.get("content") or "" for d in deltas)
    calls = [t for d in deltas for t in d.get("tool_calls") or ()]
    assert [t["function"]["name"] for t in calls] == ["weather"]
    forced = (
        "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final<|message|>Hi!"
    )
    body |= {"structured_outputs": {"regex": re.escape(forced)}, "tools": None}
    msg = _post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "Hi!", "reasoning_content": "Hm."}
    deltas = [c["choices"][0]["delta"] for c in _sse(server, body) if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == "Hi!"


def test_only_the_requests_that_ask_are_constrained_or_scored(ckpt):
    """A batch mixing a structured request, a prompt-logprobs one and plain ones:
    the plain ones' tokens equal their tokens alone; the structured one parses."""
    import json

    pytest.importorskip("xgrammar")
    from unikv.engine.structured import compile_structured

    _, _, llm = ckpt
    prompts = ["The quick brown fox", "Hello, how are you", "A stop string", "unikv serves"]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=4, ignore_eos=True)
    alone = [llm.generate(prompts[0], greedy)[0], llm.generate(prompts[1], sampled)[0]]
    schema = compile_structured(llm, "json", json.dumps(SCHEMA))
    params = [greedy, sampled,
              SamplingParams(max_tokens=40, temperature=1.0, seed=1, structured=schema),
              SamplingParams(max_tokens=5, temperature=0.0, prompt_logprobs=1)]  # fmt: skip
    outs = llm.generate(prompts, params)
    assert [o.output_ids for o in outs[:2]] == [a.output_ids for a in alone]
    _check_schema(json.loads(outs[2].text))
    assert outs[3].prompt_logprobs is not None and outs[0].prompt_logprobs is None


def test_streamed_echo_equals_the_plain_answer(server):
    import json

    body = {"model": "tiny", "prompt": "Hello, how are you", "max_tokens": 6, "temperature": 0,
            "echo": True, "logprobs": 1, "ignore_eos": True}  # fmt: skip
    plain = _post(server, "/v1/completions", body).json()["choices"][0]
    r = httpx.post(server.url + "/v1/completions", json=body | {"stream": True}, timeout=60)
    chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(c["text"] for c in choices) == plain["text"]
    lps = [c["logprobs"] for c in choices if c["logprobs"]]
    for key in ("tokens", "token_logprobs", "text_offset", "top_logprobs"):
        assert [v for lp in lps for v in lp[key]] == plain["logprobs"][key], key
    body |= {"max_tokens": 0, "stream": True, "stream_options": {"include_usage": True}}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == body["prompt"]
    assert chunks[-1]["usage"]["completion_tokens"] == 0


CITY = {"type": "function", "function": {"name": "city", "parameters": {
    "type": "object", "properties": {"name": {"enum": ["Paris", "Rome"]}}, "required": ["name"],
    "additionalProperties": False}}}  # fmt: skip


def test_tool_choice_named_and_required_force_a_valid_call(server):
    import json

    pytest.importorskip("xgrammar")
    base = {"model": "tiny", "messages": [{"role": "user", "content": "Go"}], "max_tokens": 60,
            "temperature": 1.0, "tools": [WEATHER, CITY]}  # fmt: skip
    named = base | {"tool_choice": {"type": "function", "function": {"name": "city"}}}
    for seed in range(2):
        choice = _post(server, "/v1/chat/completions", named | {"seed": seed}).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "city"
        assert json.loads(call["function"]["arguments"])["name"] in ("Paris", "Rome")
    deltas = [c["choices"][0]["delta"] for c in _sse(server, named | {"seed": 0}) if c["choices"]]
    calls = [t for d in deltas for t in d.get("tool_calls") or ()]
    assert [t["function"]["name"] for t in calls] == ["city"]
    required = base | {"tool_choice": "required", "tools": [CITY], "seed": 3,
                       "parallel_tool_calls": False}  # fmt: skip
    choice = _post(server, "/v1/chat/completions", required).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    for call in choice["message"]["tool_calls"]:
        assert call["function"]["name"] == "city"
        assert json.loads(call["function"]["arguments"])["name"] in ("Paris", "Rome")
    for bad in ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
                {"tool_choice": "required", "tools": None},
                {"tool_choice": "required", "response_format": {"type": "json_object"}}):  # fmt: skip
        r = _post(server, "/v1/chat/completions", base | bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text


def test_fuzz_tokenize_and_detokenize_fields(server):
    """Each field of /tokenize (both forms) and /detokenize set to a value of any
    JSON type: a 200 or an OpenAI-shaped 400, never a 5xx."""
    import json

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                        st.floats(allow_nan=True), st.text(max_size=12))  # fmt: skip
    values = st.recursive(scalars, lambda v: st.lists(v, max_size=3) | st.dictionaries(
        st.text(max_size=5), v, max_size=3), max_leaves=6)  # fmt: skip
    bases = {
        "/tokenize": [{"prompt": "Hi"}, {"messages": [{"role": "user", "content": "Hi"}]}],
        "/detokenize": [{"tokens": [5, 6]}],
    }
    fields = {"/tokenize": ["model", "prompt", "add_special_tokens", "return_token_strs",
                            "messages", "add_generation_prompt", "continue_final_message",
                            "chat_template", "chat_template_kwargs", "tools", "junk"],
              "/detokenize": ["model", "tokens", "junk"]}  # fmt: skip

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def check(data):
        route = data.draw(st.sampled_from(sorted(bases)))
        body = dict(data.draw(st.sampled_from(bases[route])))
        body[data.draw(st.sampled_from(fields[route]))] = data.draw(values)
        raw = json.dumps(body).encode("utf-8", "surrogatepass")
        r = httpx.post(server.url + route, content=raw, timeout=30,
                       headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code in (200, 400), (body, r.status_code, r.text[:200])
        if r.status_code == 400:
            assert r.json()["error"]["type"] == "invalid_request_error"

    check()


def test_chat_prompt_logprobs_equal_transformers(ckpt, server):
    hf = ckpt[1]
    messages = [{"role": "user", "content": "Hello, how are you"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0,
            "prompt_logprobs": 1}  # fmt: skip
    got = _post(server, "/v1/chat/completions", body).json()
    ids = _post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    plp = got["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids) == got["usage"]["prompt_tokens"]
    for k, want in enumerate(_hf_prompt_logprobs(hf, ids), start=1):
        assert math.isclose(plp[k][str(ids[k])]["logprob"], want, abs_tol=1e-4)
    r = _post(server, "/v1/chat/completions", body | {"stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
