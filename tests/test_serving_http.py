"""The HTTP layer of ``foscar serve`` (:mod:`foscar.serving.http`) with the official ``openai``
client, sync and async, against a real server on 127.0.0.1 (a free port).

The server runs in this process, in a thread, on a tiny random Llama (2 layers; on the GPU
where there is one) with a byte-level tokenizer of 258 tokens and a chat template, and an INT4
foscar cache: every field of the API is checked for what it does, and the load test (256
concurrent requests, mixed streamed and not, a quarter cancelled midway, no client retries)
finishes in seconds. The random model's logits are near-flat, so ``logit_bias`` makes answers
predictable where a test needs that. ``foscar serve`` itself, with SmolLM2, is
:mod:`test_serving_server`'s.
"""

from __future__ import annotations

import asyncio
import gc
import json
import resource
import socket
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

MODEL = "tiny"
HI = [{"role": "user", "content": "hi"}]
#: the byte-level tokenizer's id of "A"
TOKEN_A = None  # set by the fixture


def tiny_tokenizer():
    """A byte-level tokenizer (256 byte tokens, then <|im_start|> and <|im_end|>) with a
    ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   bos_token="<|im_start|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return fast


def start_server(**server_args):
    """A :class:`ChatServer` on a tiny random Llama, started in a thread."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from foscar.serving import build_manager
    from foscar.serving.server import ChatServer

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=2048, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(config).eval()
    if torch.cuda.is_available():  # the GPU machine's run of these tests serves from the GPU
        model = model.to("cuda", torch.bfloat16)
    # no CUDA graphs: penalties, logit_bias and logprobs run on the host (refused under graphs)
    manager = build_manager(model, "int4", num_blocks=512, block_size=16, max_new_tokens=16,
                            eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
                            cuda_graphs=False)
    server = ChatServer(("127.0.0.1", 0), manager, tok, model_id=MODEL, **server_args)
    with torch.inference_mode():
        server.start()
    return server, tok


@pytest.fixture(scope="module")
def served():
    global TOKEN_A
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    server, tok = start_server(max_pending=64)
    TOKEN_A = tok.convert_tokens_to_ids("A")
    try:
        yield server
    finally:
        server.stop()
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def _wait_idle(server, timeout: float = 30) -> dict:
    """The server's stats once nothing is in flight and the KV pool is empty again."""
    deadline = time.monotonic() + timeout
    while True:
        stats = server.router.stats()
        if (stats["server"]["in_flight"] == 0 and stats["engine_requests"] == 0
                and stats["kv_free_share"] == 1.0):
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def _error(call) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as e:
        call()
    return e.value.status_code, e.value.body


# ---------------------------------------------------------------------------- chat
def test_a_chat_is_answered_as_openai_defines_it(client):
    answer = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=6)
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    (choice,) = answer.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length") and choice.logprobs is None
    usage = answer.usage
    assert usage.prompt_tokens > 0 and 1 <= usage.completion_tokens <= 6
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    again = client.chat.completions.create(
        model=MODEL, max_completion_tokens=6,
        messages=[{"role": "developer", "content": [{"type": "text", "text": "hi"}]}])
    assert again.choices[0].message.content  # developer reads as system; text parts joined


def test_logit_bias_and_max_tokens_shape_the_answer(client):
    forced = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=5,
                                            logit_bias={str(TOKEN_A): 100})
    assert forced.choices[0].message.content == "AAAAA"
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == 5


def test_stop_token_ids_and_stop_strings_end_the_answer(client, served):
    bias = {str(TOKEN_A): 100}
    before = served.router.stats()["server"]["stopped"]
    by_id = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=8,
                                           logit_bias=bias, extra_body={"stop_token_ids":
                                                                        [TOKEN_A]})
    assert by_id.choices[0].message.content == "" and by_id.choices[0].finish_reason == "stop"
    assert by_id.usage.completion_tokens == 1
    by_text = client.completions.create(model=MODEL, prompt="x", max_tokens=8, stop=["AAA"],
                                        logit_bias={str(TOKEN_A): 100, "66": 99.5})
    # "A" leads "B" by 0.5 everywhere: the answer is A's until the stop string
    assert by_text.choices[0].text == "" and by_text.choices[0].finish_reason == "stop"
    _wait_idle(served)
    assert served.router.stats()["server"]["stopped"] == before + 2  # cancelled in the engine


