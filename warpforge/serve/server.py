"""An OpenAI-compatible HTTP server over an LLM: POST /v1/completions, POST /v1/chat/completions (both with
`stream: true` as server-sent events), GET /v1/models, GET /health. FastAPI + uvicorn, the `[serve]` extra.

One engine thread steps the engine while any request is unfinished; HTTP handlers add requests under a lock and
read their outputs from an asyncio queue that the engine thread fills (call_soon_threadsafe). A client that
disconnects, streaming or not, has its request aborted, which frees its pages. Bad requests get a 4xx with an
OpenAI-style JSON error body ({"error": {"message", "type", "param", "code"}}).
"""
# (no `from __future__ import annotations`: FastAPI reads the handlers' annotations, which name classes local to
# create_app, and a string annotation would not resolve)
import asyncio
import json
import queue
import threading
import time
from typing import Optional

from ..errors import WarpforgeInputError
from .sampling import SamplingParams


class EngineLoop:
    """Runs engine.step() on a thread of its own while requests are unfinished. add is thread-safe (it takes the
    engine lock: call it from a worker thread, not the event loop); abort never blocks: it queues the id for the
    engine thread, which drains the queue before each step."""

    def __init__(self, engine):
        self.engine = engine
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stopped = False
        self.error: Optional[BaseException] = None  # the last step's failure, None once a step succeeds
        self.errors: dict = {}  # request id -> the failure that ended it (popped by whoever reports it)
        self._aborts: "queue.SimpleQueue" = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="warpforge-engine", daemon=True)
        self.thread.start()

    def add(self, prompt, params, on_output, prompt_token_ids=None) -> str:
        with self.lock:
            rid = self.engine.add_request(prompt, params, prompt_token_ids=prompt_token_ids, on_output=on_output)
        self.wake.set()
        return rid

    def abort(self, rid: str) -> None:
        self._aborts.put(rid)
        self.wake.set()

    def _drain_aborts(self) -> None:
        while True:
            try:
                rid = self._aborts.get_nowait()
            except queue.Empty:
                return
            self.engine.abort(rid)

    def _run(self) -> None:
        while not self.stopped:
            with self.lock:
                self._drain_aborts()
                busy = self.engine.has_unfinished()
                if busy:
                    try:
                        self.engine.step()
                        self.error = None
                    except BaseException as exc:  # noqa: BLE001 (a failed step fails its requests, not the server)
                        self.error = exc
                        for rid in [r.id for r in list(self.engine.running) + list(self.engine.waiting)]:
                            self.errors[rid] = exc
                            self.engine.abort(rid)
            if not busy:
                self.wake.wait(0.05)
                self.wake.clear()

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()
        self.thread.join(timeout=5)


def _error(status: int, message: str, param: Optional[str] = None, kind: str = "invalid_request_error"):
    from fastapi.responses import JSONResponse
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": param,
                                                               "code": None}})


def _chat_prompt(tokenizer, messages) -> str:
    """The prompt text of chat messages: the tokenizer's chat template (jinja2) when it has one, else a plain
    "role: content" transcript ending with "assistant:"."""
    template = getattr(tokenizer, "chat_template", None)
    if template:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        # a template comes with the checkpoint: render it sandboxed, as transformers does
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message):  # transformers' templates call it on messages they cannot format
            raise WarpforgeInputError(f"messages: {message}")
        env.globals["raise_exception"] = raise_exception
        cfg = getattr(tokenizer, "config", {})

        def token(name):
            t = cfg.get(name)
            return t.get("content") if isinstance(t, dict) else (t or "")
        try:
            return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                                    bos_token=token("bos_token"), eos_token=token("eos_token"))
        except jinja2.TemplateError as exc:  # a security error of the sandbox among them
            raise WarpforgeInputError(f"messages: the chat template failed on them ({exc})") from None
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def _chat_prompt_ids(tokenizer, messages):
    """(prompt text, its token ids or None). A chat template writes its own special tokens (a BOS among them): its
    text is encoded without the tokenizer adding them again; the plain transcript leaves that to the engine."""
    prompt = _chat_prompt(tokenizer, messages)
    if getattr(tokenizer, "chat_template", None):
        return prompt, tokenizer.encode(prompt, add_special_tokens=False)
    return prompt, None


