"""OpenAI-compatible HTTP API over any generation backend (docs/design.md §1, §2).

`backend` is the small async protocol the HTTP layer talks to (the Ray router implements it for
disaggregated serving, `LocalBackend` for one monolithic engine); `tokenizer` turns text and chat
messages into token ids and streams text back; `metrics` is the Prometheus registry of one app;
`server` is the FastAPI app.
"""