def test_n_choices_with_seeds(client, served):
    hot = {"temperature": 1.0, "max_tokens": 8, "seed": 11}
    forks = served.router.stats()["kv"].get("forks", 0)  # (none before the loop built its cache)
    three = client.chat.completions.create(model=MODEL, messages=HI, n=3, **hot)
    # the prompt was prefilled once and forked into the other two choices
    assert served.router.stats()["kv"]["forks"] == forks + 2
    assert [c.index for c in three.choices] == [0, 1, 2]
    texts = [c.message.content for c in three.choices]
    assert len(set(texts)) == 3, texts  # choice i draws with seed + i
    again = client.chat.completions.create(model=MODEL, messages=HI, n=3, **hot)
    assert [c.message.content for c in again.choices] == texts
    # choice 1 draws with seed 12: as the first choice of a request of that seed (both decode the
    # prompt's last token after the fork; a request of one choice prefills it with the rest)
    one = client.chat.completions.create(model=MODEL, messages=HI, n=2, **{**hot, "seed": 12})
    assert one.choices[0].message.content == texts[1]
    assert three.usage.completion_tokens <= 3 * 8
    greedy = client.chat.completions.create(model=MODEL, messages=HI, n=2, max_tokens=8)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


def test_top_k_1_and_min_p_1_sample_the_greedy_answer(client):
    greedy = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=8)
    text = greedy.choices[0].message.content
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        sampled = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=8,
                                                 temperature=1.5, seed=3, extra_body=extra)
        assert sampled.choices[0].message.content == text, extra
    wide = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=8,
                                          temperature=1.5, seed=3, extra_body={"min_p": 0.0})
    assert wide.choices[0].message.content != text


def test_penalties_change_what_repeats(client):
    def count_a(**fields) -> int:
        answer = client.completions.create(model=MODEL, prompt="q", max_tokens=10,
                                           logit_bias={str(TOKEN_A): 3.0}, **fields)
        return answer.choices[0].text.count("A")

    assert count_a() == 10
    # A's logit 3 - 2 * count falls below the others' (~0) after two A's
    assert count_a(frequency_penalty=2.0) == 2
    # presence alone: 3 - 2 keeps A ahead; with frequency 0.6 it falls behind after two
    assert count_a(presence_penalty=2.0) == 10
    assert count_a(presence_penalty=2.0, frequency_penalty=0.6) == 2
    assert count_a(extra_body={"repetition_penalty": 1.3}) == 10  # bias comes after it


def test_logprobs_are_the_models_own(client):
    answer = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=6,
                                            logprobs=True, top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    for token in content:
        tops = token.top_logprobs
        assert len(tops) == 3 and token.logprob <= 0
        assert tops[0].logprob == token.logprob  # greedy: the likeliest token
        assert tops[0].logprob >= tops[1].logprob >= tops[2].logprob
    text = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, logprobs=2)
    logprobs = text.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    assert all(len(t) <= 2 for t in logprobs.top_logprobs) and logprobs.text_offset[0] == 0
    plain = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3,
                                           logprobs=True)
    assert all(t.top_logprobs == [] for t in plain.choices[0].logprobs.content)


# ---------------------------------------------------------------------------- streams
def test_streams_carry_every_choice_and_the_usage(client):
    events = list(client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=5, n=2, stream=True,
        stream_options={"include_usage": True}, logit_bias={str(TOKEN_A): 100}))
    pieces = {0: "", 1: ""}
    finishes = {}
    for event in events[:-1]:
        (choice,) = event.choices
        pieces[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert pieces == {0: "AAAAA", 1: "AAAAA"} and finishes == {0: "length", 1: "length"}
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == 10
    text = "".join(e.choices[0].text for e in client.completions.create(
        model=MODEL, prompt="x", max_tokens=4, stream=True, logit_bias={str(TOKEN_A): 100}))
    assert text == "AAAA"


def test_async_client_many_at_once(served, client):
    expected = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=8)
    expected = expected.choices[0].message.content

    async def ask(aclient, stream: bool) -> str:
        if not stream:
            answer = await aclient.chat.completions.create(model=MODEL, messages=HI,
                                                           max_tokens=8)
            return answer.choices[0].message.content
        pieces = []
        async for event in await aclient.chat.completions.create(
                model=MODEL, messages=HI, max_tokens=8, stream=True):
            if event.choices:
                pieces.append(event.choices[0].delta.content or "")
        return "".join(pieces)

    async def main():
        async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused",
                                      max_retries=0) as aclient:
            return await asyncio.gather(*(ask(aclient, i % 2 == 1) for i in range(12)))

    assert asyncio.run(main()) == [expected] * 12


