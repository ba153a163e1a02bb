"""Configuration objects, with every default in one place."""

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from kiln.errors import KilnError

if TYPE_CHECKING:  # torch is imported on use: the CLI parser reads these defaults before any work
    import torch

DTYPES = ("float32", "bfloat16", "float16")
"""Activation dtypes, as manifests, keys and the CLI spell them."""
QUANTIZATIONS = ("int8", "w7a8", "fp8", "int4", "q8_0")
"""`--quantization` schemes (`kiln.models.quantization.SCHEMES`): W8A8 int8 or fp8, int8 with 7-bit
weight codes, which x86 CPUs without VNNI multiply about twice as fast as exact W8A8, W4A8 int4
(4-bit weights with a scale and a minimum per 32, activations with a scale per 32; CPU only), and q8_0
(int8 weights with an fp16 scale per 32, llama.cpp's Q8_0, activations with a scale per 32; CPU only)."""
NO_QUANTIZATION = "none"
"""`--quantization none`: full precision, also for a checkpoint whose stored codes would otherwise run as they
are (a quantized GGUF file runs in the scheme nearest its types unless told this)."""
KV_CACHE_DTYPES = ("auto", "int8")
"""`--kv-cache-dtype`: the model's dtype, or int8 codes with a scale per token and KV head (CPU only)."""
LM_HEAD_QUANTIZATIONS = ("int8", "w7a8")
"""`--lm-head-quantization` schemes (`kiln.models.lm_head`): the same two int8 forms."""


def dtype_name(dtype: "torch.dtype") -> str:
    """"float32" for torch.float32: how manifests and keys spell a dtype."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> "torch.dtype":
    import torch

    if name not in DTYPES:
        raise KilnError(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}")
    return getattr(torch, name)


def parse_kv_cache_dtype(name: str, device: "torch.device") -> "torch.dtype | None":
    """A `--kv-cache-dtype` as the cache's dtype: None for "auto" (the model's)."""
    import torch

    if name not in KV_CACHE_DTYPES:
        raise KilnError(f"unknown KV cache dtype {name!r}; choose from {', '.join(KV_CACHE_DTYPES)}")
    if name == "auto":
        return None
    if device.type != "cpu":
        raise KilnError(f"--kv-cache-dtype {name} runs on CPU only for now (the CUDA attention kernels read the "
                        "model's dtype): leave it at auto on a GPU")
    return torch.int8


def parse_device(name: str) -> "torch.device":
    """A device name as the model's device: "auto" is the GPU where one is visible, else the CPU."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise KilnError(f"unknown device {name!r}: use auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise KilnError(f"kiln runs on cpu or cuda, not {device.type!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise KilnError(f"device {name!r} asked for, but this torch sees no CUDA GPU: use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise KilnError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA GPUs")
    return device


def cpu_has_native_bf16() -> bool:
    """Whether this CPU does bf16 arithmetic in hardware (AVX512-BF16 or AMX); without it, bf16
    matmuls convert to fp32 in software."""
    import torch

    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if all(check is None for check in checks):
        try:
            flags = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
        return "avx512_bf16" in flags or "amx_bf16" in flags
    return any(check() for check in checks if check is not None)


