"""The OpenAI-compatible HTTP server (`toolkit serve`): a front end over the engine core.

`engine_loop` runs the engine in its own thread (on every rank of a parallel job, rank 0 feeding the
others), `protocol` turns request bodies into prompts and SamplingParams, `responses` builds the
answers and stream chunks, `metrics` the Prometheus exposition, `app` the routes.
"""
