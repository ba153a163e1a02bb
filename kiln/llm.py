"""`LLM`: offline batch generation, the Python entry point most users start from."""

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from kiln.compiler.key import cache_key, kiln_source_hash, model_factors
from kiln.config import (CompileConfig, EngineConfig, ParallelConfig, cpu_has_native_bf16, default_cache_dir,
                         parse_device, parse_dtype, parse_kv_cache_dtype)
from kiln.errors import KilnError
from kiln.models.config import ModelConfig
from kiln.models.lm_head import quantize_lm_head
from kiln.models.quantization import check_int4_placement, check_scheme, quantize_model, stored_or
from kiln.models.registry import create_model
from kiln.passes import GraphPass
from kiln.runtime.engine import Engine, RequestOutput
from kiln.runtime.kv_cache import bytes_per_block
from kiln.runtime.memory import MemoryPlan, activation_bytes, available_bytes
from kiln.runtime.parallel import init_from_env
from kiln.runtime.sampler import SamplingParams
from kiln.runtime.tokenizer import Tokenizer, TooManyTokens
from kiln.threads import use_threads
from kiln.units import format_size
from kiln.weights.model_weights import ModelWeights, PackFileOpener

logger = logging.getLogger(__name__)


class LLM:
    """Load a Hugging Face-format decoder and generate from batches of prompts.

    `compile=True` runs the backbone from kiln's compiled artifact in `cache_dir` (default
    `$KILN_CACHE` or ~/.cache/kiln), compiling it first if it is absent or unusable;
    `require_artifact=True` runs it too, and makes a missing or broken artifact an error instead.
    `quantization="int8"` or `"fp8"` quantizes the decoder's projections (W8A8, per-channel weights,
    per-token activations, int8's per token and block of 32 on a CPU) after loading, unless the checkpoint
    is quantized already; `"w7a8"` is int8 with weight codes in [-63, 63] and per-token activations; `"int4"`
    and `"q8_0"` (CPU only) hold 4-bit codes with a scale and a minimum per 32 weights, or int8 codes with a scale
    per 32 (llama.cpp's Q8_0). A quantized GGUF file runs in the scheme nearest its types (its Q4_0, Q4_1, Q4_K,
    Q8_0 and Q5_0 codes as stored) unless given `"none"`.
    `passes` adds the user's own graph passes (`kiln.passes.GraphPass`) to the compile; they are part
    of the artifact key.
    `dtype="auto"` runs in the checkpoint's dtype (config.json's `torch_dtype`); "float32",
    "bfloat16" or "float16" cast to it. Before loading, the weights and a KV cache are checked
    against the memory available; the KV cache then takes `memory_utilization` of what is left.
    `artifact=PATH` runs that artifact directly (no key lookup, never compiles). On a CPU, a compiled
    program's packed weights are kept in `cache_dir`/packed, keyed by the checkpoint's contents, and
    read back, every byte checked, by later loads (`kiln.weights.pack_cache`; `$KILN_PACK_CACHE=off`
    packs them in memory at every load).
    `tensor_parallel_size=N` splits the model over N processes started by `torchrun --nproc-per-node N`:
    every rank builds its share, and every rank returns the same outputs. `threads` sets the CPU
    threads (default: the machine's physical cores). `lm_head_quantization="int8"` (or "w7a8") runs the LM
    head on int8 weights (per channel) and activations (per 32 on an artifact's blocked int8 GEMM, else per
    token): a quarter of fp32's bytes, for large
    vocabularies; `benchmarks/quantization.py` reports its effect on greedy outputs. `kv_cache_dtype="int8"`
    (CPU) stores the KV cache as int8 codes with a scale per token and KV head: about a quarter of fp32's
    bytes, so four times the tokens in the same memory, and a quarter of the bytes decode reads at depth.

    >>> llm = LLM("path/to/model")
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))[0].text
    """

    def __init__(
        self,
        model: str | Path,
        dtype: str = "auto",
        compile: bool = False,
        seed: int = 0,
        device: str = "auto",
        cache_dir: str | Path | None = None,
        require_artifact: bool = False,
        compile_config: CompileConfig | None = None,
        quantization: str | None = None,
        passes: Sequence[GraphPass] = (),
        artifact: str | Path | None = None,
        tensor_parallel_size: int = 1,
        threads: int | None = None,
        lm_head_quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        **engine_options,
    ):
        start = time.perf_counter()
        self.model_name = Path(model).resolve().name
        """The model's name as given (its directory's or GGUF file's), which the server reports."""
        model_dir = self.model_dir = ModelWeights.directory(model, Path(cache_dir or default_cache_dir()))
        """Where the model is read from: the directory given, or a GGUF file's view directory."""
        self.model_config = ModelConfig.from_model_dir(model_dir)
        self.weights = ModelWeights(model_dir)
        self.dtype = self.model_config.resolve_dtype(dtype)
        """The dtype the model runs in: `dtype`, or for "auto" the checkpoint's."""
        chosen = parse_device(device)
        self.threads = use_threads(threads) if chosen.type == "cpu" or threads is not None else None
        """How many CPU threads run the kernels (None: torch's default, on a GPU)."""
        self.parallel = _join_group(tensor_parallel_size, chosen.type)
        self.device = _pin(chosen)
        engine_config = EngineConfig(**engine_options)
        self.kv_cache_dtype = parse_kv_cache_dtype(kv_cache_dtype, self.device)
        """The KV cache's dtype where it is not the model's (None): torch.int8 for `kv_cache_dtype="int8"`."""
        self.quantization = check_scheme(stored_or(quantization, self.weights))
        """The scheme the projections were quantized to at load (None: as the checkpoint has them)."""
        held = getattr(self.model_config.quantization, "scheme", None)
        check_int4_placement(self.quantization or held, self.device)
        self._check_memory(engine_config)
        self.model = create_model(self.model_config, parse_dtype(self.dtype), self.device, self.parallel,
                                  quantize=self.quantization)  # a projection at a time: never all in full precision
        self.model.kv_cache_dtype = self.kv_cache_dtype
        self.checkpoint_checksum = self.weights.load_into(self.model)
        """The checksum of every checkpoint byte loaded (`kiln.checksum`): what keys the packed weights."""
        if self.quantization:  # done while loading; this refuses a checkpoint quantized with another scheme
            quantize_model(self.model, self.quantization)
        if lm_head_quantization is not None:
            # an artifact's load packs the head for the GEMM it ships
            quantize_lm_head(self.model, lm_head_quantization, pack=not (artifact or compile or require_artifact))
        self.tokenizer = Tokenizer(model_dir) if (model_dir / "tokenizer.json").is_file() else None
        forward = None
        self.artifact_path: Path | None = None
        """The compiled artifact this LLM runs (compile=True only)."""
        self._packs = None  # eager: nothing is packed
        if artifact is not None or compile or require_artifact:
            self._packs = self._pack_file(Path(cache_dir or default_cache_dir()), self.quantization, lm_head_quantization)
        if artifact is not None:  # this artifact and no other: never compiles
            from kiln.runtime import bind  # imports Inductor's loader: only for a compiled model

            self.artifact_path = Path(artifact)
            forward = bind.load(self.artifact_path, self.model, release_weights=True, packs=self._packs)
            if engine_config.max_num_batched_tokens > forward.graph.max_num_tokens:
                raise KilnError(
                    f"max_num_batched_tokens {engine_config.max_num_batched_tokens} exceeds the max_num_tokens "
                    f"{forward.graph.max_num_tokens} of artifact {self.artifact_path}: lower it (--max-num-tokens)"
                )
        elif compile or require_artifact:  # requiring the artifact means running it, as the CLI's flag does
            compile_config = compile_config or CompileConfig()
            if engine_config.max_num_batched_tokens > compile_config.max_num_tokens:
                raise KilnError(
                    f"max_num_batched_tokens {engine_config.max_num_batched_tokens} exceeds the compiled "
                    f"max_num_tokens {compile_config.max_num_tokens}: lower it or compile with a larger "
                    "--max-num-tokens"
                )
            forward = self._compiled(Path(cache_dir or default_cache_dir()), compile_config, require_artifact,
                                     passes)
        self.engine = Engine(self.model, engine_config, self.tokenizer, seed=seed, forward=forward)
        if self.device.type == "cpu":
            ModelWeights.settle()  # packed weights onto huge pages while the CPUs idle, not before ready
        logger.info("ready in %.2fs", time.perf_counter() - start)

    @property
    def dtype_note(self) -> str:
        """Which dtype runs and why, for the start-up line."""
        why = "the checkpoint's" if self.model_config.dtype == self.dtype else "asked for"
        note = f"running in {self.dtype} ({why}"
        if self.device.type == "cpu" and self.dtype == "bfloat16" and not cpu_has_native_bf16():
            note += ("; this CPU has no native bfloat16 arithmetic (AVX512-BF16/AMX), so matmuls convert in "
                     "software: they read half the bytes, faster at batch 1, but are slower than float32 on "
                     "batches; --dtype float32 where twice the weight memory fits")
        return note + ")"

    def _check_memory(self, engine_config: EngineConfig) -> None:
        """Fail before loading when the weights and a KV cache cannot fit the memory available, with the
        numbers and only the changes that would fit (instead of an OOM kill mid-load); and when the
        context asked for is longer than the model's or than the KV cache asked for holds."""
        cfg, c = self.model_config, engine_config
        if c.max_model_len is not None and c.max_model_len > cfg.max_position_embeddings:
            raise KilnError(f"max_model_len {c.max_model_len} exceeds the model's max_position_embeddings "
                            f"{cfg.max_position_embeddings}: give --max-model-len {cfg.max_position_embeddings} or less")
        dtype, world = parse_dtype(self.dtype), self.parallel.world_size
        per_token = bytes_per_block(cfg, 1, self.kv_cache_dtype or dtype, max(1, cfg.num_kv_heads // world))
        given = c.kv_cache_memory_bytes
        if given is not None:
            holds = given // (per_token * c.block_size) * c.block_size
            if holds < (c.max_model_len or 2):
                raise KilnError(f"the KV cache holds {holds} tokens, less than max_model_len "
                                f"{c.max_model_len or cfg.max_position_embeddings}: give it more memory "
                                "(--kv-cache-memory, --memory-utilization) or lower max_model_len (--max-model-len)")
        weights = self.weights.bytes_in(dtype, quantize=self.quantization) // world
        available = available_bytes(self.device) // (world if self.device.type == "cpu" else 1)
        kv_min = given or per_token * (c.max_model_len or c.max_num_batched_tokens)  # one sequence, or one step
        plan = MemoryPlan(weights, activation_bytes(cfg, c.max_num_batched_tokens, c.max_num_seqs), kv_min, available,
                          c.memory_utilization, kv_given=given is not None)
        if plan.fits:
            return
        options = []
        if dtype.itemsize == 4 and replace(plan, weights=weights // 2, kv_min=given or kv_min // 2).fits:
            options.append(f"--dtype bfloat16 (half the weights: {format_size(weights // 2)})")
        fit = max(plan.kv_room, 0) // (per_token * c.block_size) * c.block_size  # tokens of KV cache that fit
        if given is not None and fit >= (c.max_model_len or 2):
            options.append(f"--kv-cache-memory {format_size(fit * per_token)} or less")
        elif given is None and c.max_model_len is not None and fit >= 2 * c.block_size:
            # a tenth spare: the engine sizes the cache from the memory it finds once the weights are in
            options.append(f"--max-model-len {fit * 9 // 10 // c.block_size * c.block_size} or less")
        elif given is None and c.max_model_len is None:
            step = c.max_num_batched_tokens // 2
            while step >= 16 and not replace(plan, activations=activation_bytes(cfg, step, c.max_num_seqs),
                                             kv_min=per_token * step).fits:
                step //= 2
            if step >= 16:
                options.append(f"--max-num-tokens {step} (a smaller step needs less KV cache and activations)")
        if given is None and c.memory_utilization < 1 and available > weights:
            share = (plan.activations + kv_min) / (available - weights)
            if share * 1.1 <= 1:
                options.append(f"--memory-utilization {math.ceil(share * 110) / 100:g}")
        more = format_size(plan.needed - available)
        options.append(f"{more} more GPU memory, or --tensor-parallel-size N over N GPUs" if self.device.type == "cuda"
                       else f"a machine with {more} more memory")
        plan.check(self.dtype, options)

    def _pack_file(self, cache_dir: Path, quantization: str | None,
                   lm_head_quantization: str | None) -> PackFileOpener | None:
        """Where a compiled program's packed weights are kept between loads (`kiln.weights.pack_cache`),
        keyed by this checkpoint's contents, its quantization and this rank's shard; None off the CPU or where
        `$KILN_PACK_CACHE` is off."""
        if self.device.type != "cpu":
            return None
        identity = {"checkpoint": self.checkpoint_checksum, "dtype": self.dtype,
                    "quantization": quantization, "lm_head_quantization": lm_head_quantization,
                    "shard": [self.parallel.rank, self.parallel.world_size], "torch": torch.__version__,
                    "kiln_source": kiln_source_hash()}  # packing, loading and quantizing code
        return self.weights.pack_file(cache_dir, identity)

    def _compiled(self, cache_dir: Path, compile_config: CompileConfig, require_artifact: bool,
                  passes: Sequence[GraphPass]):
        """Load the artifact for this model and config; compile it first if it is absent or broken."""
        from kiln.compiler import artifact
        from kiln.runtime import bind  # imports Inductor's loader: only for a compiled model

        factors = model_factors(self.model, compile_config, passes)
        path = self.artifact_path = cache_dir / cache_key(factors)
        try:
            return bind.load(path, self.model, release_weights=True, packs=self._packs, factors=factors)
        except artifact.ArtifactError as e:
            if require_artifact:
                raise
            log = logger.info if isinstance(e, artifact.ArtifactMissing) else logger.warning
            log("%s; compiling now", e)
        from kiln.compiler.compile import build_artifact  # the tracing path, only when needed

        result = build_artifact(self.model, compile_config, cache_dir, passes=passes,
                                model_name=self.model_name, weight_types=self.weights.stored_types())
        return bind.load(result.path, self.model, release_weights=True, packs=self._packs)

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion in continuous batches; results come back in prompt order. A
        request that fails on its own (every token masked, say) comes back with finish reason "error"
        and the exception in `error`; the others are unaffected."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise KilnError(f"{len(prompts)} prompts but {len(params)} sampling params")
        if any(isinstance(prompt, str) for prompt in prompts) and self.tokenizer is None:
            raise KilnError("this model directory has no tokenizer.json: pass token ids instead of text")
        batch = [(self._encode(prompt), prompt) if isinstance(prompt, str) else (list(prompt), None)
                 for prompt in prompts]
        for (ids, _), p in zip(batch, params):  # every prompt checked before any is queued
            self.engine.validate(ids, p)
        order: dict[str, int] = {}
        try:
            for (ids, text), p in zip(batch, params):
                order[self.engine.add_request(ids, p, prompt=text)] = len(order)
            results: list[RequestOutput | None] = [None] * len(order)
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
        except BaseException:  # a failed call (an interrupt too) leaves the engine as it found it
            for request_id in order:
                self.engine.abort(request_id)
            raise
        return results

    def embed(self, prompts: str | list[str] | list[list[int]], pooling: str = "last") -> list[list[float]]:
        """Each prompt's embedding: the model's final hidden states pooled ("last" token, vLLM's default for
        decoder models, or "mean") and L2-normalized. The same compiled program runs them; nothing is sampled."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        outs = self.generate(prompts, SamplingParams(max_tokens=1, pooling=pooling))
        failed = next((o for o in outs if o.embedding is None), None)
        if failed is not None:
            raise KilnError(f"embedding a prompt failed: {failed.error}")
        return [o.embedding for o in outs]

    def _encode(self, prompt: str) -> list[int]:
        """A prompt's ids, refused as soon as it is known not to fit (a long text is not tokenized whole)."""
        limit = self.engine.max_model_len
        try:
            return self.tokenizer.encode(prompt, max_tokens=limit - 1)
        except TooManyTokens as e:
            raise KilnError(f"the prompt has {e.counted} tokens; max_model_len is {limit}, which leaves no room "
                            "to generate") from None


def _pin(device: torch.device) -> torch.device:
    """A CUDA device with its index, made this thread's current one: Triton launches on the current
    device, whatever its tensors' (torchrun's ranks have theirs set by joining the group)."""
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    return device


def _join_group(tensor_parallel_size: int, device: str) -> ParallelConfig:
    """This process's place among `tensor_parallel_size` ranks, joining torchrun's group if there are several."""
    if tensor_parallel_size < 1:
        raise KilnError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if tensor_parallel_size == 1:
        return ParallelConfig()
    parallel = init_from_env(device)
    if parallel.world_size != tensor_parallel_size:
        raise KilnError(f"tensor_parallel_size {tensor_parallel_size} needs as many processes, this one is in a "
                        f"world of {parallel.world_size}: start it with `torchrun --nproc-per-node "
                        f"{tensor_parallel_size} ...`")
    return parallel