@dataclass
class EngineConfig:
    """How the runtime batches and caches: the knobs of the scheduler and the paged KV cache."""

    block_size: int = 16
    """Tokens per KV-cache block."""
    kv_cache_memory_bytes: int | None = None
    """KV-cache memory; None: `memory_utilization` of the memory left once the weights are loaded, less
    activations. Never more than max_num_seqs full sequences take."""
    memory_utilization: float = 0.9
    """The share of the memory available after loading the weights that the KV cache and activations
    may take (vLLM's gpu_memory_utilization, over free memory; on a CPU, MemAvailable, shared by the
    ranks of a tensor-parallel group)."""
    max_num_seqs: int = 64
    """Sequences running at once; more wait in the queue."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step; longer prompts are prefilled in chunks."""
    max_model_len: int | None = None
    """Prompt + generated tokens per sequence; None means the model's max_position_embeddings."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of an earlier request's identical prefix (full blocks, by content hash)."""
    cudagraph_sizes: tuple[int, ...] | None = None
    """Token counts a compiled program pads batches to and, on CUDA, captures piecewise CUDA graphs
    at. None: 1, 2, 4, 8, ... up to max_num_seqs on CUDA, none on CPU; (): no graphs, no padding."""

    def __post_init__(self) -> None:
        for name in ("block_size", "kv_cache_memory_bytes", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise KilnError(f"EngineConfig.{name} must be an integer, got {value!r}")
            if value is not None and value < 1:
                raise KilnError(f"EngineConfig.{name} must be >= 1, got {value}")
        if not 0 < self.memory_utilization <= 1:
            raise KilnError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        bad = [s for s in self.cudagraph_sizes or () if not 1 <= s <= self.max_num_batched_tokens]
        if bad:
            raise KilnError(f"cudagraph sizes {bad} are outside [1, max_num_batched_tokens={self.max_num_batched_tokens}]")


@dataclass(frozen=True)
class PassConfig:
    """Which of kiln's graph passes run. All on by default; each is part of the
    artifact key, so turning one off builds a different artifact."""

    noop_elimination: bool = True
    """Drop reshapes, views and slices that do not change their input."""
    allreduce_rms: bool = True
    """Tensor parallelism's all_reduce -> residual add + RMSNorm => one fused op."""
    allreduce_rms_max_tokens: int | None = None
    """Largest batch (tokens) the allreduce+RMSNorm fusion applies to; None: every batch."""
    rms_quant: bool = True
    """RMSNorm (+ residual add) -> activation quant => one fused op."""
    act_quant: bool = True
    """SiLU*Mul -> activation quant => one fused op."""
    rope_kvcache: bool = True
    """Rotary embedding -> KV-cache write of the rotated key => one fused op (CUDA graphs only: on CPU
    the rotary is left to Inductor, which fuses it with the QKV projection's epilogue)."""
    attn_quant: bool = True
    """Attention -> static quant of its output => attention writing quantized output."""
    lowering: bool = True
    """After fusion, kiln ops with a native torch form become that form, for Inductor to fuse."""
    kernel_choice: bool = True
    """On CUDA, lowering first times each norm/activation op's Triton kernel against Inductor's code
    for it and keeps the kernel where it is faster (recorded in the manifest); off: Inductor's always."""
    gemm_choice: bool = True
    """On CPU, lowering times each projection's oneDNN kernel on a weight packed at load against
    torch's GEMM on the weight as loaded, and keeps the faster (recorded in the manifest)."""


@dataclass(frozen=True)
class CompileConfig:
    """What `kiln compile` builds: it is part of the artifact's cache key, so only knobs that change
    the compiled code belong here."""

    max_num_tokens: int = 2048
    """Largest flattened batch (tokens per step) the compiled pieces serve; the runtime's
    max_num_batched_tokens may not exceed it."""
    sizes: tuple[int, ...] = field(default_factory=tuple)
    """Token counts that also get a static-shape compile of every piece (others use the dynamic one)."""
    range_splits: tuple[int, ...] = field(default_factory=tuple)
    """Token counts that cut [1, max_num_tokens] into ranges: (64,) gives [1, 64] and [65, max]. A pass
    may apply to some ranges only (`GraphPass.applies_to`); ranges whose passes agree share one graph."""
    passes: PassConfig = field(default_factory=PassConfig)
    """kiln's graph passes, on or off."""

    def __post_init__(self) -> None:
        if self.max_num_tokens < 1:
            raise KilnError(f"max_num_tokens must be >= 1, got {self.max_num_tokens}")
        bad = [s for s in self.sizes if not 1 <= s <= self.max_num_tokens]
        if bad:
            raise KilnError(f"static sizes {bad} are outside [1, max_num_tokens={self.max_num_tokens}]")
        object.__setattr__(self, "sizes", tuple(sorted(set(self.sizes))))
        bad = [s for s in self.range_splits if not 1 <= s < self.max_num_tokens]
        if bad:
            raise KilnError(f"range splits {bad} are outside [1, max_num_tokens={self.max_num_tokens})")
        object.__setattr__(self, "range_splits", tuple(sorted(set(self.range_splits))))

    def dynamic_ranges(self) -> list[tuple[int, int]]:
        """[1, max_num_tokens] cut at `range_splits`: with each static size as a range of one, the
        units a pass's `applies_to` is asked about."""
        bounds = [0, *self.range_splits, self.max_num_tokens]
        return [(a + 1, b) for a, b in zip(bounds, bounds[1:])]


@dataclass(frozen=True)
class ParallelConfig:
    """Where this process sits in tensor parallelism: models shard by it, `kiln::all_reduce` sums
    over `group_name` ("": the default group)."""

    rank: int = 0
    world_size: int = 1
    group_name: str = ""

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise KilnError(f"tensor parallel rank {self.rank} is outside world size {self.world_size}")


@dataclass(frozen=True)
class ServerConfig:
    """How `kiln serve` listens and whom it admits: limits, authentication, TLS and CORS."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_queued_requests: int = 256
    """Sequences admitted beyond the max_num_seqs running; past it a request gets 503 with
    Retry-After, so a flood costs bounded memory."""
    request_timeout: float | None = None
    """Seconds from arrival (queueing included) after which a request is aborted and answered 408;
    None: no limit."""
    shutdown_timeout: float = 30.0
    """Seconds a server told to stop (SIGTERM, SIGINT) lets its running requests finish, admitting no
    more; then the rest end with an error and it exits."""
    max_request_bytes: int = 4 * 2**20
    """Largest request body; a larger one is answered 413 before it is read (from Content-Length, or as
    soon as a streamed body passes it)."""
    header_timeout: float = 10.0
    """Seconds a connection may take to send a request's headers, from opening (or from its previous
    response); then it is closed."""
    body_timeout: float = 60.0
    """Seconds a request's body may take to arrive, from its first byte read; then 408."""
    keep_alive_timeout: float = 5.0
    """Seconds an idle keep-alive connection stays open (uvicorn's default)."""
    max_logit_bias: int = 1024
    """Most `logit_bias` entries one request may give."""
    max_stop_strings: int = 64
    """Most stop strings one request may give."""
    max_stop_length: int = 1024
    """Longest stop string, in characters."""
    max_choices: int = 1024
    """Most options in a choice constraint (guided_choice, structured_outputs.choice); llguidance gives up
    near 2000."""
    max_grammar_bytes: int = 64 * 2**10
    """Largest output constraint (JSON schema, regex, grammar, or all choices together), in UTF-8 bytes:
    compiling one takes time that grows faster than its size."""
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = None
    """How chat answers' thinking is told from the answer (`reasoning_content`); None: it is not."""
    tool_call_parser: Literal["hermes", "llama3_json", "mistral", "qwen3"] = "hermes"
    """The format the model writes tool calls in (vLLM's parser names): how calls are parsed from answers,
    and the grammar that holds required, named and strict calls."""
    max_stored_responses: int = 1024
    """Responses (/v1/responses with `store`) kept in memory for `previous_response_id`, newest first; they
    hold 64 MiB of conversation at most whatever this is."""
    pooling: Literal["last", "mean"] = "last"
    """How /v1/embeddings pools a prompt's final hidden states: the last token's (vLLM's default for
    decoder models) or their mean; L2-normalized either way."""
    api_key: str | None = None
    """Clients must send `Authorization: Bearer <api_key>` (else 401); None: anyone may."""
    api_key_scope: Literal["v1", "all"] = "v1"
    """Which paths need the key: "v1", the API under /v1/ (vLLM's rule: /health, /metrics, /docs,
    /openapi.json, /tokenize and /version stay open); "all", every path but `auth_exempt`."""
    auth_exempt: tuple[str, ...] = ()
    """With scope "all": paths (/health, /metrics) served without the key, for probes and scrapers."""
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ciphers: str | None = None
    """OpenSSL cipher list for TLS 1.2 and below; None: Python's `ssl` defaults (forward-secret AEAD
    suites first, no SHA-1)."""
    allowed_origins: tuple[str, ...] = ()
    """Browser origins allowed by CORS ("*" for any); none by default."""

    def __post_init__(self) -> None:
        if self.max_queued_requests < 0:
            raise KilnError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise KilnError(f"request_timeout must be > 0 seconds, got {self.request_timeout}")
        if not self.shutdown_timeout >= 0:
            raise KilnError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        for name in ("max_request_bytes", "header_timeout", "body_timeout", "keep_alive_timeout", "max_logit_bias",
                     "max_stop_strings", "max_stop_length", "max_choices", "max_grammar_bytes"):
            if getattr(self, name) <= 0:
                raise KilnError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.api_key is not None and not self.api_key.strip():
            raise KilnError("the API key is empty: give a non-empty --api-key (or KILN_API_KEY), or none")
        if bool(self.ssl_keyfile) != bool(self.ssl_certfile):
            raise KilnError("TLS needs both --ssl-keyfile and --ssl-certfile")
        if self.api_key_scope not in ("v1", "all"):
            raise KilnError(f"api_key_scope must be v1 or all, got {self.api_key_scope!r}")
        if self.auth_exempt and self.api_key_scope != "all":
            raise KilnError("--auth-exempt goes with --api-key-scope all: under the default scope (v1) only /v1/ "
                            "paths need the key, so /health and /metrics are open already")
        bad = [p for p in self.auth_exempt if p not in ("/health", "/metrics")]
        if bad:
            raise KilnError(f"only /health and /metrics can be exempt from the API key, not {', '.join(bad)}")

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"


def default_cache_dir() -> Path:
    """Where artifacts live: `$KILN_CACHE`, else ~/.cache/kiln."""
    return Path(os.environ.get("KILN_CACHE") or Path.home() / ".cache" / "kiln").expanduser()