# ---------------------------------------------------------------------------- the rest
def _post(server, path: str, body: dict) -> dict:
    response = httpx.post(server.url + path, json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_completions_take_text_ids_and_lists(client, served):
    ids = _post(served, "/tokenize", {"prompt": "hello"})
    assert ids["count"] == 5 and ids["max_model_len"] == 512 * 16  # the pool's tokens
    assert _post(served, "/detokenize", {"tokens": ids["tokens"]}) == {"prompt": "hello"}
    by_text = client.completions.create(model=MODEL, prompt="hello", max_tokens=5)
    by_ids = client.completions.create(model=MODEL, prompt=ids["tokens"], max_tokens=5)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.object == "text_completion" and by_text.id.startswith("cmpl-")
    many = client.completions.create(model=MODEL, prompt=["hello", "hi"], n=2, max_tokens=5)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == by_text.choices[0].text == many.choices[1].text
    assert many.usage.prompt_tokens == 5 + 2
    lists = client.completions.create(model=MODEL, prompt=[ids["tokens"], [1, 2, 3]],
                                      max_tokens=5)
    assert lists.choices[0].text == by_text.choices[0].text and len(lists.choices) == 2
    chat_ids = _post(served, "/tokenize", {"messages": HI})
    template = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert _post(served, "/detokenize", {"tokens": chat_ids["tokens"]}) == {"prompt": template}


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).owned_by == "foscar"
    status, body = _error(lambda: client.models.retrieve("gpt-4"))
    assert status == 404 and body["param"] == "model"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
        ({"messages": [{"role": "tool", "content": "hi"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "hi", "name": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "9"}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": 3, "max_completion_tokens": 4}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"seed": 7.5}, "seed"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"100000": 1}}, "logit_bias"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [10**6]}, "stop_token_ids"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"best_of": 2}, "best_of"),
        ({"model": "gpt-4"}, "model"),
        ({"max_tokens": 9000}, "messages"),
    ],
)
def test_every_field_is_honoured_or_refused_by_name(served, fields, param):
    body = {"model": MODEL, "messages": HI, **fields}
    response = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=30)
    error = response.json()["error"]
    assert response.status_code == (404 if param == "model" else 400), error
    assert error["param"] == param and error["message"] and error["type"], error


def test_completion_fields_are_refused_by_name(served):
    for fields, param in [({"echo": True}, "echo"), ({"suffix": "x"}, "suffix"),
                          ({"prompt": []}, "prompt"), ({"prompt": [300]}, "prompt"),
                          ({"logprobs": 21}, "logprobs"), ({"prompt": "x", "foo": 1}, "foo")]:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2, **fields}
        response = httpx.post(served.url + "/v1/completions", json=body, timeout=30)
        assert response.status_code == 400, (fields, response.text)
        assert response.json()["error"]["param"] == param, (fields, response.text)


