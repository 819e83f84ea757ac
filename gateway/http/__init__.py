"""Serving: the ASGI app, the uvicorn server and its HTTP limits, middleware, graceful drain, ``--workers``."""
