"""The OpenAI-compatible API as vLLM serves it, driven by the official openai SDK."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import httpx
import openai
import pytest
from sim_helpers import SIM_PROMPTS, SIM_TOKENIZER, client, scrape

from gateway.sim import DEFAULT_MODEL

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]


def test_chat_non_streaming_parses_with_exact_usage(oai: openai.OpenAI) -> None:
    resp = oai.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=7)
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert resp.model == DEFAULT_MODEL
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    prompt = SIM_PROMPTS.chat(MESSAGES)
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(prompt)
    assert resp.usage.completion_tokens == 7
    assert resp.usage.total_tokens == len(prompt) + 7
    assert resp.usage.prompt_tokens_details is not None
    assert resp.usage.prompt_tokens_details.cached_tokens == 0
    # the reply is exactly 7 tokens of the same tokenizer
    assert len(SIM_TOKENIZER.encode(choice.message.content)) == 7


def test_chat_role_chunk_comes_with_the_first_token_not_before_the_prefill(make_sim: Callable[..., str]) -> None:
    """vLLM sends the role chunk on the engine's first output: a stream's first byte is its TTFT."""
    url = make_sim(time_scale=1.0, prefill_tokens_per_s=2000.0, decode_ms_per_token=200.0)
    long_messages = [{"role": "user", "content": "Explain the prefix cache. " * 120}]  # ~0.4 s of prefill
    stream = client(url).chat.completions.create(model=DEFAULT_MODEL, messages=long_messages, max_tokens=4, stream=True)
    first = next(iter(stream))
    assert first.choices[0].delta.role == "assistant"
    # when the role chunk arrives the prompt has been prefilled and a first token exists
    assert scrape(url)["vllm:generation_tokens_total"] >= 1
    assert scrape(url)["vllm:prompt_tokens_total"] > 600
    stream.close()


def test_chat_streaming_chunks_usage_and_done(oai: openai.OpenAI, sim: str) -> None:
    stream = oai.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=MESSAGES,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) == 5
    assert content_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.id == chunks[0].id for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5
    text = "".join(c.choices[0].delta.content for c in content_chunks)
    full = oai.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=5)
    assert text == full.choices[0].message.content  # same seed + prompt = same text
    # the raw SSE ends with [DONE]; without include_usage there is no usage chunk
    raw = httpx.post(
        sim + "/v1/chat/completions",
        json={"model": DEFAULT_MODEL, "messages": MESSAGES, "max_tokens": 2, "stream": True},
    )
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = [line for line in raw.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert all('"usage"' not in e for e in events)


def test_completions_prompt_forms(oai: openai.OpenAI) -> None:
    tok = SIM_PROMPTS
    one = oai.completions.create(model=DEFAULT_MODEL, prompt="The capital of France is", max_tokens=4)
    assert one.object == "text_completion" and len(one.choices) == 1
    # vLLM adds Llama's <|begin_of_text|> to a completions prompt
    assert one.usage is not None and one.usage.prompt_tokens == len(tok.completion("The capital of France is"))
    assert one.usage.prompt_tokens == len(SIM_TOKENIZER.encode("The capital of France is")) + 1

    ids = tok.completion("The capital of France is")
    by_ids = oai.completions.create(model=DEFAULT_MODEL, prompt=ids, max_tokens=4)
    assert by_ids.choices[0].text == one.choices[0].text
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(ids)

    many = oai.completions.create(model=DEFAULT_MODEL, prompt=["alpha beta", "gamma"], max_tokens=3)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.usage is not None
    assert many.usage.prompt_tokens == len(tok.completion("alpha beta")) + len(tok.completion("gamma"))
    assert many.usage.completion_tokens == 6

    lists = oai.completions.create(model=DEFAULT_MODEL, prompt=[ids, ids[:2]], max_tokens=2)
    assert len(lists.choices) == 2

    echoed = oai.completions.create(model=DEFAULT_MODEL, prompt="Echo me", max_tokens=2, echo=True)
    assert echoed.choices[0].text.startswith("Echo me")


def test_completions_streaming(oai: openai.OpenAI) -> None:
    chunks = list(
        oai.completions.create(
            model=DEFAULT_MODEL, prompt="Once", max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) == 4
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


def test_n_choices_and_default_length(oai: openai.OpenAI, make_sim) -> None:
    resp = oai.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, n=3, max_tokens=4)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert len({c.message.content for c in resp.choices}) > 1  # choices differ, like sampling
    assert resp.usage is not None and resp.usage.completion_tokens == 12
    # without max_tokens the "model" stops by itself after --max-output-tokens
    url = make_sim(max_output_tokens=9)
    resp = client(url).chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES)
    assert resp.usage is not None and resp.usage.completion_tokens == 9
    assert resp.choices[0].finish_reason == "stop"


def test_output_is_deterministic_per_seed(make_sim) -> None:
    a1, a2, b = (client(make_sim(seed=s)) for s in (1, 1, 2))

    def reply(c: openai.OpenAI) -> str:
        r = c.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=12)
        return r.choices[0].message.content or ""

    assert reply(a1) == reply(a2)
    assert reply(a1) != reply(b)


def test_unknown_fields_max_completion_tokens_and_vllm_extensions(oai: openai.OpenAI) -> None:
    resp = oai.chat.completions.create(
        model=DEFAULT_MODEL,
        messages=MESSAGES,
        max_completion_tokens=3,
        temperature=0.2,
        top_p=0.9,
        extra_body={"top_k": 5, "ignore_eos": True, "repetition_penalty": 1.1, "min_tokens": 1, "whatever": [1]},
    )
    assert resp.usage is not None and resp.usage.completion_tokens == 3


def test_models_health_version(sim: str, oai: openai.OpenAI) -> None:
    models = oai.models.list()
    (card,) = models.data
    assert card.id == DEFAULT_MODEL and card.owned_by == "vllm"
    raw = httpx.get(sim + "/v1/models").json()
    assert raw["data"][0]["max_model_len"] == 32768
    health = httpx.get(sim + "/health")
    assert health.status_code == 200 and health.content == b""
    assert "version" in httpx.get(sim + "/version").json()


def test_lora_modules_are_served_models(make_sim) -> None:
    url = make_sim(lora_modules=["sql-adapter"])
    c = client(url)
    assert [m.id for m in c.models.list().data] == [DEFAULT_MODEL, "sql-adapter"]
    resp = c.completions.create(model="sql-adapter", prompt="SELECT", max_tokens=2)
    assert resp.model == "sql-adapter"


def test_tokenize_and_detokenize(sim: str) -> None:
    out = httpx.post(sim + "/tokenize", json={"model": DEFAULT_MODEL, "prompt": "Hello world"}).json()
    assert out["tokens"] == SIM_PROMPTS.completion("Hello world") and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 32768
    chat = httpx.post(sim + "/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == SIM_PROMPTS.chat(MESSAGES)
    back = httpx.post(sim + "/detokenize", json={"tokens": out["tokens"]}).json()
    assert back["prompt"] == "<|begin_of_text|>Hello world"


def test_embeddings_float_and_base64(oai: openai.OpenAI, sim: str) -> None:
    # the SDK asks for base64 by default and decodes it
    resp = oai.embeddings.create(model=DEFAULT_MODEL, input=["hello world", "hello world", "something else"])
    vectors = [d.embedding for d in resp.data]
    assert len(vectors) == 3 and len(vectors[0]) == 32
    assert vectors[0] == pytest.approx(vectors[1]) and vectors[0] != pytest.approx(vectors[2])
    assert sum(v * v for v in vectors[0]) == pytest.approx(1.0, rel=1e-4)
    tok = SIM_TOKENIZER
    assert resp.usage.prompt_tokens == 2 * len(tok.encode("hello world")) + len(tok.encode("something else"))
    raw = httpx.post(
        sim + "/v1/embeddings", json={"input": tok.encode("hello world"), "encoding_format": "float", "dimensions": 8}
    ).json()
    assert raw["object"] == "list" and len(raw["data"][0]["embedding"]) == 8


def test_usage_details_absent_when_disabled(make_sim) -> None:
    url = make_sim(enable_prompt_tokens_details=False)
    resp = client(url).chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=1)
    assert resp.usage is not None and resp.usage.prompt_tokens_details is None
    raw = httpx.post(url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).json()
    assert raw["usage"]["prompt_tokens_details"] is None  # vLLM 0.32 sends the null
    stream = httpx.post(
        url + "/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 1, "stream": True, "stream_options": {"include_usage": True}},
    ).text
    last = json.loads(stream.split("data: ")[-2])
    assert "prompt_tokens_details" not in last["usage"]  # a stream leaves it out


# -- errors: vLLM's shape and status, never a crash or a hang ----------------------------------


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()["error"]
    assert set(body) >= {"message", "type", "code"} and body["code"] == status
    return body


def test_unknown_model_is_404(oai: openai.OpenAI, sim: str) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        oai.chat.completions.create(model="nope", messages=MESSAGES)
    assert "nope" in str(info.value)
    body = _error(httpx.post(sim + "/v1/completions", json={"model": "nope", "prompt": "x"}), 404)
    assert body["type"] == "NotFoundError"


def test_context_length_rules_are_vllm_0_32s(make_sim) -> None:
    """A prompt over max_model_len is a 400; prompt + max_tokens over it is served with the
    output clamped (200, finish_reason "length"); max_tokens alone over it is a 400; each
    message ends with vLLM's (parameter=..., value=...)."""
    url = make_sim(max_model_len=64)
    c = client(url)
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model=DEFAULT_MODEL, prompt="word " * 100)
    assert info.value.body["message"] == (  # type: ignore[index]
        "This model's maximum context length is 64 tokens. However, your prompt contains at least 65 input "
        "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input "
        "prompt. (parameter=input_tokens, value=65)"  # text is tokenized with truncation to 65 tokens
    )
    assert info.value.body["param"] == "input_tokens"  # type: ignore[index]
    ids = SIM_PROMPTS.completion("word " * 100)  # token ids are counted as they are
    err = _error(httpx.post(url + "/v1/completions", json={"prompt": ids}), 400)
    assert f"your prompt contains {len(ids)} input tokens" in err["message"]
    assert err["message"].endswith(f"(parameter=input_tokens, value={len(ids)})")

    clamped = c.completions.create(model=DEFAULT_MODEL, prompt="word " * 10, max_tokens=60)
    assert clamped.usage is not None and clamped.usage.total_tokens == 64
    assert clamped.usage.completion_tokens == 64 - clamped.usage.prompt_tokens
    assert clamped.choices[0].finish_reason == "length"

    for path, body, param in (
        ("/v1/completions", {"prompt": "x", "max_tokens": 65}, "max_tokens"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 65}, "max_tokens"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 65}, "max_completion_tokens"),
    ):
        err = _error(httpx.post(url + path, json=body), 400)
        assert err == {
            "message": f"{param}=65 cannot be greater than max_model_len=64. Please request fewer output tokens. "
            f"(parameter={param}, value=65)",
            "type": "BadRequestError",
            "param": param,
            "code": 400,
        }
    # a prompt that fills the context leaves max_tokens 0: vLLM's sampling-params error
    exact = [7] * 64
    err = _error(httpx.post(url + "/v1/completions", json={"prompt": exact}), 400)
    assert err["message"] == "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"
    # a KV cache smaller than max_model_len clamps it (vLLM would refuse to start); one of the
    # blocks is vLLM's null block
    small = make_sim(num_gpu_blocks=5, block_size=16)
    assert httpx.get(small + "/v1/models").json()["data"][0]["max_model_len"] == 64


