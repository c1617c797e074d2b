"""llama.cpp's flags that kvtool has no counterpart for (those of llama-cli, llama-completion,
llama-bench and llama-server at the llama.cpp the project follows), each spelling -> what kvtool
offers instead. `commands/flags.py` refuses them with that offer (a verb's own table first:
llama-server's flags typed at `kvtool serve`); tests/data/llama_cpp_flags.txt is the list they
are checked against."""

from __future__ import annotations

_ONE_DEVICE = "kvtool computes on one device, chosen with --device cpu|cuda (or -ngl N); it does not split"
_NO_DRAFT = "kvtool has no speculative decoding"
_THREADS = "kvtool sets only how many threads compute: -t (and -tb for prompts)"
_SAMPLERS = (
    "kvtool's samplers are --temp, --top-k, --top-p, --min-p, --typical, the penalties "
    "(--repeat-penalty, --repeat-last-n, --presence-penalty, --frequency-penalty), ordered by --samplers"
)
_LOGS = "kvtool prints errors and notes as single lines on stderr; -v adds the model and context details"
_MODEL_FILE = (
    "-m takes a known name (`kvtool models`) or a local GGUF path; kvtool never downloads from a hub"
)
_WEIGHTS_HOST = (
    "kvtool maps the GGUF and holds the weights itself (--weights auto|f32|f16|bf16 chooses their form)"
)
_MEDIA = "kvtool runs text models only"
_ROPE = "kvtool takes RoPE and context scaling from the GGUF"

