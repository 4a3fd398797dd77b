"""``kvoffload router``: run the KV-aware router (an OpenAI-compatible proxy) until SIGTERM.

A command module like the others (:mod:`kvoffload.cli`); aiohttp and the
tokenizer are imported only when the command runs, so ``kvoffload --help`` stays fast.
Its config is the global ``--config`` file (or ``KVOFFLOAD_ROUTER_CONFIG``):
see :mod:`kvoffload.router.config`. Errors are one line and exit 1 (a bad
config, a tokenizer that cannot load), 2 for usage.
"""

from __future__ import annotations

import logging
from typing import Annotated

import typer
from rich.text import Text

from ..errors import ConfigError
from .app import app, err, state

__all__ = ["router"]

_PIP = {"aiohttp": "kvoffload[router]", "transformers": "kvoffload[router]", "zmq": "pyzmq"}


def _need(module: str, what: str) -> None:
    """One line, not a traceback, when an optional dependency is missing."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"{what} needs the Python package {module!r}: pip install '{_PIP[module]}'"
        )


@app.command("router")
def router(
    host: Annotated[
        str | None, typer.Option("--host", metavar="HOST", help="Listen address.")
    ] = None,
    port: Annotated[int | None, typer.Option("--port", metavar="PORT", help="Listen port.")] = None,
    check: Annotated[
        bool, typer.Option("--check", help="Validate the config (and tokenizer), then exit.")
    ] = False,
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
    elif not check:
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
    service = RouterService(cfg, tokenizer)
    logging.getLogger("kvoffload.router").info(
        "kvoffload router on http://%s:%d in front of %d workers",
        cfg.host,
        cfg.port,
        len(cfg.workers),
    )
    try:
        web.run_app(
            service.app(),
            host=cfg.host,
            port=cfg.port,
            print=None,
            access_log=None,
            handle_signals=True,
        )
    except OSError as exc:
        raise ConfigError(f"cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}") from exc
