"""`graphrt serve`: an OpenAI-compatible HTTP server over one engine.

protocol (request bodies) -> app (routes) -> generation (one request) -> async_engine (the one
thread that steps the engine); responses shapes the JSON, metrics feeds /metrics, runner starts
and stops it all.
"""

from graphrt.server.app import ServerSettings, build_app
from graphrt.server.runner import ServeOptions, ServerThread, serve

__all__ = ["ServeOptions", "ServerSettings", "ServerThread", "build_app", "serve"]