@pytest.mark.parametrize(
    ("extra", "message", "param"),
    [
        (
            {"temperature": -1},
            "temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)",
            "temperature",
        ),
        (
            {"temperature": 2.5},
            "temperature must be in [0, 2], got 2.5. (parameter=temperature, value=2.5)",
            "temperature",
        ),
        ({"top_p": 2}, "top_p must be in (0, 1], got 2.0. (parameter=top_p, value=2.0)", "top_p"),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)", "top_p"),
        ({"presence_penalty": 3}, "presence_penalty must be in [-2, 2], got 3.0.", None),
        ({"frequency_penalty": -2.5}, "frequency_penalty must be in [-2, 2], got -2.5.", None),
        ({"repetition_penalty": 0}, "repetition_penalty must be greater than zero, got 0.0.", None),
        ({"top_k": -2}, "top_k must be 0 (disable), or at least 1, got -2.", None),
        ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5.", None),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)", "max_tokens"),
        ({"temperature": 0, "n": 2}, "n must be 1 when using greedy sampling, got 2.", None),
        ({"n": 0}, "n must be at least 1, got 0.", None),
    ],
)
def test_invalid_sampling_parameters_are_vllms_400(sim: str, extra: dict, message: str, param: str | None) -> None:
    for path, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "hi"})):
        err = _error(httpx.post(sim + path, json={**body, **extra}), 400)
        assert (err["message"], err["type"], err["param"]) == (message, "BadRequestError", param)


