"""create_app(registry) -> FastAPI: the HTTP face of a PipelineRegistry.

The app owns no pipelines itself: the registry (app.state.registry) does. Startup begins
loading the registry's pipelines in the background; shutdown closes them. The routes of the
modules listed in serving/routes/__init__.py ROUTER_MODULES join the app's own route list in
order (not as included routers: FastAPI matches an included router by trying its routes, then
again inside it, so a request for the last module's path paid for every module before it);
their lifespans run inside the app's. Errors of every kind leave as OpenAI-style JSON
(serving/errors.py).
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Iterable
from contextlib import AsyncExitStack, asynccontextmanager

from fastapi import APIRouter, FastAPI

import omnistage
from omnistage.serving.apidocs import install_api_docs
from omnistage.serving.auth import ApiKeyGuard, ApiKeyPolicy
from omnistage.serving.blocking_pool import install_blocking_pool
from omnistage.serving.errors import install_error_handlers
from omnistage.serving.guards import DEFAULT_MAX_BODY_BYTES, HostPolicy, RequestGuard
from omnistage.serving.metrics import ServingMetrics
from omnistage.serving.middleware import ServingMiddleware
from omnistage.serving.registry import PipelineRegistry
from omnistage.serving.routes import ROUTER_MODULES
from omnistage.serving.routes.spoken_replies import SpokenReplies


def create_app(
    registry: PipelineRegistry,
    *,
    drain_timeout: float = 30.0,
    routers: Iterable[APIRouter] = (),
    load_on_startup: bool = True,
    max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES,
    host_policy: HostPolicy | None = None,
    api_keys: ApiKeyPolicy | None = None,
) -> FastAPI:
    """Build the app. `routers`: extra routers to include after the ROUTER_MODULES ones.
    `max_body_bytes`: larger request bodies get 413 (None: no limit). `host_policy`: the Host
    values answered (None: any; `omnistage serve` on a loopback address passes one).
    `api_keys`: bearer keys every route but the probes requires (serving/auth.py; None: open)."""

    modules = [importlib.import_module(name) for name in ROUTER_MODULES]

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await install_blocking_pool()
        if load_on_startup:
            registry.start_loading()
        async with AsyncExitStack() as stack:
            for module in modules:
                if hasattr(module, "lifespan"):
                    await stack.enter_async_context(module.lifespan(app))
            yield
        await asyncio.to_thread(registry.close, app.state.drain_timeout)

    app = FastAPI(
        title="omnistage",
        version=omnistage.__version__,
        lifespan=lifespan,
        docs_url=None,  # serving/apidocs.py serves them from local assets
        redoc_url=None,
    )
    app.state.registry = registry
    app.state.max_body_bytes = max_body_bytes
    app.state.metrics = ServingMetrics(registry)
    app.state.drain_timeout = drain_timeout
    app.state.spoken_replies = SpokenReplies()
    install_error_handlers(app)
    install_api_docs(app)
    for module in modules:
        app.router.routes.extend(_module_routes(module))
    for router in routers:
        app.include_router(router)
    if api_keys is not None:
        app.add_middleware(ApiKeyGuard, policy=api_keys)
    app.add_middleware(RequestGuard, host_policy=host_policy, max_body_bytes=max_body_bytes)
    app.add_middleware(ServingMiddleware, registry=registry, metrics=app.state.metrics)
    return app


def _module_routes(module) -> list:
    """A route module's routes. Its router's own lifespan or event handlers would not run once
    its routes join the app's list: the module exposes `lifespan` instead."""
    router = module.router
    if router.on_startup or router.on_shutdown or type(router.lifespan_context).__name__ != "_DefaultLifespan":
        raise TypeError(f"{module.__name__}: give the module a `lifespan`, not its router (serving/routes/__init__.py)")
    return router.routes
