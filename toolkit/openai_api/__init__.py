"""OpenAI's completion and chat bodies, both ways, for every client of the front end.

`request` reads a request body into its prompts and SamplingParams fields; `response` builds the
answer's choices, logprobs and usage from engine outputs. The HTTP server (`toolkit/server/`) and the
OpenAI Batch file format of `toolkit generate` (`cli/openai_batch.py`) both use them, and keep only
what is their own: the server its streaming and HTTP errors, the batch file its line envelope.
"""
