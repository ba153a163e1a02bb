"""A live server on loopback: uvicorn on a thread, for tests that need real sockets (concurrency,
disconnects, TLS)."""

import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn

from tests.processes import free_port


@contextlib.contextmanager
def live_server(app, **uvicorn_options) -> Iterator[str]:
    """Serve `app` until the block ends; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **uvicorn_options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextlib.contextmanager
def live_app(llm, model_name: str, max_model_len: int, config=None) -> Iterator[str]:
    """The OpenAI-compatible app over `llm`'s engine, started, on a live server: its base URL."""
    from kiln.runtime.async_engine import AsyncEngine
    from kiln.server.app import create_app

    engine = AsyncEngine(llm.engine, model_name=model_name)
    engine.start()
    try:
        with live_server(create_app(engine, llm.tokenizer, model_name, max_model_len, config=config)) as url:
            yield url
    finally:
        engine.shutdown()
