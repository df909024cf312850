"""The OpenAI-compatible HTTP server, `dflash-local serve`, in llama-server's shapes: app.py (the routes and the
model's loading), schema.py (requests parsed and checked, responses), errors.py, stream.py (server-sent events),
props.py (/props, /v1/models), tokens.py (/tokenize, /detokenize), logprobs.py, runner.py (the queue in front of the
engine) and metrics.py (/metrics). A frontend: it imports engine/, chat/ and the base modules, no other frontend.
tests/test_layout.py checks it.
"""