def test_bodies_routes_and_methods_answer_in_openai_schema(served):
    url = served.url
    for response, status in [
        (httpx.post(url + "/v1/chat/completions", content=b"{not json"), 400),
        (httpx.post(url + "/v1/chat/completions", content=b"[]"), 400),
        (httpx.post(url + "/v1/nothing", json={}), 404),
        (httpx.get(url + "/v1/chat/completions"), 405),
        (httpx.post(url + "/v1/chat/completions", content=b"x" * (2 << 20)), 413),
    ]:
        assert response.status_code == status, response.text
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert "JSON object" in httpx.post(url + "/v1/completions", content=b"[]").text
    # a body is JSON whatever its Content-Type says (curl -d sends a form's)
    form = httpx.post(url + "/v1/completions", content=b'{"prompt": "x", "max_tokens": 2}',
                      headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert form.status_code == 200 and form.json()["object"] == "text_completion"


def test_an_api_key_is_required_where_set():
    server, _ = start_server(api_key="sesame")
    try:
        bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
        status, body = _error(lambda: bad.models.list())
        assert status == 401 and body["code"] == "invalid_api_key"
        status, _ = _error(lambda: bad.chat.completions.create(model=MODEL, messages=HI))
        assert status == 401
        good = openai.OpenAI(base_url=server.url + "/v1", api_key="sesame", max_retries=0)
        assert good.models.list().data[0].id == MODEL
        assert httpx.get(server.url + "/health").status_code == 200
        assert httpx.get(server.url + "/metrics").status_code == 200
        assert httpx.get(server.url + "/stats").status_code == 401
    finally:
        server.stop()


def test_metrics_count_requests_and_the_pool(served, client):
    client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4)
    _wait_idle(served)
    text = httpx.get(served.url + "/metrics").text
    for name in ("foscar_requests_total", "foscar_time_to_first_token_seconds_bucket",
                 "foscar_time_per_output_token_seconds_count", "foscar_kv_blocks_in_use 0.0",
                 "foscar_kv_blocks_total 512.0", "foscar_queue_length 0.0",
                 "foscar_requests_in_flight 0.0", 'outcome="refused_400"'):
        assert name in text, name


# ---------------------------------------------------------------------------- under load
async def _one(aclient, i: int, cancel: bool) -> str:
    """One request of the load test; its outcome: ``ok``, ``refused`` (429/503 with
    Retry-After) or ``cancelled`` (by this client, midway). One in three asks for two choices
    (forks, streamed or not, some cancelled)."""
    n = 2 if i % 6 in (1, 2) else 1
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"request {i}"}],
            "max_tokens": 12, "logit_bias": {"257": -100}, "n": n}
    stream = i % 2 == 0
    try:
        if stream:
            events = await aclient.chat.completions.create(**body, stream=True)
            count, finish = 0, None
            async for event in events:
                count += 1
                if cancel and count == 3:
                    await events.close()
                    return "cancelled"
                finish = event.choices[0].finish_reason or finish
            assert finish == "length"
            return "ok"
        call = asyncio.ensure_future(aclient.chat.completions.create(**body))
        if cancel:
            await asyncio.sleep(0.05 + (i % 7) * 0.02)
            if not call.done():
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
                return "cancelled"
        answer = await call
        assert answer.usage.completion_tokens == 12 * n and len(answer.choices) == n
        return "ok"
    except openai.APIStatusError as e:
        assert e.status_code in (429, 503), e
        assert int(e.response.headers["retry-after"]) >= 1
        return "refused"


async def _wave(url: str, requests: int) -> list[str]:
    async with openai.AsyncOpenAI(
        base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120,
        http_client=openai.DefaultAsyncHttpxClient(
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024)),
    ) as aclient:
        return await asyncio.gather(*(_one(aclient, i, i % 4 == 3) for i in range(requests)))


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def test_256_concurrent_requests_are_each_answered_or_refused(served):
    """No request lost: each is answered, refused with 429 and Retry-After, or cancelled by its
    client midway; afterwards nothing is in flight and the KV pool is empty. Three waves: the
    server's memory (this process's, with the client's) grows by little after the first."""
    outcomes, rss = [], []
    forks = served.router.stats()["kv"].get("forks", 0)  # (none before the loop built its cache)
    for _ in range(3):
        outcomes.append(asyncio.run(_wave(served.url, 256)))
        stats = _wait_idle(served)
        gc.collect()
        rss.append(_rss_mb())
    for wave in outcomes:
        assert len(wave) == 256 and set(wave) <= {"ok", "refused", "cancelled"}
        assert wave.count("ok") >= 32 and wave.count("refused") >= 1, wave
    assert stats["server"]["peak_in_flight"] <= 64 and stats["server"]["refused"] > 0
    assert stats["kv"]["forks"] > forks  # requests of two choices were forked, the pool emptied
    assert len(served.state.sink) == 0
    assert rss[-1] - rss[1] < 40, rss