def test_valid_sampling_parameters_are_served(oai: openai.OpenAI) -> None:
    resp = oai.chat.completions.create(
        model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=2, temperature=0, top_p=0.5, presence_penalty=2, n=1
    )
    assert resp.choices[0].finish_reason == "length"
    assert oai.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=2, n=3).usage is not None


def test_request_validation_errors_are_vllms(sim: str) -> None:
    """FastAPI's shape as vLLM 0.32 renders it: a count, one dict per error, the body path."""
    err = _error(httpx.post(sim + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": "many"}), 400)
    assert err == {
        "message": "1 validation error:\n  {'type': 'int_parsing', 'loc': 'body.max_tokens', 'msg': 'Input should "
        "be a valid integer, unable to parse string as an integer', 'input': 'many'}",
        "type": "Bad Request",
        "param": "body.max_tokens",
        "code": 400,
    }
    err = _error(httpx.post(sim + "/v1/chat/completions", json={"model": DEFAULT_MODEL, "max_tokens": 4}), 400)
    assert err["message"] == (
        "1 validation error:\n  {'type': 'missing', 'loc': 'body.messages', 'msg': 'Field required', "
        "'input': '<dict of 2 items>'}"
    )


def test_vllms_before_validators_name_their_parameter(sim: str) -> None:
    """cache_salt and stream_options are checked before the rest of the request, as vLLM's
    "before" model validators: a value_error on the whole body, param the checked field."""
    body = {"messages": MESSAGES, "cache_salt": ""}
    err = _error(httpx.post(sim + "/v1/chat/completions", json=body), 400)
    assert err["param"] == "cache_salt" and err["type"] == "Bad Request"
    assert err["message"] == (
        "1 validation error:\n  {'type': 'value_error', 'loc': 'body', 'msg': \"Value error, Parameter 'cache_salt' "
        "must be a non-empty string if provided. (parameter=cache_salt)\", 'input': '<dict of 2 items>', 'ctx': "
        "{'error': VLLMValidationError(\"Parameter 'cache_salt' must be a non-empty string if provided.\")}}"
    )
    for salt in ("x" * 129, "tenant@1", "a\\b", "nul\x00"):
        err = _error(httpx.post(sim + "/v1/completions", json={"prompt": "x", "cache_salt": salt}), 400)
        assert "must be at most 128 characters" in err["message"] and err["param"] == "cache_salt"
    assert httpx.post(
        sim + "/v1/completions", json={"prompt": "x", "max_tokens": 1, "cache_salt": "x" * 128}
    ).is_success
    err = _error(httpx.post(sim + "/v1/chat/completions", json={"messages": MESSAGES, "stream_options": {"a": 1}}), 400)
    assert (
        err["param"] == "stream_options" and "Stream options can only be defined when `stream=True`." in err["message"]
    )
    # an empty stream_options is falsy to vLLM: accepted
    ok = httpx.post(sim + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, "stream_options": {}})
    assert ok.status_code == 200


def test_tool_choice_needs_the_parser_when_auto_tools_are_off(make_sim) -> None:
    url = make_sim(enable_auto_tool_choice=False)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"messages": MESSAGES, "tools": tools, "max_tokens": 2}
    err = _error(httpx.post(url + "/v1/chat/completions", json=body), 400)
    assert err["message"] == '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    assert err["param"] is None
    err = _error(httpx.post(url + "/v1/chat/completions", json={**body, "tool_choice": "required"}), 400)
    assert err["message"] == 'tool_choice="required" requires --tool-call-parser to be set'
    ok = httpx.post(url + "/v1/chat/completions", json={**body, "tool_choice": "none"})
    assert ok.status_code == 200
    assert httpx.post(url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}).status_code == 200


