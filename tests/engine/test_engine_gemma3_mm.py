"""Gemma-3 multimodal (``Gemma3ForConditionalGeneration``, the class of every
released Gemma-3 from 4B up) through ``unikv.engine.LLM``: unikv loads the text
decoder from the wrapper's checkpoint (``language_model.model.*``, the untied
``language_model.lm_head``), skips the SigLIP tower and its projector with a log
line, and refuses a request carrying an image. Checked against transformers' own
wrapper (eager, fp32) on the same weights, text-only.

The tiny text config is ``engine_fixtures.tiny_gemma_config("gemma3")`` (7 layers,
five sliding of window 7 per full one, per-type rope, head_dim 24, final cap 3),
untied, with every norm weight drawn away from its zero init.

- greedy tokens for 24 new tokens over prompts of 5, 17, 33 and 60 tokens at page
  sizes 1, 4 and 16, sampled logit rows within 1e-4 of the wrapper's;
- 7-token steps cutting prompts mid-way; a tight pool that preempts;
- the byte oracle: each request's K/V rows read from the raw pool buffer right after
  prefill equal the wrapper's cache (all positions on full layers, the last W - 1 on
  sliding ones);
- images are refused at the LLM (``generate``, ``chat``) and at the server's parser,
  and the engine keeps serving.
"""

from __future__ import annotations

import logging

import pytest
import torch
from engine_fixtures import (
    GreedyReference,
    check_chunked_prefill,
    check_greedy_run,
    check_tight_pool,
    engine_llm,
    one_thread,  # noqa: F401  (a fixture)
)
from family_fixtures import AfterPrefill, kv_rows, save_tiny_gemma3_mm

from unikv.engine import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT_LENS = [5, 17, 33, 60]
NEW_TOKENS = 24
WINDOW = 7


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> GreedyReference:
    path = str(tmp_path_factory.mktemp("gemma3_mm"))
    return GreedyReference(save_tiny_gemma3_mm(path), path, PROMPT_LENS, NEW_TOKENS)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_greedy_matches_transformers(ref, page_size, caplog):
    from unikv.models.gemma import GemmaForCausalLM

    with caplog.at_level(logging.INFO, logger="unikv.models.loader"):
        llm = engine_llm(ref, page_size=page_size)
    assert "vision_tower." in caplog.text and "text decoder only" in caplog.text
    assert isinstance(llm.model, GemmaForCausalLM)
    assert llm.config.architecture == "Gemma3ForConditionalGeneration"
    assert sorted(llm.pool.subpools) == ["full", "swa"]
    assert llm.pool.subpools["swa"].spec.sliding_window == WINDOW
    # the wrapper, unlike Gemma3ForCausalLM, never soft-caps its final logits
    assert ref.hf.config.text_config.final_logit_softcapping == 3.0
    assert not llm.model.finishes_logits
    check_greedy_run(ref, llm)


def test_chunked_prefill_cuts_prompts_mid_way(ref):
    check_chunked_prefill(ref, engine_llm)


def test_tight_pool_preempts_with_same_tokens(ref):
    check_tight_pool(ref, engine_llm)


def test_kv_rows_match_transformers_cache(ref):
    text = ref.hf.config.text_config
    heads, d = text.num_key_value_heads, text.head_dim
    full = [i for i, t in enumerate(text.layer_types) if t == "full_attention"]

    def grab(llm, r):
        return {**kv_rows(llm, r, "full", heads, d, torch.float32),
                **kv_rows(llm, r, "swa", heads, d, torch.float32)}  # fmt: skip

    copier = AfterPrefill(grab)
    llm = engine_llm(ref, page_size=4)
    llm.generate(ref.prompts, SamplingParams(max_tokens=2, temperature=0.0), on_step=copier)
    assert sorted(copier.seen) == PROMPT_LENS
    for prompt in ref.prompts:
        with torch.no_grad():
            cache = ref.hf(torch.tensor([prompt]), use_cache=True).past_key_values
        rows = copier.seen[len(prompt)]
        assert sorted(rows) == list(range(text.num_hidden_layers))
        for layer, (pos, keys, values) in rows.items():
            hf_k = cache.layers[layer].keys[0].transpose(0, 1)  # (kept, H, D)
            hf_v = cache.layers[layer].values[0].transpose(0, 1)
            kept = hf_k.shape[0]
            assert kept == (len(prompt) if layer in full else min(len(prompt), WINDOW - 1))
            tail = pos >= len(prompt) - kept
            assert int(tail.sum()) == kept, f"layer {layer}: a needed page was freed"
            torch.testing.assert_close(keys[tail], hf_k, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(values[tail], hf_v, atol=1e-5, rtol=1e-5)


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def test_images_are_refused_at_the_llm_and_the_engine_keeps_serving(ref):
    llm = engine_llm(ref)
    for prompt in ({"prompt": "a cat", "multi_modal_data": {"image": object()}},
                   [ref.prompts[0], {"prompt_token_ids": [1, 2], "images": [b"png"]}]):  # fmt: skip
        with pytest.raises(ValueError, match="vision tower is not loaded"):
            llm.generate(prompt, SamplingParams(max_tokens=2))
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is"}, IMAGE]}]
    with pytest.raises(ValueError, match=r"messages\[0\].content: .*vision tower is not loaded"):
        llm.chat(messages, SamplingParams(max_tokens=2))
    out = llm.generate(ref.prompts[:2], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    assert [o.output_ids for o in out] == ref.greedy[:2]


def test_an_image_placeholder_token_is_refused(ref):
    """The wrapper's image placeholder id (``image_token_index``) stands for an image
    the vision tower would fill: a prompt holding it is refused. The tiny vocabulary
    is below Gemma-3's 262144, so the check is shown with a placeholder moved into it
    (the model config is replaced for that one call)."""
    import dataclasses

    llm = engine_llm(ref)
    assert ref.hf.config.image_token_index == 262144
    assert llm.config.media_token_ids == (262144,)
    config = llm.prompts.config  # the prompt maker checks each prompt's ids
    llm.prompts.config = dataclasses.replace(config, media_token_ids=(ref.prompts[1][3],))
    try:
        with pytest.raises(ValueError, match=r"image placeholder token .*vision tower"):
            llm.generate(ref.prompts[1], SamplingParams(max_tokens=2))
    finally:
        llm.prompts.config = config
    (out,) = llm.generate([ref.prompts[1]], SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    assert out.output_ids == ref.greedy[1]


def test_images_are_refused_by_the_server_parser():
    """The server's chat parser answers 400 on ``messages`` for an image part, with
    the same words (``serving/protocol.py``; the 400 mapping is test_serving's)."""
    from unikv.serving.protocol import BadRequest, ChatCompletionRequest

    body = {"model": "m", "messages": [{"role": "user", "content": [IMAGE]}]}
    request = ChatCompletionRequest.model_validate(body)
    with pytest.raises(BadRequest, match="vision tower is not loaded") as err:
        request.messages[0].as_dict()
    assert err.value.param == "messages"
