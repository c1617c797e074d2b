"""kvtool: a GGUF inference engine with llama.cpp's memory model. This module is the public
API (what llama.h is to llama.cpp's tools): the commands import nothing else."""

from kvtool.batch import Batch, DecodeError, UBatch
from kvtool.batched_bench import BatchedResult, batched_n_kv, batched_run, batched_skip_reason, batched_warmup
from kvtool.bench import (
    BenchResult,
    BenchTest,
    bench_tests,
    cpu_info,
    model_desc,
    parse_int_list,
    run_bench_test,
    threads_in_use,
)
from kvtool.chat import ChatSession
from kvtool.context import Context, ContextParams
from kvtool.errors import (
    KvtoolError,
    ModelFetchError,
    ModelLoadError,
    StateError,
    TemplateError,
    TokenizerError,
)
from kvtool.generate import ContextFullError, Generation, TextStream, Timings, decode_tokens, generate
from kvtool.kv_dims import KVDims, read_kv_dims
from kvtool.memory.base import MemoryStatus
from kvtool.model import Model, load_model
from kvtool.parallel import Client, ParallelParams, ParallelSim, ParallelSummary, RequestRecord
from kvtool.parallel_http import HttpParallelSim
from kvtool.parallel_prompts import QUESTIONS, read_prompts
from kvtool.registry import DEFAULT_MODEL, KNOWN_MODELS, fetch_model, is_present, model_path, resolve_model
from kvtool.sampling import Sampler, SamplerParams
from kvtool.state import ConversationStore, SeqInfo, StateInfo, inspect_state
from kvtool.state.conversations import ConversationPool

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "QUESTIONS",
    "Batch",
    "BatchedResult",
    "BenchResult",
    "BenchTest",
    "ChatSession",
    "Client",
    "Context",
    "ContextFullError",
    "ContextParams",
    "ConversationPool",
    "ConversationStore",
    "DecodeError",
    "Generation",
    "HttpParallelSim",
    "KVDims",
    "KvtoolError",
    "MemoryStatus",
    "Model",
    "ModelFetchError",
    "ModelLoadError",
    "ParallelParams",
    "ParallelSim",
    "ParallelSummary",
    "RequestRecord",
    "Sampler",
    "SamplerParams",
    "SeqInfo",
    "StateError",
    "StateInfo",
    "TemplateError",
    "TextStream",
    "Timings",
    "TokenizerError",
    "UBatch",
    "batched_n_kv",
    "batched_run",
    "batched_skip_reason",
    "batched_warmup",
    "bench_tests",
    "cpu_info",
    "decode_tokens",
    "fetch_model",
    "generate",
    "inspect_state",
    "is_present",
    "load_model",
    "model_desc",
    "model_path",
    "parse_int_list",
    "read_kv_dims",
    "read_prompts",
    "resolve_model",
    "run_bench_test",
    "threads_in_use",
]