# fmt: off
_GROUPS: list[tuple[tuple[str, ...], str]] = [
    (
        ("-nkvo", "--no-kv-offload", "-kvo", "--kv-offload"),
        "the KV cache lives on the model's device (--device, -ngl)",
    ),
    (
        ("-sm", "--split-mode", "-ts", "--tensor-split", "-mg", "--main-gpu", "-ot", "--override-tensor",
         "-cmoe", "--cpu-moe", "-ncmoe", "--n-cpu-moe", "-ncffn", "--n-cpu-ffn", "-nopo", "--no-op-offload",
         "--op-offload", "--no-host", "-rpc", "--rpc", "-fit", "--fit", "-fitt", "--fit-target", "-fitc",
         "--fit-ctx", "-mmdev"),
        _ONE_DEVICE,
    ),
    (
        ("--mlock", "--no-mmap", "-mmp", "--mmap", "-dio", "--direct-io", "-lm", "--load-mode", "-lzm",
         "--lazy-mode", "--repack", "-nr", "--no-repack", "--check-tensors", "--numa"),
        _WEIGHTS_HOST,
    ),
    (
        ("-hf", "-hfr", "--hf-repo", "-hff", "--hf-file", "-hft", "--hf-token", "-mu", "--model-url", "-dr",
         "--docker-repo", "--offline", "-cl", "--cache-list", "--gpt-oss-20b-default",
         "--gpt-oss-120b-default", "--vision-gemma-4b-default", "--vision-gemma-12b-default"),
        _MODEL_FILE,
    ),
    (
        ("--host", "--port", "--server-base"),
        "the server is `kvtool serve` (--host, --port); `kvtool parallel --server URL` drives one",
    ),
    (
        ("-i", "--interactive", "-if", "--interactive-first"),
        "`kvtool run` without -p is the chat",
    ),
    (
        ("-st", "--single-turn"),
        "`kvtool run -p TEXT` answers one turn and exits",
    ),
    (
        ("--chat-template", "--chat-template-file", "--chat-template-kwargs"),
        "the GGUF's own template is used (--no-jinja: the named format of its family; --no-chat: none)",
    ),
    (
        ("-r", "--reverse-prompt"),
        "no reverse prompts: the reply stops at end of generation or -n tokens",
    ),
    (
        ("--in-prefix", "--in-prefix-bos", "--in-suffix", "-gan", "--grp-attn-n", "-gaw", "--grp-attn-w"),
        "kvtool renders turns with the chat template and has no self-extend; --no-chat sends raw text",
    ),
    (
        ("-md", "--model-draft", "-ngld", "--draft", "--draft-max", "--draft-n", "--draft-min",
         "--draft-n-min", "--draft-p-min", "--draft-p-split", "-devd", "--device-draft",
         "--gpu-layers-draft", "--n-gpu-layers-draft", "-hfd", "-hfrd", "--hf-repo-draft", "-td",
         "--threads-draft", "-tbd", "--threads-batch-draft", "-Cd", "--cpu-mask-draft", "-Crd",
         "--cpu-range-draft", "--cpu-strict-draft", "--prio-draft", "--poll-draft", "-Cbd",
         "--cpu-mask-batch-draft", "--cpu-strict-batch-draft", "--prio-batch-draft", "--poll-batch-draft",
         "-otd", "--override-tensor-draft", "-cmoed", "--cpu-moe-draft", "-ncmoed", "--n-cpu-moe-draft",
         "-ctkd", "--cache-type-k-draft", "-ctvd", "--cache-type-v-draft", "--spec-default", "--spec-type",
         "--spec-synth-len", "--spec-synth-rates", "--spec-draft-backend-sampling",
         "--no-spec-draft-backend-sampling", "--spec-draft-cpu-mask", "--spec-draft-cpu-mask-batch",
         "--spec-draft-cpu-moe", "--spec-draft-cpu-range", "--spec-draft-cpu-strict",
         "--spec-draft-cpu-strict-batch", "--spec-draft-device", "--spec-draft-hf", "--spec-draft-model",
         "--spec-draft-n-cpu-moe", "--spec-draft-n-max", "--spec-draft-n-min", "--spec-draft-ncmoe",
         "--spec-draft-ngl", "--spec-draft-override-tensor", "--spec-draft-p-min", "--spec-draft-p-split",
         "--spec-draft-poll", "--spec-draft-poll-batch", "--spec-draft-prio", "--spec-draft-prio-batch",
         "--spec-draft-threads", "--spec-draft-threads-batch", "--spec-draft-type-k", "--spec-draft-type-v",
         "--spec-ngram-map-k-min-hits", "--spec-ngram-map-k-size-m", "--spec-ngram-map-k-size-n",
         "--spec-ngram-map-k4v-min-hits", "--spec-ngram-map-k4v-size-m", "--spec-ngram-map-k4v-size-n",
         "--spec-ngram-mod-n-match", "--spec-ngram-mod-n-max", "--spec-ngram-mod-n-min",
         "--spec-ngram-simple-min-hits", "--spec-ngram-simple-size-m", "--spec-ngram-simple-size-n"),
        _NO_DRAFT,
    ),
    (
        ("-j", "--json-schema", "-jf", "--json-schema-file", "--grammar", "--grammar-file"),
        "kvtool has no constrained (grammar) sampling",
    ),
    (
        ("--dry-multiplier", "--dry-base", "--dry-allowed-length", "--dry-penalty-last-n",
         "--dry-sequence-breaker", "--xtc-probability", "--xtc-threshold", "--top-nsigma", "--top-n-sigma",
         "--mirostat", "--mirostat-lr", "--mirostat-ent", "--dynatemp-range", "--dynatemp-exp",
         "--adaptive-target", "--adaptive-decay", "-l", "--logit-bias", "--sampler-seq", "--sampling-seq",
         "-bs", "--backend-sampling"),
        _SAMPLERS,
    ),
    (
        ("-C", "--cpu-mask", "-Cr", "--cpu-range", "--cpu-strict", "--prio", "--poll", "-Cb",
         "--cpu-mask-batch", "-Crb", "--cpu-range-batch", "--cpu-strict-batch", "--prio-batch",
         "--poll-batch", "--delay"),
        _THREADS,
    ),
    (
        ("--log-disable", "--log-file", "--log-jsonl", "--no-log-jsonl", "--log-colors", "--log-verbose",
         "-lv", "--verbosity", "--log-verbosity", "--log-prefix", "--no-log-prefix", "--log-timestamps",
         "--no-log-timestamps", "--log-prompts-dir", "--progress"),
        _LOGS,
    ),
    (
        ("-co", "--color"),
        "kvtool colours its notes when stderr is a terminal",
    ),
    (
        ("--simple-io",),
        "kvtool reads plain lines from a pipe and uses readline only on a terminal",
    ),
    (
        ("--rope-scaling", "--rope-scale", "--rope-freq-base", "--rope-freq-scale", "--yarn-orig-ctx",
         "--yarn-ext-factor", "--yarn-attn-factor", "--yarn-beta-slow", "--yarn-beta-fast"),
        _ROPE,
    ),
    (
        ("--lora", "--lora-scaled", "--control-vector", "--control-vector-scaled",
         "--control-vector-layer-range", "--override-kv"),
        "kvtool loads the GGUF as it is: no adapters, control vectors or metadata overrides",
    ),
    (
        ("-mm", "--mmproj", "--mmproj-device", "-mmu", "--mmproj-url", "--mmproj-auto", "--no-mmproj",
         "--no-mmproj-auto",
         "--mmproj-offload", "--no-mmproj-offload", "--image", "--audio", "--video", "--image-min-tokens",
         "--image-max-tokens", "--video-fps", "--video-timestamp-interval", "--video-ffmpeg-dir", "-embd",
         "--embeddings"),
        _MEDIA,
    ),
    (
        ("-rea", "--reasoning", "--reasoning-format", "--reasoning-effort", "--reasoning-budget",
         "--reasoning-budget-message", "--reasoning-preserve", "--no-reasoning-preserve",
         "--skip-chat-parsing", "--no-skip-chat-parsing"),
        "kvtool streams the reply as the model writes it: no reasoning or tool-call parsing",
    ),
    (
        ("--prompt-cache", "--prompt-cache-all", "--prompt-cache-ro", "-cram", "--cache-ram"),
        "`kvtool run --session FILE` resumes and saves the chat's state, context checkpoints included "
        "(--store DB keeps named ones; kvtool serve has -cram and --cache-dir)",
    ),
    (
        ("--warmup", "--no-warmup"),
        "`kvtool run` does no warmup run (`kvtool bench` has --no-warmup)",
    ),
    (
        ("--show-timings", "--no-show-timings"),
        "--perf/--no-perf: the timings after each reply and at the end",
    ),
    (
        ("-ptc", "--print-token-count"),
        "each reply ends with a line of its tokens and speed (--no-perf: none)",
    ),
    (
        ("-sp", "--special"),
        "--verbose-prompt shows the special tokens of the prompt; replies print their text",
    ),
    (
        ("-o", "--output", "--output-file"),
        "the reply is on stdout: redirect it (> FILE)",
    ),
    (
        ("-bf", "--binary-file"),
        "-f FILE reads the prompt as text (bytes that are not UTF-8 become U+FFFD)",
    ),
    (
        ("-ctx",),
        "the context size is -c/--ctx-size",
    ),
    (
        ("--completion-bash",),
        "kvtool has no shell completion",
    ),
    (
        ("-fa", "--flash-attn"),
        "kvtool's attention is always fused (flash attention); -fa is taken where it computes",
    ),
    (
        ("-v", "--verbose"),
        "this verb prints no logs to expand (`kvtool run -v` shows the model and context details)",
    ),
    (
        ("--version",),
        "`kvtool --version`",
    ),
]
# fmt: on

