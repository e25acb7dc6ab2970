"""`graphrt serve`: an OpenAI-compatible HTTP server over one engine.

protocol (request bodies) -> app (routes) -> generation (one request) -> an engine handle from
graphrt.frontend: engine_client (the engine in a process of its own, graphrt.engine.process, by
default) or async_engine (the engine on a thread here), both driving a graphrt.engine.core
EngineCore; responses shapes the JSON, metrics feeds /metrics, runner starts and stops it all.
"""

from graphrt.server.app import ServerSettings, build_app
from graphrt.server.runner import ServeOptions, ServerThread, serve

__all__ = ["ServeOptions", "ServerSettings", "ServerThread", "build_app", "serve"]
