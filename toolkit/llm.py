"""`LLM`: vLLM's offline API over the engine, so switching is a change of import."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from toolkit import vllm_args
from toolkit.parallel import is_main_process, request_cost
from toolkit.config import EngineConfig
from toolkit.engine import Engine
from toolkit.outputs import RequestOutput
from toolkit.sampling_params import SamplingParams
from toolkit.tokenizer import chat_messages, render_chat

log = logging.getLogger("toolkit")

PromptType = str | dict


class LLM:
    def __init__(self, model: str, **engine_kwargs):
        self.engine = Engine(EngineConfig(model=model, **vllm_args.engine_kwargs(engine_kwargs)))
        self._counter = 0
        # Read once, at start, so a bad generation_config.json fails here and not at the first generate.
        self._default_sampling = generation_defaults(self.engine.config)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: what generate uses without sampling_params. generation_config.json's temperature, top_p,
        top_k, min_p, repetition_penalty and max_new_tokens (as max_tokens) where it sets them, else
        SamplingParams' own defaults; EngineConfig.generation_config="vllm" ignores the file."""
        return SamplingParams(**self._default_sampling)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_metrics(self) -> list:
        """vLLM's metric objects (`.name`, `.value` or `.values`), named toolkit:*: request gauges, the
        prefix cache's toolkit:prefix_cache_queries and _hits (tokens; _hits_tier per tier, labelled),
        the KV tiers' toolkit:kv_transfer_bytes (labelled by direction) and, with speculative decoding, toolkit:spec_decode_num_drafts, _num_draft_tokens,
        _num_accepted_tokens and _num_accepted_tokens_per_pos (counted since the engine started), and for
        mixture-of-experts models toolkit:moe_expert_tokens (labelled by layer and expert: the tokens routed
        to each expert since start)."""
        return self.engine.get_metrics()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block (device and CPU tier; a disk tier is kept); False while requests run."""
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        Under tensor/data/pipeline parallelism every rank calls this with the same prompts; global rank 0
        returns all the outputs and every other rank returns [].

        Every prompt is tokenized and validated before any work starts, so a bad prompt raises a
        ValueError naming its index and nothing is lost half-way.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        for i, p in enumerate(params):
            try:
                p.check_vocab(self.engine.model_config.vocab_size)
            except ValueError as e:
                raise ValueError(f"sampling_params {i}: {e}") from None
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts; pass one per prompt")
        if priority is not None and any(priority) and self.engine.config.scheduling_policy != "priority":
            raise ValueError("priority is set but scheduling_policy is "
                             f"{self.engine.config.scheduling_policy!r}; pass scheduling_policy='priority'")
        encoded = [self._encode(p, i) for i, p in enumerate(prompts)]
        # The front end says which requests this rank feeds (a data-parallel replica: its token-balanced
        # share), and brings every rank's outputs to global rank 0 (toolkit/front_end.py).
        front = self.engine.front
        max_len = self.engine.max_model_len
        costs = [request_cost(len(ids), sp.max_tokens, sp.n, max_len) for (_, ids), sp in zip(encoded, params)]
        mine = front.share(costs)
        first, self._counter = self._counter, self._counter + len(prompts)
        ids = []
        try:
            for i in mine:
                (text, token_ids), rid = encoded[i], str(first + i)
                salt = prompts[i].get("cache_salt") if isinstance(prompts[i], dict) else None
                self.engine.add_request(rid, token_ids, params[i], prompt=text,
                                        priority=priority[i] if priority else 0, cache_salt=salt)
                ids.append(rid)
            results = {out.request_id: out for out in
                       self._run(len(ids), use_tqdm and is_main_process() and front.progress)}
        except BaseException:
            # Ctrl-C (or a fault that ends the call): nothing of this call stays in the engine to
            # surface in the next generate().
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        self._log_pipeline_idle()
        parts = front.collect(self.engine, results)
        if parts is None:
            return []
        gathered = {rid: out for part in parts for rid, out in part.items()}
        return [gathered[str(first + i)] for i in range(len(prompts))]

    def _log_pipeline_idle(self) -> None:
        """Pipeline parallelism: how much of its time each stage has spent waiting (since the engine started)."""
        stages = self.engine.pipeline_stats()  # a collective over the replica: every rank calls generate
        if stages:
            log.info("pipeline idle per stage (all steps / decode-only steps): %s", ", ".join(
                f"{100 * st['idle_fraction']:.0f}%/{100 * st['decode_idle_fraction']:.0f}%" for st in stages))

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, through the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        checked = []
        for i, conv in enumerate(conversations):
            try:
                checked.append(chat_messages(conv))
            except ValueError as e:
                raise ValueError(f"conversation {i}: {e}") from None
        prompts = [
            {"prompt_token_ids": render_chat(self.engine.tokenizer, conv, add_generation_prompt, **(chat_template_kwargs or {}))}
            for conv in checked
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _encode(self, prompt: PromptType, index: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str) and not prompt:
            raise ValueError(f"prompt {index} is empty")
        if isinstance(prompt, str):
            text, token_ids = prompt, self.engine.tokenize(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), _token_id_list(prompt["prompt_token_ids"], index)
        elif isinstance(prompt, dict) and "prompt" in prompt:
            text, token_ids = prompt["prompt"], self.engine.tokenize(prompt["prompt"])
        else:
            raise ValueError(f"prompt {index} must be a string or a dict with 'prompt' or 'prompt_token_ids'")
        self.engine.validate_prompt(token_ids, f"prompt {index}")
        if isinstance(prompt, dict) and not isinstance(prompt.get("cache_salt", ""), str):
            raise ValueError(f"prompt {index}: cache_salt must be a string")
        return text, token_ids

    def _params_per_prompt(self, params, n: int) -> list[SamplingParams]:
        if params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(params, SamplingParams):
            params = [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling_params for {n} prompts; pass one, or one per prompt")
        for i, p in enumerate(params):  # before any request is added: a bad one loses nothing
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params {i} must be a SamplingParams, got {type(p).__name__}")
            try:
                p.validate()
            except ValueError as e:
                raise ValueError(f"sampling_params {i}: {e}") from None
        return params

    def _run(self, total: int, use_tqdm: bool) -> Iterable[RequestOutput]:
        columns = (
            TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(), TimeRemainingColumn(),
        )
        with Progress(*columns, disable=not use_tqdm, transient=True) as progress:
            task = progress.add_task("generate", total=total, rate="")
            tokens = 0
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    tokens += sum(len(c.token_ids) for c in out.outputs)
                    elapsed = progress.tasks[0].elapsed or 1e-9
                    progress.update(task, advance=1, rate=f"{tokens / elapsed:.0f} tok/s")
                    yield out


# generation_config.json's keys that vLLM turns into default sampling parameters, and their names here.
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(config: EngineConfig) -> dict:
    """SamplingParams keywords from generation_config.json (EngineConfig.generation_config), checked."""
    import json
    from pathlib import Path

    if config.generation_config == "vllm":
        return {}
    folder = Path(config.model if config.generation_config == "auto" else config.generation_config)
    path = folder / "generation_config.json"
    if not path.is_file():
        if config.generation_config != "auto":
            raise FileNotFoundError(f"generation_config={config.generation_config!r}: no {path}")
        return {}
    try:
        raw = json.loads(path.read_text())
        found = {ours: raw[theirs] for theirs, ours in GENERATION_DEFAULTS.items() if raw.get(theirs) is not None}
        SamplingParams(**found)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if found:
        log.info("default sampling parameters from %s: %s", path, found)
    return found


def _token_id_list(ids, index: int) -> list[int]:
    """prompt_token_ids as a list of Python ints, or a ValueError naming the prompt and the type."""
    import numbers

    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"prompt {index}: prompt_token_ids must be a list of ints, got {type(ids).__name__}")
    ids = list(ids)
    bad = next((t for t in ids if not isinstance(t, numbers.Integral) or isinstance(t, bool)), None)
    if bad is not None:
        raise ValueError(f"prompt {index}: prompt_token_ids must hold ints, got {type(bad).__name__} {bad!r}")
    return [int(t) for t in ids]
