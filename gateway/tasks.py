"""Background-task lifecycle shared by the gateway and the simulator."""

from __future__ import annotations

import asyncio


async def cancel_and_wait(*tasks: asyncio.Task[object] | None, recancel_s: float = 1.0) -> None:
    """Cancel ``tasks`` (``None`` entries are skipped) and wait until each has really stopped.

    Awaiting after ``cancel()`` matters: a loop task that is merely cancelled may still be
    running its ``finally`` blocks when the caller closes the resources it uses.  A task still
    running ``recancel_s`` later is cancelled again: a cancellation that lands while a library
    call inside it times out can be swallowed (turned into that call's timeout), and one lost
    cancel must not hang a shutdown.  A task's own error (not its cancellation) is re-raised.
    """
    live = [task for task in tasks if task is not None]
    for task in live:
        task.cancel()
    pending = set(live)
    while pending:
        _, pending = await asyncio.wait(pending, timeout=recancel_s)
        for task in pending:
            task.cancel()
    for task in live:
        if not task.cancelled():
            task.result()
