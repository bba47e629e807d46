"""loopserve: a single-loop, dynamically batching ONNX Runtime model server."""

from pipeline.app import create_app, lifespan_of
from pipeline.settings import ModelSettings, ServerSettings, load_settings

__all__ = ["ModelSettings", "ServerSettings", "create_app", "lifespan_of", "load_settings"]
