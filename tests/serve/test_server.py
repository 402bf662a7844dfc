"""The OpenAI-compatible server against the `openai` client on localhost: completions and chat completions, plain
and streamed (SSE), 4xx JSON errors for bad requests, and a client that disconnects mid-stream frees its pages."""
from __future__ import annotations

import socket
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="the server needs the [serve] extra: pip install -e '.[serve]'")
uvicorn = pytest.importorskip("uvicorn", reason="the server needs the [serve] extra: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="the server test's client: pip install openai")

from warpforge.serve import LLM, SamplingParams  # noqa: E402
from warpforge.serve.server import create_app  # noqa: E402


@pytest.fixture(scope="module")
def server(llama_dir):
    llm = LLM(llama_dir, page_size=8, num_pages=64)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(create_app(llm, "tiny"), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    assert srv.started
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
    yield llm, client, port
    srv.should_exit = True
    thread.join(timeout=10)


def test_completions_plain_and_streamed(server, llama_dir):
    llm, client, _ = server
    want = LLM(llama_dir, page_size=8, num_pages=32).generate("hello", SamplingParams(max_tokens=8, temperature=0))[0]
    got = client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0)
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason
    assert got.usage.completion_tokens == len(want.token_ids)
    chunks = list(client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


def test_chat_completions_plain_and_streamed(server):
    llm, client, _ = server
    msgs = [{"role": "user", "content": "the quick brown fox"}]
    got = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
    text = got.choices[0].message.content
    assert got.choices[0].message.role == "assistant" and got.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[0].choices[0].delta.role == "assistant"


@pytest.mark.parametrize("kw", [dict(max_tokens=-1), dict(temperature=-2.0), dict(top_p=3.0), dict(n=2),
                                dict(model="other")])
def test_bad_requests_are_400_json(server, kw):
    _, client, _ = server
    args = dict(model="tiny", prompt="hello", max_tokens=4) | kw
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**args)
    assert info.value.status_code == 400


def test_malformed_body_is_400(server):
    import urllib.error
    import urllib.request
    _, _, port = server
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=b'{"max_tokens": 3}',
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req)
    assert info.value.code == 400
    assert b'"error"' in info.value.read()