_TOOLS_WITHOUT_USER = json.dumps(
    {"messages": [{"role": "system", "content": "s"}], "tools": [{"type": "function", "function": {"name": "f"}}]}
).encode()
_TWO_CALLS = [{"function": {"name": n, "arguments": "{}"}} for n in ("a", "b")]
_TWO_TOOL_CALLS = json.dumps(
    {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": _TWO_CALLS}]}
).encode()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", b"{not json"),
        ("/v1/chat/completions", b""),
        ("/v1/chat/completions", b"[]"),
        ("/v1/chat/completions", b'{"model": "demo-model"}'),
        ("/v1/chat/completions", b'{"messages": "hello"}'),
        ("/v1/chat/completions", b'{"messages": [{"content": "no role"}]}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 0}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "cache_salt": ""}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "stream": "maybe"}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "stream_options": {"a": 1}}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "cache_salt": "a/b"}'),
        ("/v1/completions", b'{"prompt": "x", "cache_salt": 5}'),
        # Llama 3.1's template refuses these, so vLLM answers 400 (tools need a user message;
        # one tool call per assistant turn)
        ("/v1/chat/completions", _TOOLS_WITHOUT_USER),
        ("/v1/chat/completions", _TWO_TOOL_CALLS),
        ("/v1/completions", b'{"prompt": ""}'),
        ("/v1/completions", b'{"prompt": []}'),
        ("/v1/completions", b'{"prompt": [-1, 5]}'),
        ("/v1/completions", b'{"prompt": [1, "a"]}'),
        ("/v1/completions", b'{"prompt": {"a": 1}}'),
        ("/v1/embeddings", b'{"input": ""}'),
        ("/v1/embeddings", b'{"input": "x", "encoding_format": "hex"}'),
        ("/tokenize", b"{}"),
        ("/detokenize", b'{"tokens": [99999999]}'),
    ],
)
@pytest.mark.slow
def test_bad_input_gets_a_400(sim: str, path: str, body: bytes) -> None:
    resp = httpx.post(sim + path, content=body, headers={"content-type": "application/json"})
    err = _error(resp, 400)
    # vLLM 0.32: request-model validation is FastAPI's "Bad Request" with the body path as
    # param; checks in the server code are "BadRequestError"
    if err["type"] == "Bad Request":
        assert re.match(r"\d+ validation errors?:\n  \{'type': ", err["message"]), err["message"]
        # the body path, or the field a vLLM "before" validator names (cache_salt, stream_options)
        assert err["param"].startswith("body") or err["param"] in ("cache_salt", "stream_options")
    else:
        assert err["type"] == "BadRequestError" and err["message"]


def test_unknown_route_and_method(sim: str) -> None:
    assert httpx.get(sim + "/v1/nothing").status_code == 404
    assert httpx.get(sim + "/v1/chat/completions").status_code == 405


def test_server_keeps_serving_after_bad_input(oai: openai.OpenAI, sim: str) -> None:
    for body in (b"\xff\xfe", b'{"messages": null}', b"1" * 10000):
        assert httpx.post(sim + "/v1/chat/completions", content=body).status_code == 400
    resp = oai.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=1)
    assert resp.usage is not None


def test_caching_tokenizer_is_exact_and_bounded() -> None:
    from gateway.sim.tokencache import CachingTokenizer

    inner = SIM_TOKENIZER
    cached = CachingTokenizer(inner, max_chars=8000)
    texts = [f"document {i}: " + "lorem ipsum dolor sit amet " * 60 for i in range(6)]  # ~1,600 chars each
    for text in [*texts, *reversed(texts)]:
        assert cached.encode(text) == inner.encode(text)
    assert cached.hits >= 3 and cached.misses >= 6 and cached._chars <= 8000
    out = cached.encode(texts[-1])
    out.append(1)  # callers may mutate what they get without corrupting the cache
    assert cached.encode(texts[-1]) == inner.encode(texts[-1])
