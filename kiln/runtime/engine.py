"""The engine owns requests: it adds and aborts them, runs one scheduled step at a time, samples,
applies stop conditions and hands back each request's progress. Not thread-safe: the server's
`AsyncEngine` calls it from one thread."""

import dataclasses
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kiln.config import EngineConfig, dtype_name
from kiln.errors import KilnError
from kiln.models.llama import CausalLM
from kiln.runtime.kv_cache import allocate_kv_caches, num_kv_blocks
from kiln.runtime.memory import GiB, activation_bytes, available_bytes
from kiln.runtime.runner import ForwardFn, ModelRunner
from kiln.runtime.penalties import adjust_logits, needs_adjusting
from kiln.runtime.penalties import prepare as prepare_adjustment
from kiln.runtime.sampler import GREEDY_BELOW, SampleResult, SamplingParams, sample, token_logprobs
from kiln.runtime.scheduler import Scheduler, Sequence
from kiln.runtime.stop_strings import StopStrings
from kiln.runtime.structured_output import GrammarBackend, apply_masks, fill_masks
from kiln.runtime.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[float] | None
    """Logprob of each generated token, when SamplingParams.logprobs is set."""
    top_logprobs: list[dict[int, float]] | None
    """The top-k alternatives at each step, when SamplingParams.logprobs > 0."""
    finish_reason: str | None
    """"stop" (EOS, stop token or stop string), "length" (max_tokens or max_model_len), "abort",
    "error" (then `error` says why); None while the request runs."""
    prompt_logprobs: list[float | None] | None = None
    """Each prompt token's logprob (None for the first), when SamplingParams.prompt_logprobs is set."""
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    """The top-k alternatives at each prompt position, when SamplingParams.prompt_logprobs > 0."""
    prompt_ranks: list[int | None] | None = None
    """Each prompt token's rank in its position's distribution (1: the most likely)."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the request (vLLM's field); None for EOS, a
    completed grammar, or a length limit."""
    embedding: list[float] | None = None
    """An embedding request's pooled, L2-normalized final hidden states (SamplingParams.pooling)."""
    error: Exception | None = None
    """Why the request failed (finish reason "error"): a KilnError when the request itself cannot go on
    (every token masked, a grammar llguidance gives up on), another exception for a failure inside
    kiln. Either way the step's other requests went on."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Engine:
    def __init__(
        self,
        model: CausalLM,
        config: EngineConfig,
        tokenizer: Tokenizer | None = None,
        seed: int = 0,
        forward: ForwardFn | None = None,
    ):
        cfg = model.config
        self.model_config, self.config, self.tokenizer = cfg, config, tokenizer
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise KilnError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                f"{cfg.max_position_embeddings}"
            )
        dtype, device = getattr(model, "cache_dtype", model.dtype), model.cos_sin_cache.device
        kv_heads = model.layout.num_kv_heads  # this rank's share under tensor parallelism
        kv_memory = config.kv_cache_memory_bytes
        if kv_memory is None:
            available = available_bytes(device) // (model.layout.world_size if device.type == "cpu" else 1)
            reserved = getattr(forward, "reserved_bytes", 0)  # what the program takes that still shows as available
            kv_memory = int(available * config.memory_utilization) - activation_bytes(
                cfg, config.max_num_batched_tokens, config.max_num_seqs) - reserved
            logger.info("KV cache budget: %.2f GiB (memory utilization %g of %.2f GiB available, less activations%s)",
                        max(kv_memory, 0) / GiB, config.memory_utilization, available / GiB,
                        f" and {reserved / GiB:.2f} GiB the program reserves" if reserved else "")
        num_blocks = num_kv_blocks(cfg, config.block_size, dtype, max(kv_memory, 0),
                                   config.max_num_seqs * self.max_model_len, kv_heads)
        if model.layout.world_size > 1:  # rank 0 schedules for all: every rank needs as many blocks
            num_blocks = _min_over_ranks(num_blocks, device)
        holds = num_blocks * config.block_size
        if holds < self.max_model_len:
            if config.max_model_len is not None or holds < 2:
                raise KilnError(
                    f"the KV cache holds {holds} tokens, less than max_model_len {self.max_model_len}: give it more "
                    "memory (--kv-cache-memory, --memory-utilization) or lower max_model_len (--max-model-len)"
                )
            logger.warning("max_model_len capped to %d tokens, what the KV cache holds (the model allows %d): give "
                           "the cache more memory with --kv-cache-memory or --memory-utilization for longer requests",
                           holds, self.max_model_len)
            self.max_model_len = holds
        kv_caches = allocate_kv_caches(cfg, num_blocks, config.block_size, dtype, device, kv_heads)
        if forward is not None and hasattr(forward, "capture_graphs"):  # a compiled program: pad, and graph on CUDA
            forward.capture_graphs(config.cudagraph_sizes, kv_caches, config.block_size,
                                   min(config.max_num_seqs, config.max_num_batched_tokens))
        logits = getattr(forward, "compute_logits", None) or model.compute_logits  # a program may pack the LM head
        self.runner = ModelRunner(forward or model, logits, kv_caches, config.block_size, device,
                                  getattr(forward, "greedy_tokens", None))
        self.scheduler = Scheduler(config, num_blocks)
        self.default_generator = torch.Generator(device).manual_seed(seed)  # a draw wants the logits' device
        self.eos_token_ids = set(tokenizer.eos_token_ids if tokenizer else cfg.eos_token_ids)
        self.grammars = GrammarBackend(tokenizer.path, cfg.vocab_size, sorted(self.eos_token_ids)) if tokenizer else None
        self._masks: ThreadPoolExecutor | None = None
        """On CUDA, computes structured-output masks while the GPU runs the step (created on first use)."""
        self._prompts: dict[str, str | None] = {}
        self._ids = itertools.count()
        self.step_tokens = 0
        """The tokens the last step's batch ran (prefill chunks and decodes)."""
        self.kv_cache_dtype = "auto" if getattr(model, "kv_cache_dtype", None) is None else dtype_name(dtype)
        """The KV cache's dtype as `--kv-cache-dtype` names it: "auto" (the model's) or "int8"."""
        logger.info("KV cache: %d blocks of %d tokens, %s", num_blocks, config.block_size,
                    dtype_name(dtype))

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise KilnError, naming the problem, for a request the engine cannot run. Reads nothing that
        steps change, so any thread may call it."""
        if not prompt_token_ids:
            raise KilnError("the prompt is empty: give at least one token")
        if len(prompt_token_ids) >= self.max_model_len:
            raise KilnError(
                f"the prompt has {len(prompt_token_ids)} tokens; max_model_len is {self.max_model_len}, "
                "which leaves no room to generate"
            )
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise KilnError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        bad = next((t for t in (*params.logit_bias, *params.stop_token_ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise KilnError(f"token id {bad} (in logit_bias or stop_token_ids) is outside the vocabulary [0, {vocab})")
        if params.min_tokens and len(self.eos_token_ids | set(params.stop_token_ids)) >= vocab:
            raise KilnError(f"stop_token_ids and EOS cover all {vocab} tokens, and min_tokens bans them all: no "
                            "token could be sampled; lower min_tokens or give fewer stop_token_ids")
        if params.stop and self.tokenizer is None:
            raise KilnError("stop strings need a tokenizer, and this model directory has none")
        if params.structured_output is not None:
            if self.grammars is None:
                raise KilnError("structured output needs the model's tokenizer.json, and this model directory has none")
            self.grammars.validate(params.structured_output)

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; returns its id. Bad input raises KilnError before anything is queued."""
        self.validate(prompt_token_ids, params)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._prompts:
            raise KilnError(f"request id {request_id!r} is already in use")
        gen = torch.Generator(self.runner.device).manual_seed(params.seed) if params.seed is not None else None
        seq = Sequence(request_id, list(prompt_token_ids), params, gen)
        seq.adjustment = prepare_adjustment(params, self.eos_token_ids, seq.prompt_token_ids,
                                            self.model_config.vocab_size, self.runner.device)
        seq.stops = StopStrings(params.stop) if params.stop else None
        seq.stop_ids = frozenset(params.stop_token_ids)
        seq.stop_reason = None
        if params.structured_output is not None:
            seq.matcher = self.grammars.matcher(params.structured_output)
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params.skip_special_tokens)
        self.scheduler.add(seq)
        self._prompts[request_id] = prompt
        return request_id

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is (waiting or running) and free its blocks; False if unknown
        or already finished."""
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        self._prompts.pop(request_id, None)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one batch; return the progress of every request that got a token in it (finished or not),
        and of every request that failed in it. Whatever one request's own work raises (scoring its
        prompt, adjusting or masking its logits, sampling, its grammar, detokenizing, stop checks) ends
        that request alone with finish reason "error"; only a failure of the batch's forward raises."""
        batch = self.scheduler.schedule()
        self.step_tokens = sum(batch.num_tokens)
        if not batch.seqs:
            if self.has_unfinished():
                raise KilnError("the scheduler could place no request in the KV cache: raise kv_cache_memory_bytes "
                               "(--kv-cache-memory)")
            return []
        pooling = [i for i, s in enumerate(batch.seqs) if s.params.pooling is not None]
        rows = [i for i, (s, n) in enumerate(zip(batch.seqs, batch.num_tokens))
                if n == s.num_pending and s.params.pooling is None]
        scoring = [i for i, s in enumerate(batch.seqs)
                   if s.params.prompt_logprobs is not None and len(s.prompt_logprobs) < len(s.prompt_token_ids)]
        sampling = [batch.seqs[i] for i in rows]
        guided = [j for j, s in enumerate(sampling) if s.matcher is not None]
        masks = None
        if guided and self.runner.device.type == "cuda":  # a CPU thread computes the masks while the GPU runs
            self._masks = self._masks or ThreadPoolExecutor(1, thread_name_prefix="kiln-grammar")
            masks = self._masks.submit(fill_masks, [sampling[j].matcher for j in guided], self.model_config.vocab_size)
        greedy = bool(sampling) and not guided and all(plain_greedy(s.params) for s in sampling)  # a prefill chunk samples none
        logits, every, tokens, states = self.runner.execute(batch, rows, scoring, greedy, pooling)
        failed: dict[str, Exception] = {}
        for i, chunk in zip(scoring, every):
            try:
                self._score_prompt(batch.seqs[i], chunk)
            except Exception as e:  # noqa: BLE001 - this request's failure, not the step's
                failed.setdefault(batch.seqs[i].request_id, e)
        for i, chunk in zip(pooling, states):
            try:
                _pool(batch.seqs[i], chunk)
            except Exception as e:  # noqa: BLE001 - this request's failure, not the step's
                failed.setdefault(batch.seqs[i].request_id, e)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            self.scheduler.computed(seq, n)
        embedded = [self._embedded(batch.seqs[i]) for i in pooling
                    if batch.seqs[i].num_pending == 0 and batch.seqs[i].request_id not in failed]
        if tokens is not None:
            result = SampleResult.of(tokens.tolist())
        else:
            result = self._sample(sampling, guided, masks, logits, failed)
        outputs = embedded
        for seq, token, logprob, top in zip(sampling, result.token_ids, result.logprobs, result.top_logprobs):
            if seq.request_id in failed:
                continue
            try:
                outputs.append(self._advance(seq, token, logprob, top))
            except Exception as e:  # noqa: BLE001
                failed[seq.request_id] = e
        outputs += [self._fail(seq, failed[seq.request_id]) for seq in batch.seqs if seq.request_id in failed]
        return outputs

    def _sample(self, sampling: list[Sequence], guided: list[int], masks, logits: torch.Tensor,
                failed: dict[str, Exception]) -> SampleResult:
        """One token per sequence from its row of `logits`, after its biases, penalties and grammar mask.
        Batched; where the batch raises, row by row, so that a failure is only the row's own."""
        outputs, adjustments = [s.output_token_ids for s in sampling], [s.adjustment for s in sampling]
        try:
            adjusted = adjust_logits(logits, adjustments, outputs)
        except Exception:  # noqa: BLE001
            adjusted = logits.clone()
            for j, seq in enumerate(sampling):
                try:
                    adjusted[j:j + 1] = adjust_logits(logits[j:j + 1], adjustments[j:j + 1], outputs[j:j + 1])
                except Exception as e:  # noqa: BLE001
                    failed.setdefault(seq.request_id, e)
        if guided:  # on CPU the forward keeps every core busy: masks computed beside it, or prefetched on a
            # thread between steps, measured slower than here (benchmarks/structured_output.py)
            adjusted = logits.clone() if adjusted is logits else adjusted
            matchers = [sampling[j].matcher for j in guided]
            bitmask, errors = masks.result() if masks is not None else fill_masks(matchers, self.model_config.vocab_size)
            for j, error in zip(guided, errors):
                if error is not None:
                    failed.setdefault(sampling[j].request_id, error)
            apply_masks(adjusted, guided, bitmask)
        params, generators = [s.params for s in sampling], [s.generator for s in sampling]
        drawn = [g or self.default_generator for p, g in zip(params, generators) if p.temperature >= GREEDY_BELOW]
        states = {id(g): (g, g.get_state()) for g in drawn}  # what a draw advances, to draw again from
        try:
            result = sample(logits, params, generators, self.default_generator, adjusted)
        except Exception:  # noqa: BLE001 - again row by row, from the same random state
            for g, state in states.values():
                g.set_state(state)
            result = SampleResult.of([0] * len(sampling))
            for j in range(len(sampling)):
                try:
                    one = sample(logits[j:j + 1], params[j:j + 1], generators[j:j + 1], self.default_generator,
                                 adjusted[j:j + 1])
                except Exception as e:  # noqa: BLE001
                    result.failures[j] = e
                    continue
                result.token_ids[j], result.logprobs[j] = one.token_ids[0], one.logprobs[0]
                result.top_logprobs[j], result.failures[j] = one.top_logprobs[0], one.failures[0]
        for seq, failure in zip(sampling, result.failures):
            if failure is not None:
                failed.setdefault(seq.request_id, failure)
        return result

    def _advance(self, seq: Sequence, token: int, logprob: float | None, top: dict[int, float] | None
                 ) -> RequestOutput:
        """Append the sampled token to `seq`, check its grammar and stop conditions, and snapshot it."""
        seq.token_ids.append(token)
        seq.logprobs.append(logprob)
        seq.top_logprobs.append(top)
        if seq.matcher is not None and not seq.matcher.accept(token):  # llguidance gave up, else a kiln bug
            raise seq.matcher.failure() or RuntimeError(f"sampled token {token} breaks the request's grammar")
        delta = seq.detokenizer.add(token) if seq.detokenizer is not None else ""
        reason, cut = self._check_stop(seq, token, len(delta))
        if reason is not None:
            self.scheduler.finish(seq, reason)
        return self._output(seq, cut)

    def _embedded(self, seq: Sequence) -> RequestOutput:
        """End an embedding request whose prompt has run: its pooled hidden states, L2-normalized."""
        pooled = seq.pooled / len(seq.prompt_token_ids) if seq.params.pooling == "mean" else seq.pooled
        self.scheduler.finish(seq, "stop")
        return dataclasses.replace(self._output(seq, None), embedding=F.normalize(pooled, dim=0).tolist())

    def _fail(self, seq: Sequence, error: Exception) -> RequestOutput:
        """End `seq` with finish reason "error" and free its blocks; its traceback is logged here, once."""
        if isinstance(error, KilnError):
            logger.warning("request %s failed: %s", seq.request_id, error)
        else:
            logger.error("request %s failed", seq.request_id, exc_info=error)
        if seq in self.scheduler.running:
            self.scheduler.finish(seq, "error")
        seq.finish_reason = "error"
        return RequestOutput(
            request_id=seq.request_id, prompt=self._prompts.pop(seq.request_id, None),
            prompt_token_ids=seq.prompt_token_ids, token_ids=list(seq.output_token_ids), text="", logprobs=None,
            top_logprobs=None, finish_reason="error", error=error)

    @staticmethod
    def _score_prompt(seq: Sequence, logits: torch.Tensor) -> None:
        """Record the logprobs of the prompt tokens that `logits` (one per token of `seq` run this step)
        predict, past those recorded already (a preempted sequence runs its prompt again)."""
        first, prompt = seq.num_computed, seq.prompt_token_ids
        targets = range(len(seq.prompt_logprobs), min(first + len(logits), len(prompt) - 1) + 1)
        if not targets:
            return
        rows = logits[targets.start - 1 - first: targets.stop - 1 - first]
        k = seq.params.prompt_logprobs
        found, alts, ranks = token_logprobs(rows, [prompt[j] for j in targets], [k] * len(targets), ranks=True)
        seq.prompt_logprobs += found
        seq.prompt_top_logprobs += alts
        seq.prompt_ranks += ranks

    def _check_stop(self, seq: Sequence, token: int, new_chars: int) -> tuple[str | None, int | None]:
        """(finish reason or None, where the text is cut or None). A stop string not found before must
        end in the `new_chars` characters this token added: only that tail is searched. The text stops
        before the stop string, or before the text of the stop token or EOS, unless the request says
        `include_stop_str_in_output` (vLLM's rule). Before `min_tokens` tokens only the length limits
        stop a request."""
        p = seq.params
        if len(seq.output_token_ids) < p.min_tokens:
            return ("length", None) if len(seq.token_ids) >= self.max_model_len else (None, None)
        if seq.stops is not None and new_chars:
            found = seq.stops.find(seq.detokenizer.text, new_chars)
            if found is not None:
                start, seq.stop_reason = found
                return "stop", start + len(found[1]) if p.include_stop_str_in_output else start
        stop_token = token in seq.stop_ids
        if stop_token or (token in self.eos_token_ids and not p.ignore_eos):
            seq.stop_reason = token if stop_token else None
            if p.include_stop_str_in_output or seq.detokenizer is None:
                return "stop", None
            return "stop", len(seq.detokenizer.text) - new_chars
        if seq.matcher is not None and seq.matcher.done:
            return "stop", None
        if len(seq.output_token_ids) >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length", None
        return None, None

    def _output(self, seq: Sequence, cut: int | None) -> RequestOutput:
        """A snapshot of `seq`. Its text stops short of any stop string, and while the request runs it
        also holds back the characters that could still begin one, so streamed text is never retracted."""
        text = seq.detokenizer.text if seq.detokenizer is not None else ""
        if cut is not None:
            text = text[:cut]
        elif seq.finish_reason is None and seq.stops is not None:
            text = text[: max(len(text) - seq.stops.longest + 1, 0)]
        want = seq.params.logprobs is not None
        finished = seq.finish_reason is not None
        return RequestOutput(
            request_id=seq.request_id,
            prompt=self._prompts.pop(seq.request_id) if finished else self._prompts[seq.request_id],
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids),
            text=text,
            logprobs=list(seq.logprobs) if want else None,
            top_logprobs=list(seq.top_logprobs) if want and seq.params.logprobs else None,
            finish_reason=seq.finish_reason,
            prompt_logprobs=list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None,
            prompt_top_logprobs=list(seq.prompt_top_logprobs) if seq.params.prompt_logprobs else None,
            prompt_ranks=list(seq.prompt_ranks) if seq.params.prompt_logprobs is not None else None,
            stop_reason=seq.stop_reason,
        )


def _pool(seq: Sequence, hidden: torch.Tensor) -> None:
    """Fold the final hidden states of the prompt tokens `seq` ran this step into its embedding: their
    sum for mean pooling (restarted when a preempted sequence runs its prompt again), the last row for last."""
    if seq.params.pooling == "last":
        seq.pooled = hidden[-1]
    else:
        total = hidden.sum(0)
        seq.pooled = total if seq.num_computed == 0 or seq.pooled is None else seq.pooled + total


def plain_greedy(p: SamplingParams) -> bool:
    """Whether a request's next token is the argmax of the raw logits, which it then need not see:
    greedy, no logprobs, nothing adjusting the logits (a grammar is checked apart)."""
    return p.temperature < GREEDY_BELOW and p.logprobs is None and not needs_adjusting(p)


def _min_over_ranks(n: int, device: torch.device) -> int:
    import torch.distributed as dist

    if not dist.is_initialized():  # a sharded model built without its group (tests): nothing to agree with
        return n
    value = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return int(value.item())
