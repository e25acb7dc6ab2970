"""Between the faces (LLM, the HTTP server) and the engine: prompts and tokenizer, the engine
handles (in-thread and in its own process), and the output processor that turns token deltas into
text."""