def test_disconnecting_client_frees_its_pages(server):
    llm, client, port = server
    aborted = llm.metrics.aborted
    stream = client.completions.create(model="tiny", prompt="hello", max_tokens=200, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.choices[0].text is not None
    stream.close()  # the client goes away mid-generation
    deadline = time.time() + 20
    while (llm.engine.has_unfinished() or llm.cache.allocator.pages_in_use) and time.time() < deadline:
        time.sleep(0.05)
    assert not llm.engine.has_unfinished() and llm.cache.allocator.pages_in_use == 0
    assert llm.cache.allocator.check_no_leaks()
    assert llm.metrics.aborted == aborted + 1  # stopped by the disconnect, not by running to its end


def test_chat_template_from_tokenizer_config(llama_dir, tmp_path):
    import json
    import shutil

    from warpforge.serve.server import _chat_prompt
    from warpforge.serve.tokenizer import load_tokenizer
    shutil.copy(llama_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tok = load_tokenizer(tmp_path)
    assert _chat_prompt(tok, [{"role": "user", "content": "hi"}]) == "<user>hi<assistant>"


def test_sixty_four_concurrent_streaming_clients(server, llama_dir):
    """64 clients stream at once (more than the 64 pages hold, so the engine preempts and recomputes): every one gets
    the text it gets alone, none errors, and no page is left in use."""
    from concurrent.futures import ThreadPoolExecutor
    llm, client, _ = server
    prompts = [f"client {i} says" for i in range(64)]
    alone = LLM(llama_dir, page_size=8, num_pages=256)
    want = [out.text for out in alone.generate(prompts, SamplingParams(max_tokens=8, temperature=0))]

    def stream(prompt):
        chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in chunks)
    with ThreadPoolExecutor(max_workers=64) as pool:
        got = list(pool.map(stream, prompts))
    assert got == want
    deadline = time.time() + 20
    while llm.cache.allocator.pages_in_use and time.time() < deadline:
        time.sleep(0.05)
    assert llm.cache.allocator.pages_in_use == 0 and llm.cache.allocator.check_no_leaks()


def test_chat_template_prompt_gets_one_bos(llama_dir, tmp_path):
    """A template that writes the BOS itself, over a tokenizer that adds one too: the prompt starts with one."""
    import json
    import shutil

    from tokenizers import Tokenizer, processors

    from warpforge.serve.server import _chat_prompt_ids
    from warpforge.serve.tokenizer import load_tokenizer
    tok = Tokenizer.from_file(str(llama_dir / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"}))
    shutil.copy(llama_dir / "config.json", tmp_path / "config.json")
    tok = load_tokenizer(tmp_path)
    prompt, ids = _chat_prompt_ids(tok, [{"role": "user", "content": "hello"}])
    assert prompt == "<s>hello" and ids[0] == 0 and ids[1] != 0
    assert tok.encode("hello")[:2] == [0, ids[1]]  # a plain prompt still gets its BOS from the tokenizer


def test_max_tokens_zero_is_a_400_not_sixteen(server):
    _, client, _ = server
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="hello", max_tokens=0)
    assert "max_tokens" in str(info.value)


def test_abort_does_not_wait_for_the_engine_lock(llama_dir):
    from warpforge.serve.server import EngineLoop
    loop = EngineLoop(LLM(llama_dir, page_size=8, num_pages=16).engine)
    try:
        rid = loop.add(None, SamplingParams(max_tokens=200, ignore_eos=True), None, prompt_token_ids=[5, 6, 7])
        with loop.lock:  # as during a long step: the event loop's abort must not block on it
            t0 = time.perf_counter()
            loop.abort(rid)
            assert time.perf_counter() - t0 < 0.05
        deadline = time.time() + 10
        while loop.engine.has_unfinished() and time.time() < deadline:
            time.sleep(0.01)
        assert not loop.engine.has_unfinished() and loop.engine.metrics.aborted == 1
    finally:
        loop.stop()


def test_non_streaming_client_that_disconnects_is_aborted(server):
    """Outputs come every step (faster than the idle check): the disconnect is still noticed, the request stopped."""
    import json
    llm, _, port = server
    aborted = llm.metrics.aborted
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 240, "temperature": 0,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.time() + 10
        while not llm.engine.has_unfinished() and time.time() < deadline:
            time.sleep(0.005)
    deadline = time.time() + 20
    while (llm.engine.has_unfinished() or llm.cache.allocator.pages_in_use) and time.time() < deadline:
        time.sleep(0.02)
    assert llm.metrics.aborted == aborted + 1 and llm.cache.allocator.pages_in_use == 0


def test_stream_after_an_engine_failure_ends_with_an_error_payload(server):
    import json
    import urllib.request
    llm, _, port = server
    real = llm.engine.step

    def broken():
        raise RuntimeError("boom")
    llm.engine.step = broken
    try:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", headers={
            "Content-Type": "application/json"}, data=json.dumps(
                {"model": "tiny", "prompt": "hello", "max_tokens": 4, "stream": True}).encode())
        events = [ln[6:] for ln in urllib.request.urlopen(req, timeout=30).read().decode().splitlines()
                  if ln.startswith("data: ")]
    finally:
        llm.engine.step = real
    payload = json.loads(events[-1])
    assert "boom" in payload["error"]["message"] and payload["error"]["type"] == "server_error"
    assert not any('"abort"' in e for e in events)


def test_chat_template_renders_sandboxed(llama_dir, tmp_path):
    import json
    import shutil

    from warpforge import WarpforgeInputError
    from warpforge.serve.server import _chat_prompt
    from warpforge.serve.tokenizer import load_tokenizer
    shutil.copy(llama_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    # an immutable sandbox: no mutating the caller's messages, no reaching Python internals
    for template in ("{{ messages.append({'role': 'x', 'content': 'y'}) }}", "{{ ''.__class__.__mro__ }}"):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
        msgs = [{"role": "user", "content": "hi"}]
        try:
            out = _chat_prompt(load_tokenizer(tmp_path), msgs)
        except WarpforgeInputError:
            out = ""
        assert len(msgs) == 1 and "object" not in out