def test_slow_dead_and_malformed_clients_leave_it_serving(served, client):
    host, port = served.socket.getsockname()[:2]
    # a client that declares a body and sends part of it, then waits
    slow = socket.create_connection((host, port), timeout=10)
    slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: 500\r\n\r\n{\"messages\"")
    # a client killed mid-stream
    body = json.dumps({"model": MODEL, "messages": HI, "max_tokens": 400, "stream": True,
                       "logit_bias": {"257": -100}}).encode()
    dead = socket.create_connection((host, port), timeout=30)
    dead.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: " + str(len(body)).encode()
                 + b"\r\n\r\n" + body)
    received = b""
    while received.count(b"data: ") < 3:
        received += dead.recv(4096)
    cancelled = served.router.stats()["server"]["cancelled"]
    dead.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    dead.close()  # a reset, as a killed process leaves
    malformed = [
        b"GARBAGE\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n{{{{{",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n[]",
        b"GET /v1/models/%ff%fe HTTP/1.1\r\nHost: x\r\n\r\n",
        b"\x00\xff\x16\x03\x01 tls hello",
        b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\n{\"x\": 1}",
        b"DELETE /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n",
    ]
    answered = []

    def send(raw: bytes) -> None:
        with socket.create_connection((host, port), timeout=10) as sock:
            sock.sendall(raw)
            sock.shutdown(socket.SHUT_WR)
            data = sock.recv(65536)
            answered.append(data[:12])

    threads = []
    for i in range(1000):
        threads.append(threading.Thread(target=send, args=(malformed[i % len(malformed)],)))
        threads[-1].start()
        if i % 100 == 99:  # a real request between every hundred
            assert client.chat.completions.create(model=MODEL, messages=HI,
                                                  max_tokens=2).choices
            for t in threads:
                t.join(30)
            threads = []
    for t in threads:
        t.join(30)
    assert len(answered) == 1000
    assert all(a.startswith(b"HTTP/1.1 4") or a == b"" for a in answered), set(answered)
    assert client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3).choices
    slow.close()
    stats = _wait_idle(served)
    assert stats["server"]["cancelled"] >= cancelled + 1
    assert httpx.get(served.url + "/health").status_code == 200


# ---------------------------------------------------------------------------- the benchmark
def test_the_http_benchmark_measures_both_paths(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from foscar.serving.http_bench import run_http_bench

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)).eval()
    (result,) = run_http_bench(model, tok, ["int4"], out=tmp_path, name="http", command="test",
                               requests=4, prompt_tokens=8, new_tokens=6, rounds=1,
                               num_blocks=32, block_size=16, log=lambda line: None)
    assert result["step_ms_direct"] > 0 and result["step_ms_http"] > 0
    assert result["min_events_per_answer"] >= 2  # the answers streamed, token by token
    assert "share of a step" in (tmp_path / "http.md").read_text()
    assert json.loads((tmp_path / "http.json").read_text())["results"][0]["kv"] == "int4"


def test_a_tokens_bytes_are_its_own():
    """logprobs' ``bytes``: a byte-level token's own byte (half a character here), a byte
    fallback token's byte, else the text's UTF-8."""
    from foscar.serving.http.answers import TokenText

    tok = tiny_tokenizer()
    text_of = TokenText(tok)
    half = tok.encode("é")[0]  # é is two bytes, two tokens
    assert text_of(half) == ("\ufffd", ["é".encode()[0]])
    assert text_of(tok.convert_tokens_to_ids("A")) == ("A", [ord("A")])

    class Fallback:
        def decode(self, ids):
            return {0: "\ufffd", 1: "hé"}[ids[0]]

        def convert_ids_to_tokens(self, token):
            return {0: "<0xE2>", 1: "▁hé"}[token]

    fallback = TokenText(Fallback())
    assert fallback(0) == ("\ufffd", [0xE2]) and fallback(1) == ("hé", list("hé".encode()))