_REQUEST = (
    "a request sets its own sampling and length: temperature, top_k, top_p, min_p, typical_p, "
    "repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty, seed, max_tokens (n_predict), "
    "ignore_eos, stop"
)
_NO_SHIFT = (
    "kvtool serve has no context shift (`kvtool run` has): a prompt as long as a slot is refused "
    "(400, exceed_context_size_error) and an answer that fills its slot stops ('length')"
)
_NO_UI = "kvtool serve has no web UI: it serves the API only"

# llama-server's flags typed at `kvtool serve`, where they (or run's offer) mean something else
# fmt: off
_SERVE_GROUPS: list[tuple[tuple[str, ...], str]] = [
    (
        ("--temp", "--temperature", "--top-k", "--top-p", "--min-p", "--typical", "--typical-p",
         "--repeat-penalty", "--repeat-last-n", "--presence-penalty", "--frequency-penalty", "-s", "--seed",
         "-n", "--predict", "--n-predict", "--ignore-eos", "-r", "--reverse-prompt"),
        _REQUEST,
    ),
    (
        ("--dry-multiplier", "--dry-base", "--dry-allowed-length", "--dry-penalty-last-n",
         "--dry-sequence-breaker", "--xtc-probability", "--xtc-threshold", "--top-nsigma", "--top-n-sigma",
         "--mirostat", "--mirostat-lr", "--mirostat-ent", "--dynatemp-range", "--dynatemp-exp",
         "--adaptive-target", "--adaptive-decay", "-l", "--logit-bias", "--samplers", "--sampler-seq",
         "--sampling-seq", "-bs", "--backend-sampling"),
        "kvtool's samplers, set per request: temperature, top_k, top_p, min_p, typical_p and the penalties",
    ),
    (("--keep", "--context-shift", "--no-context-shift"), _NO_SHIFT),
    (
        ("--chat-template", "--chat-template-file", "--chat-template-kwargs"),
        "the GGUF's own template is used (--no-jinja: the named format of its family)",
    ),
    (
        ("--prefill-assistant", "--no-prefill-assistant"),
        "a chat is rendered whole and the answer starts a new assistant turn",
    ),
    (
        ("--prompt-cache", "--prompt-cache-all", "--prompt-cache-ro", "--cache-idle-slots",
         "--no-cache-idle-slots", "--cache-reuse"),
        "kvtool serve reuses the longest common prefix a slot holds (--cache-prompt), keeps what slots "
        "drop in RAM (-cram) and on disk (--cache-dir), and an idle slot's prompt goes to them when "
        "another conversation takes the slot; no chunk reuse after a divergence",
    ),
    (
        ("--kv-unified-per-slot",),
        "-c is split evenly among the -np slots (-kvu: one pool they share)",
    ),
    (("--ssl-key-file", "--ssl-cert-file"), "kvtool serve speaks plain HTTP: put a TLS proxy in front of it"),
    (
        ("--path", "--no-webui", "--webui", "--ui", "--no-ui", "--webui-config", "--webui-config-file",
         "--ui-config", "--ui-config-file", "--webui-mcp-proxy", "--no-webui-mcp-proxy", "--ui-mcp-proxy",
         "--no-ui-mcp-proxy", "--media-path"),
        _NO_UI,
    ),
    (
        ("--cors-origins", "--cors-methods", "--cors-headers", "--cors-credentials", "--no-cors-credentials"),
        "kvtool serve sends no CORS headers: a browser on another origin needs a proxy in front of it",
    ),
    (
        ("-ag", "--agent", "-no-ag", "--no-agent", "--tools", "--tools-runtime", "--mcp-servers-config",
         "--mcp-servers-json"),
        "kvtool serve runs no tools, agents or MCP servers",
    ),
    (
        ("--models-dir", "--models-max", "--models-preset", "--models-autoload", "--no-models-autoload",
         "--sleep-idle-seconds"),
        "kvtool serve serves the one model -m loads, for as long as it runs: one server per model",
    ),
    (
        ("-embd", "--embedding", "--embeddings", "--pooling", "--rerank", "--reranking", "--embd-normalize",
         "--spm-infill"),
        "kvtool serve generates text: it has no embeddings, reranking or infill endpoints",
    ),
    (("--threads-http",), "uvicorn answers HTTP on one event loop; the engine runs on a thread of its own"),
    (("--api-key-file",), "--api-key takes the keys, comma-separated"),
    (("--api-prefix",), "kvtool serve's endpoints are at the root (/v1/..., /completion, /health)"),
    (("--reuse-port",), "kvtool serve listens on one socket of its own (--host, --port)"),
    (("--sse-ping-interval",), "a stream sends its events only, no keep-alive pings"),
    (("--props",), "/props answers GET only"),
    (("--tags",), "-a/--alias gives the model's names"),
    (("-e", "--escape", "--no-escape"), "requests carry their text as JSON strings"),
    (("--perf", "--no-perf"), "every answer carries its timings; /metrics sums them"),
    (("--warmup", "--no-warmup"), "kvtool serve does no warmup run"),
    (("-sp", "--special"), "answers carry their text; /tokenize gives a text's token ids"),
    (
        ("-v", "--verbose", "-lv", "--verbosity", "--log-verbosity", "--log-disable", "--log-file",
         "--log-colors", "--log-verbose", "--log-prefix", "--no-log-prefix", "--log-timestamps",
         "--no-log-timestamps", "--log-jsonl", "--no-log-jsonl", "--log-prompts-dir"),
        "kvtool serve prints a line when it starts and stops, errors as single lines; /slots and "
        "/metrics show its work",
    ),
    (
        ("-lcs", "--lookup-cache-static", "-lcd", "--lookup-cache-dynamic", "--spec-ngram-size-n",
         "--spec-ngram-size-m", "--spec-ngram-min-hits", "--lora-init-without-apply"),
        "kvtool serve has no speculative decoding or adapters",
    ),
    (
        ("--fim-qwen-1.5b-default", "--fim-qwen-3b-default", "--fim-qwen-7b-default", "--fim-qwen-7b-spec",
         "--fim-qwen-14b-spec", "--fim-qwen-30b-default", "--embd-gemma-default"),
        _MODEL_FILE,
    ),
    (("--mtmd-batch-max-tokens",), _MEDIA),
]
# fmt: on

LLAMA_ONLY: dict[str, str] = {name: offer for names, offer in _GROUPS for name in names}
BY_VERB: dict[str, dict[str, str]] = {
    "kvtool serve": {name: offer for names, offer in _SERVE_GROUPS for name in names}
}
"""A verb's own offers, looked up before LLAMA_ONLY's (by the verb as `where` names it)."""
