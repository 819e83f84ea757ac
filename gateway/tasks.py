"""Background-task lifecycle shared by the gateway and the simulator."""

from __future__ import annotations

import asyncio
import contextlib


async def cancel_and_wait(*tasks: asyncio.Task[object] | None) -> None:
    """Cancel ``tasks`` (``None`` entries are skipped) and wait until each has really stopped.

    Awaiting after ``cancel()`` matters: a loop task that is merely cancelled may still be
    running its ``finally`` blocks when the caller closes the resources it uses.
    """
    live = [task for task in tasks if task is not None]
    for task in live:
        task.cancel()
    for task in live:
        with contextlib.suppress(asyncio.CancelledError):
            await task
