"""``kvoffload router``: run the KV-aware router (an OpenAI-compatible proxy) until SIGTERM.

A command module like the others (:mod:`kvoffload.cli`); aiohttp and the
tokenizer are imported only when the command runs, so ``kvoffload --help`` stays fast.
Its config is the global ``--config`` file (or ``KVOFFLOAD_ROUTER_CONFIG``):
see :mod:`kvoffload.router.config`. Errors are one line and exit 1 (a bad
config, a tokenizer that cannot load), 2 for usage.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated

import typer
from rich.text import Text

from ..errors import ConfigError
from .app import app, err, state

__all__ = ["LOOPS", "event_loop", "router"]

_PIP = {"aiohttp": "kvoffload[router]", "transformers": "kvoffload[router]", "zmq": "pyzmq"}


def _need(module: str, what: str) -> None:
    """One line, not a traceback, when an optional dependency is missing."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"{what} needs the Python package {module!r}: pip install '{_PIP[module]}'"
        )


#: ``--loop``: ``auto`` (uvloop where installed, else asyncio's), or either one.
LOOPS = ("auto", "uvloop", "asyncio")


def event_loop(choice: str = "auto") -> asyncio.AbstractEventLoop:
    """A new event loop for the router: uvloop's where installed (``kvoffload[fast]``).

    uvloop (libuv, in C) spends less CPU per request on the sockets than
    asyncio's loop. ``auto`` falls back to asyncio's loop when uvloop is not
    installed or does not load; ``uvloop`` insists (a one-line error without
    it); ``asyncio`` never tries it.
    """
    if choice not in LOOPS:
        raise ConfigError(f"--loop: {choice!r} is not one of {', '.join(LOOPS)}")
    if choice != "asyncio":
        try:
            import importlib

            uvloop = importlib.import_module("uvloop")  # optional: kvoffload[fast]
            fast: asyncio.AbstractEventLoop = uvloop.new_event_loop()
            return fast
        except ImportError as exc:  # not installed, or built for another Python
            if choice == "uvloop":
                raise ConfigError(
                    f"--loop uvloop, but uvloop does not load ({exc}): "
                    "pip install 'kvoffload[fast]'"
                ) from exc
    return asyncio.new_event_loop()


@app.command("router")
def router(
    host: Annotated[
        str | None, typer.Option("--host", metavar="HOST", help="Listen address.")
    ] = None,
    port: Annotated[int | None, typer.Option("--port", metavar="PORT", help="Listen port.")] = None,
    check: Annotated[
        bool, typer.Option("--check", help="Validate the config (and tokenizer), then exit.")
    ] = False,
    loop_choice: Annotated[
        str,
        typer.Option(
            "--loop",
            metavar="auto|uvloop|asyncio",
            help="The event loop: uvloop where installed (kvoffload[fast]), else asyncio's.",
        ),
    ] = "auto",
) -> None:
    """Run the KV-aware router in front of vLLM workers (config: the global --config file)."""
    from dataclasses import replace

    from ..router.config import load_router_config

    cfg = load_router_config(state.config_path)
    if host is not None:
        cfg = replace(cfg, host=host)
    if port is not None:
        if not 0 <= port < 65536:
            raise ConfigError(f"--port: not a port: {port}")
        cfg = replace(cfg, port=port)
    tokenizer = None
    if cfg.tokenizer is not None:
        _need("transformers", "[model] tokenizer")
        from ..router.tokenize import Tokenizer

        try:
            tokenizer = Tokenizer.load(cfg.tokenizer)
        except ValueError as exc:
            raise ConfigError(f"[model] tokenizer: {exc}") from exc
    if any(w.events for w in cfg.workers) or any(s.events for s in cfg.stores):
        _need("zmq", "an events endpoint")
    if tokenizer is None and not check:
        err.print(
            Text.assemble(
                ("warning:", "yellow"),
                " no [model] tokenizer: text prompts are routed on "
                "load alone (token-id prompts still match the cache)",
            )
        )
    _need("aiohttp", "kvoffload router")
    if check:
        typer.echo(f"router config OK: {len(cfg.workers)} workers, {len(cfg.tenants)} tenants")
        return
    from aiohttp import web

    from ..router.proxy import RouterService

    logging.getLogger().setLevel(logging.INFO)
    if cfg.log_decisions:
        logging.getLogger("kvoffload.router.decisions").setLevel(logging.INFO)
    loop = event_loop(loop_choice)
    service = RouterService(cfg, tokenizer)
    if tokenizer is None:
        segments = "-"
    else:
        segments = "on" if tokenizer.cache is not None else f"off ({tokenizer.cache_refused})"
    logging.getLogger("kvoffload.router").info(
        "kvoffload router on http://%s:%d in front of %d workers (event loop: %s; "
        "tokenizer segment cache: %s)",
        cfg.host,
        cfg.port,
        len(cfg.workers),
        type(loop).__module__.split(".")[0],
        segments,
    )
    try:
        web.run_app(
            service.app(),
            host=cfg.host,
            port=cfg.port,
            print=None,
            access_log=None,
            handle_signals=True,
            loop=loop,
        )
    except OSError as exc:
        raise ConfigError(f"cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}") from exc