def create_app(llm, model_name: Optional[str] = None):
    """The FastAPI app serving llm (an LLM); its engine thread starts now and stops on app shutdown."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import StreamingResponse
    from pydantic import BaseModel, Field

    name = model_name or llm.path.name
    loop_box = {}

    @asynccontextmanager
    async def lifespan(app):
        loop_box["engine"] = EngineLoop(llm.engine)
        yield
        loop_box["engine"].stop()

    app = FastAPI(title="warpforge", lifespan=lifespan)

    class _Sampling(BaseModel):
        model: Optional[str] = None
        max_tokens: Optional[int] = Field(default=None)
        temperature: float = 1.0
        top_p: float = 1.0
        top_k: Optional[int] = None
        n: int = 1
        stream: bool = False
        stop: Optional[object] = None
        seed: Optional[int] = None
        ignore_eos: bool = False

    class CompletionRequest(_Sampling):
        prompt: object

    class ChatRequest(_Sampling):
        messages: list
        max_completion_tokens: Optional[int] = None

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request, exc):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error(400, f"invalid request: {first.get('msg', exc)}", param)

    @app.exception_handler(WarpforgeInputError)
    async def _bad_input(request, exc):
        return _error(400, str(exc), str(exc).split(":")[0])

    def params_of(body, default_max=16) -> SamplingParams:
        if body.n != 1:
            raise WarpforgeInputError(f"n: expected 1 (one choice per request), got {body.n}")
        if body.model not in (None, name):
            raise WarpforgeInputError(f"model: expected {name!r} (the model this server holds), got {body.model!r}")
        max_tokens = getattr(body, "max_completion_tokens", None)
        if max_tokens is None:
            max_tokens = body.max_tokens
        if max_tokens is None:  # only when absent: 0 is SamplingParams' to refuse (a 400)
            max_tokens = default_max
        stop = body.stop if body.stop is not None else []
        return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                              top_k=body.top_k, seed=body.seed, stop=stop, ignore_eos=body.ignore_eos)

    async def run(request: Request, prompt, params, prompt_ids, stream, chunk, final):
        """A request's outputs: streamed as SSE chunks (chunk(output) -> dict) or one JSON body (final)."""
        engine = loop_box["engine"]
        queue_: asyncio.Queue = asyncio.Queue()
        aloop = asyncio.get_running_loop()
        # the engine lock is held for a whole step: take it on a worker thread, never on the event loop
        added = aloop.run_in_executor(None, lambda: engine.add(
            prompt, params, lambda out: aloop.call_soon_threadsafe(queue_.put_nowait, out),
            prompt_token_ids=prompt_ids))
        try:
            rid = await asyncio.shield(added)
        except asyncio.CancelledError:  # the handler went away while the request was being added: stop it
            added.add_done_callback(lambda f: None if f.cancelled() or f.exception() else engine.abort(f.result()))
            raise
        created = int(time.time())

        async def outputs():
            while True:
                try:
                    out = await asyncio.wait_for(queue_.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                yield out
                if out.finished:
                    return
                if await request.is_disconnected():  # however often outputs come
                    return

        def failure(out):
            exc = engine.errors.pop(rid, None) if out.finish_reason == "abort" else None
            return None if exc is None else f"the engine failed: {exc!r}"

        if stream:
            async def sse():
                done = False
                try:
                    async for out in outputs():
                        done = out.finished
                        failed = failure(out) if done else None
                        if failed is not None:  # OpenAI's way: an error payload, not a made-up finish_reason
                            error = {"message": failed, "type": "server_error", "param": None, "code": None}
                            yield f"data: {json.dumps({'error': error})}\n\n"
                            return
                        yield f"data: {json.dumps(chunk(rid, created, out))}\n\n"
                    if done:
                        yield "data: [DONE]\n\n"
                finally:
                    if not done:  # the client went away (or the server stops): free the request's pages
                        engine.abort(rid)
            return StreamingResponse(sse(), media_type="text/event-stream")
        last = None
        try:
            async for out in outputs():
                last = out
        finally:
            if last is None or not last.finished:
                engine.abort(rid)
        if last is None or not last.finished:
            return _error(499, "client closed the request")
        if last.finish_reason == "abort":
            return _error(500, failure(last) or "the request was aborted", kind="server_error")
        return final(rid, created, last)

    def usage(out):
        return {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.token_ids),
                "total_tokens": len(out.prompt_token_ids) + len(out.token_ids)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        params = params_of(body)
        prompt, ids = body.prompt, None
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            prompt, ids = None, prompt
        elif not isinstance(prompt, str):
            raise WarpforgeInputError("prompt: expected a string or a list of token ids (one prompt per request)")

        def chunk(rid, created, out):
            return {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": name,
                    "choices": [{"index": 0, "text": out.new_text, "logprobs": None,
                                 "finish_reason": out.finish_reason if out.finished else None}]}

        def final(rid, created, out):
            return {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": name,
                    "choices": [{"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}],
                    "usage": usage(out)}
        return await run(request, prompt, params, ids, body.stream, chunk, final)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        params = params_of(body)
        msgs = body.messages
        if not msgs or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and
                               isinstance(m.get("content"), str) for m in msgs):
            raise WarpforgeInputError("messages: expected a non-empty list of {role, content} objects with string "
                                      "content")
        prompt, ids = _chat_prompt_ids(llm.tokenizer, msgs)
        first = {}

        def chunk(rid, created, out):
            delta = {"content": out.new_text}
            if rid not in first:
                first[rid] = True
                delta["role"] = "assistant"
            return {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": created, "model": name,
                    "choices": [{"index": 0, "delta": delta,
                                 "finish_reason": out.finish_reason if out.finished else None}]}

        def final(rid, created, out):
            return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": created, "model": name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                                 "finish_reason": out.finish_reason}], "usage": usage(out)}
        return await run(request, prompt, params, ids, body.stream, chunk, final)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "warpforge"}]}

    @app.get("/health")
    async def health():
        m = llm.metrics
        return {"status": "ok", **m.summary()}

    return app


def serve(path, host: str = "127.0.0.1", port: int = 8000, **llm_kw) -> None:
    """Loads the checkpoint at path and serves it until interrupted."""
    import uvicorn

    from .llm import LLM
    app = create_app(LLM(path, **llm_kw))
    uvicorn.run(app, host=host, port=port, log_level="info")


def check_installed() -> Optional[str]:
    """None if the server's dependencies import, else the install hint."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        return "the server needs the [serve] extra: pip install -e '.[serve]'"
    return None
