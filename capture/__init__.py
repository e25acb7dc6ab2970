"""Ahead-of-time graph capture and the graph cache (imported as graphrt.capture)."""
