"""Clients that hang up: a whole (non-streamed) answer is cancelled when its client leaves before it is done,
as a stream is when its reader goes away."""

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request as HTTPRequest

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed the connection before its answer was ready (logged with nginx's status 499)."""


async def until_disconnected(request: HTTPRequest, work: Awaitable[T]) -> T:
    """The result of `work`; if the client hangs up first, `work` is cancelled (its generations leave the engine
    at the next step) and ClientGone is raised. The body has been read, so the next message the connection
    receives is its disconnection."""
    task = asyncio.ensure_future(work)

    async def hung_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(hung_up())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watcher):
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pending
    if task.cancelled():
        raise ClientGone("the client closed the connection before the answer was ready")
    return task.result()
