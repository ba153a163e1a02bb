"""`LLM`: offline batch generation, the Python entry point most users start from."""

import logging
import time
from pathlib import Path

from kiln.config import EngineConfig, parse_dtype
from kiln.errors import KilnError
from kiln.models.config import ModelConfig
from kiln.models.loader import load_weights
from kiln.models.registry import create_model
from kiln.runtime.engine import Engine, RequestOutput
from kiln.runtime.sampler import SamplingParams
from kiln.runtime.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class LLM:
    """Load a Hugging Face-format decoder and generate from batches of prompts.

    `compile=True` traces and compiles the backbone with kiln's compiler in this process (the saved,
    load-without-compiling artifact is not wired in yet).

    >>> llm = LLM("path/to/model")
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))[0].text
    """

    def __init__(
        self,
        model: str | Path,
        dtype: str = "float32",
        compile: bool = False,
        seed: int = 0,
        device: str = "cpu",
        **engine_options,
    ):
        start = time.perf_counter()
        model_dir = Path(model)
        if not model_dir.is_dir():
            raise KilnError(f"model directory {model_dir} does not exist")
        self.model_config = ModelConfig.from_model_dir(model_dir)
        self.model = create_model(self.model_config, parse_dtype(dtype), device)
        load_weights(self.model, model_dir)
        self.tokenizer = Tokenizer(model_dir) if (model_dir / "tokenizer.json").is_file() else None
        forward = None
        if compile:
            from kiln.compiler.compile import compile_backbone

            forward = compile_backbone(self.model)
        self.engine = Engine(self.model, EngineConfig(**engine_options), self.tokenizer, seed=seed, forward=forward)
        logger.info("ready in %.2fs", time.perf_counter() - start)

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion in continuous batches; results come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise KilnError(f"{len(prompts)} prompts but {len(params)} sampling params")
        order = {}
        for prompt, p in zip(prompts, params):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise KilnError("this model directory has no tokenizer.json: pass token ids instead of text")
                rid = self.engine.add_request(self.tokenizer.encode(prompt), p, prompt=prompt)
            else:
                rid = self.engine.add_request(list(prompt), p)
            order[rid] = len(order)
        results: list[RequestOutput | None] = [None] * len(order)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                results[order[out.request_id]] = out
        return results
