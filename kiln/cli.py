"""The `kiln` command. Subcommands import their heavy dependencies only when run, so --help is fast."""

import argparse
import errno
import json
import logging
import sys
from pathlib import Path

from kiln.argtypes import at_least, fraction, not_negative, positive, units
from kiln.config import DTYPES, KV_CACHE_DTYPES, LM_HEAD_QUANTIZATIONS, NO_QUANTIZATION, QUANTIZATIONS
from kiln.errors import KilnError

DTYPE_CHOICES = ["auto", *DTYPES]

logger = logging.getLogger("kiln.cli")


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts like 1,2,4,8, got {text!r}") from None
    return sizes  # CompileConfig checks the range


def _compile_config(args: argparse.Namespace):
    from kiln.config import CompileConfig, PassConfig

    passes = PassConfig(**{name.replace("-", "_"): False for name in args.disable_pass or []})
    return CompileConfig(max_num_tokens=args.max_num_tokens, sizes=args.sizes, range_splits=args.range_splits,
                         passes=passes)


def _custom_passes(args: argparse.Namespace) -> list:
    from kiln.passes import load_pass

    return [load_pass(spec) for spec in args.passes or []]


def _shaped_model(args: argparse.Namespace):
    """The model `args` name, with uninitialized weights: compiling and keys need shapes and dtypes only."""

    from kiln.config import ParallelConfig, parse_device, parse_dtype, parse_kv_cache_dtype
    from kiln.models.config import ModelConfig
    from kiln.models.quantization import check_int4_placement
    from kiln.models.registry import create_model
    from kiln.models.quantization import stored_or
    from kiln.weights.model_weights import ModelWeights

    # every rank compiles to the same graph, so rank 0's serves them all
    parallel = ParallelConfig(rank=0, world_size=args.tensor_parallel_size)
    model_dir = ModelWeights.directory(args.model_dir, _cache_dir(args))
    config = ModelConfig.from_model_dir(model_dir)
    args.quantization = stored_or(args.quantization, ModelWeights(model_dir))  # as LLM chooses it
    device = parse_device(args.device)
    held = getattr(config.quantization, "scheme", None)
    check_int4_placement(args.quantization or held, device)
    # quantized layers built empty, as a load fills them: an 8B model's full-precision weights never exist here
    model = create_model(config, parse_dtype(config.resolve_dtype(args.dtype)), device, parallel=parallel,
                         quantize=args.quantization)
    if args.lm_head_quantization:  # the artifact ships the int8 head's kernel, and the key says so
        from kiln.models.lm_head import quantize_lm_head

        quantize_lm_head(model, args.lm_head_quantization, pack=False)
    model.kv_cache_dtype = parse_kv_cache_dtype(args.kv_cache_dtype, device)  # the cache write's dtype: a key factor
    return model


def _cache_dir(args: argparse.Namespace):
    from pathlib import Path

    from kiln.config import default_cache_dir

    return Path(args.cache_dir or default_cache_dir())


def _cmd_compile(args: argparse.Namespace) -> None:
    import time
    from pathlib import Path

    from kiln.compiler.compile import build_artifact
    from kiln.threads import describe, use_threads
    from kiln.weights.model_weights import ModelWeights

    start = time.perf_counter()
    model = _shaped_model(args)
    if model.cos_sin_cache.device.type == "cpu":  # the kernel choices are timed on these threads
        _say(describe(use_threads(args.threads), args.threads is not None))
    result = build_artifact(
        model,
        _compile_config(args),
        _cache_dir(args),
        dump_dir=Path(args.dump_dir) if args.dump_dir else None,
        progress=False if args.quiet else None,  # None: a bar on terminals only
        force=args.force,
        passes=_custom_passes(args),
        model_name=Path(args.model_dir).resolve().name,
        weight_types=ModelWeights(ModelWeights.directory(args.model_dir, _cache_dir(args))).stored_types(),
    )
    if result.reused:
        print(f"artifact already present and valid (checked in {time.perf_counter() - start:.2f}s)")
    else:
        print(f"{'stage':<10}{'seconds':>10}")
        for stage, seconds in result.timings.items():
            print(f"{stage:<10}{seconds:>10.2f}")
        print(f"{'total':<10}{time.perf_counter() - start:>10.2f}\n")
    _print_matches(result.pass_matches)
    print(result.path)


def _print_matches(by_variant: dict[str, dict[str, int | None]]) -> None:
    """One column of match counts per variant (headed by its token counts when there are several);
    "-" for a pass that does not apply to that variant's sizes."""
    names = list(dict.fromkeys(name for matches in by_variant.values() for name in matches))
    heads = ["matches"] if len(by_variant) == 1 else [f"tokens {label}" for label in by_variant]
    width = max(len(name) for name in [*names, "pass"]) + 2
    cols = [max(8, len(h) + 2) for h in heads]
    print(f"{'pass':<{width}}" + "".join(f"{h:>{c}}" for h, c in zip(heads, cols)))
    for name in names:
        cells = [matches.get(name) for matches in by_variant.values()]
        print(f"{name:<{width}}" + "".join(f"{'-' if m is None else m:>{c}}" for m, c in zip(cells, cols)))


def _say(line: str) -> None:
    """A start-up fact worth a line at any verbosity (logs show only warnings by default)."""
    print(f"kiln: {line}", file=sys.stderr, flush=True)


def _llm(args: argparse.Namespace, compile: bool, **options):
    """The LLM that `generate` and `serve` run, from the model and compile options they share."""
    from kiln import LLM
    from kiln.threads import describe

    llm = LLM(
        args.model_dir,
        dtype=args.dtype,
        device=args.device,
        compile=compile or args.require_artifact,
        cache_dir=args.cache_dir,
        require_artifact=args.require_artifact,
        compile_config=_compile_config(args),
        quantization=args.quantization,
        passes=_custom_passes(args),
        max_num_batched_tokens=args.max_num_tokens,
        tensor_parallel_size=args.tensor_parallel_size,
        cudagraph_sizes=() if args.no_cudagraphs else args.cudagraph_sizes,
        threads=args.threads,
        lm_head_quantization=args.lm_head_quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_memory_bytes=args.kv_cache_memory,
        max_model_len=args.max_model_len,
        memory_utilization=args.memory_utilization,
        **options,
    )
    if llm.parallel.rank == 0:
        _say(llm.dtype_note)
        if llm.threads:
            _say(describe(llm.threads, args.threads is not None))
    return llm


def _as_ranks(args: argparse.Namespace) -> None:
    """With --tensor-parallel-size N outside torchrun, run this same command as N ranks under
    torchrun: this process becomes the launcher (exec), so a signal sent to it (SIGTERM from a
    service manager) reaches torchrun, which stops the ranks, instead of orphaning them."""
    import os

    if args.tensor_parallel_size == 1 or "WORLD_SIZE" in os.environ:
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(args.tensor_parallel_size), "-m", "kiln.cli", *args.argv]
    logger.info("starting %d ranks: %s", args.tensor_parallel_size, " ".join(cmd))
    for handler in logging.getLogger().handlers + logging.getLogger("kiln").handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, cmd)


def _cmd_generate(args: argparse.Namespace) -> None:
    from kiln import SamplingParams

    structured = None
    if args.json_schema is not None:
        from kiln.runtime.structured_output import StructuredOutput

        try:
            structured = StructuredOutput.json_schema(json.loads(Path(args.json_schema).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise KilnError(f"--json-schema {args.json_schema}: {e}") from None
    _as_ranks(args)
    llm = _llm(args, args.compile, seed=args.seed)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop or [],
        structured_output=structured,
    )
    outputs = llm.generate(args.prompt, params)
    if llm.parallel.rank != 0:  # every rank has the same outputs: one prints them
        return
    for out in outputs:
        if structured is not None:
            print(out.text)  # one document per line, for a pipe
        else:
            print(out.prompt + out.text if len(args.prompt) == 1 else f"[{out.prompt!r}] {out.text}")


def _cmd_demo_model(args: argparse.Namespace) -> None:
    from kiln.models.demo import write_demo_model

    out = write_demo_model(args.out_dir, arch=args.arch, num_layers=args.num_layers, seed=args.seed,
                           train_steps=args.train_steps)
    print(out)


def _add_compile_options(parser: argparse.ArgumentParser, cache_dir: bool = True) -> None:
    import dataclasses

    from kiln.config import PassConfig

    pass_names = [f.name.replace("_", "-") for f in dataclasses.fields(PassConfig) if f.type in (bool, "bool")]
    if cache_dir:
        parser.add_argument("--cache-dir", metavar="DIR", help="artifact cache (default $KILN_CACHE, else "
                            "~/.cache/kiln); on a CPU, loads also keep each checkpoint's packed weights in DIR/packed "
                            "for faster later loads ($KILN_PACK_CACHE moves them; 'off' disables)")
    parser.add_argument("--device", default="auto", metavar="auto|cpu|cuda|cuda:N", help="where the model runs, "
                        "and so what the artifact is compiled for (default auto: cuda where a GPU is visible, "
                        "else cpu)")
    parser.add_argument("--max-num-tokens", type=int, default=2048, metavar="N", help="largest batch in tokens "
                        "the compiled pieces serve (default 2048)")
    parser.add_argument("--quantization", choices=(*QUANTIZATIONS, NO_QUANTIZATION), help="W8A8: weights per "
                        "channel, activations per token, or for int8 on a CPU per token and block of 32, as llama.cpp's "
                        "Q8_0's activations (default: none; a quantized GGUF file runs in the scheme nearest its types, "
                        "its Q4_0/Q4_1/Q4_K or Q8_0/Q5_0 codes as stored, unless given none). w7a8 is int8 with 7-bit "
                        "weight codes and per-token activations (fbgemm runs it unsplit on x86 CPUs without VNNI). "
                        "int4 is W4A8: 4-bit weights with a scale and a minimum per 32, int8 activations with a "
                        "scale per 32; q8_0 is llama.cpp's Q8_0: int8 weights with a scale per 32, activations per 32 "
                        "(both CPU only; AVX2 or AVX-512 runs them on kiln's own kernels)")
    parser.add_argument("--lm-head-quantization", choices=LM_HEAD_QUANTIZATIONS, help="run the LM head on int8 "
                        "weights (per channel) and activations (per 32 where the artifact ships kiln's blocked int8 "
                        "GEMM, else per token): a quarter of fp32's bytes, for large "
                        "vocabularies (w7a8: 7-bit weight codes, faster on x86 CPUs without VNNI); "
                        "benchmarks/quantization.py reports its effect on greedy outputs (default: the model dtype)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="how the KV cache stores "
                        "keys and values: auto, the model's dtype; int8, int8 codes with an fp32 scale per token and KV "
                        "head (CPU only): about a quarter of fp32's bytes, so four times the tokens in the same "
                        "--kv-cache-memory and less to read at depth (the compiled cache write quantizes, so it is "
                        "part of the artifact)")
    parser.add_argument("--tensor-parallel-size", type=at_least(1), default=1, metavar="N", help="split the model "
                        "over N ranks (gloo on CPU, NCCL on CUDA). compile builds the one artifact all N ranks load; "
                        "generate and serve start the ranks under torchrun unless already run by it (default 1)")
    parser.add_argument("--sizes", type=_sizes, default=(), metavar="N,N,...", help="token counts that also get "
                        "a static-shape compile, e.g. 1,2,4,8 (default: none)")
    parser.add_argument("--range-splits", type=_sizes, default=(), metavar="N,N,...", help="cut the dynamic "
                        "token range after these counts, e.g. 64 gives 1-64 and 65-max, for passes that apply "
                        "to some sizes only (default: one range)")
    parser.add_argument("--pass", dest="passes", action="append", metavar="MODULE:NAME", help="add your own "
                        "graph pass (a kiln.passes.GraphPass subclass), run after kiln's fusions; repeatable")
    parser.add_argument("--disable-pass", action="append", choices=pass_names, metavar="NAME",
                        help=f"turn off one of kiln's passes ({', '.join(pass_names)}); repeatable")


def _add_threads_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=at_least(1), metavar="N", help="CPU threads for the kernels (and, when "
                        "compiling, for timing the kernel choices): default the machine's physical cores")


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    from kiln.units import parse_size
    from kiln.config import EngineConfig

    parser.add_argument("--max-model-len", type=at_least(2), metavar="N", help="prompt + generated tokens per "
                        "request (default: the model's max_position_embeddings, capped to what the KV cache holds)")


    parser.add_argument("--kv-cache-memory", type=units(parse_size), metavar="SIZE", help="memory for the paged "
                        "KV cache, e.g. 8G (default: --memory-utilization of the memory left after the weights); "
                        "it never exceeds max-num-seqs full sequences")
    parser.add_argument("--memory-utilization", type=fraction, default=EngineConfig.memory_utilization,
                        metavar="F", help="share of the memory available after loading the weights that the KV "
                        f"cache and activations may take (default {EngineConfig.memory_utilization})")
    parser.add_argument("--cudagraph-sizes", type=_sizes, default=None, metavar="N,N,...", help="token counts to "
                        "pad batches to and capture piecewise CUDA graphs at, at start-up (default on CUDA: 1,2,4,8,"
                        "16,... up to max-num-seqs; on CPU none: there are no graphs, padding only costs)")
    parser.add_argument("--no-cudagraphs", action="store_true", help="run the compiled pieces without CUDA graphs "
                        "or padding")


def _cmd_serve(args: argparse.Namespace) -> None:
    from kiln.server.app import serve, warm_up

    config = _server_config(args)
    _as_ranks(args)
    llm = _llm(args, args.artifact != "eager", artifact=None if args.artifact in ("auto", "eager") else args.artifact,
               max_num_seqs=args.max_num_seqs,
               enable_prefix_caching=args.enable_prefix_caching)
    feed = None
    if llm.parallel.world_size > 1:  # rank 0 serves; the others step with it
        from kiln.runtime.lockstep import StepFeed, control_group, follow

        group = control_group()
        if llm.parallel.rank != 0:
            warm_up(llm)
            follow(llm.engine, group)
            return
        feed = StepFeed(group)
    serve(llm, config, args.served_model_name, feed=feed)


def _server_config(args: argparse.Namespace):
    """The listening, limits, auth and TLS options, checked before the model loads."""
    import os

    from kiln.config import ServerConfig

    for name in ("ssl_keyfile", "ssl_certfile"):
        path = getattr(args, name)
        if path is not None and not Path(path).is_file():
            raise KilnError(f"--{name.replace('_', '-')} {path}: no such file")
    return ServerConfig(
        host=args.host, port=args.port, max_queued_requests=args.max_queued_requests,
        request_timeout=args.request_timeout, shutdown_timeout=args.shutdown_timeout, api_key=args.api_key or os.environ.get("KILN_API_KEY") or None,
        api_key_scope=args.api_key_scope, auth_exempt=tuple(args.auth_exempt or ()), ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile, ssl_ciphers=args.ssl_ciphers, allowed_origins=tuple(args.allowed_origins or ()),
        pooling=args.pooling, reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        **{name: getattr(args, name) for name, _, _ in _REQUEST_LIMITS})


_REQUEST_LIMITS = [  # (ServerConfig field, argument type, what it bounds): one --flag each
    ("max_request_bytes", "size", "largest request body, e.g. 4M; larger is answered 413 before it is read"),
    ("header_timeout", positive, "seconds a connection may take to send a request's headers; then it is closed"),
    ("body_timeout", positive, "seconds a request's body may take to arrive; then 408"),
    ("keep_alive_timeout", positive, "seconds an idle keep-alive connection stays open"),
    ("max_logit_bias", at_least(1), "most logit_bias entries per request"),
    ("max_stop_strings", at_least(1), "most stop strings per request"),
    ("max_stop_length", at_least(1), "longest stop string, in characters"),
    ("max_choices", at_least(1), "most options in a choice constraint (llguidance gives up near 2000)"),
    ("max_grammar_bytes", "size", "largest JSON schema, regex, grammar or set of choices, e.g. 64K"),
    ("max_stored_responses", at_least(0), "/v1/responses kept in memory for previous_response_id (64 MiB of "
     "conversation at most)"),
]


def _cmd_cache(args: argparse.Namespace) -> int:
    from kiln.cache_tools import commands

    cache, as_json = _cache_dir(args), args.json
    match args.cache_command:
        case "ls":
            return commands.ls(cache, as_json)
        case "info":
            return commands.info(cache, args.key, as_json)
        case "verify":
            return commands.verify(cache, args.keys, as_json)
        case "explain":
            if args.model_dir:
                if args.keys:
                    raise KilnError("give two keys or --model DIR, not both")
                from kiln.compiler.key import cache_key, model_factors

                factors = model_factors(_shaped_model(args), _compile_config(args), _custom_passes(args))
                return commands.explain_model(cache, factors, cache_key(factors), args.model_dir, as_json)
            if len(args.keys) != 2:
                raise KilnError("explain needs two keys (KEY_A KEY_B) or --model DIR")
            return commands.explain_keys(cache, *args.keys, as_json)
        case "prune":
            if args.older_than is None and args.max_size is None:
                raise KilnError("prune needs --older-than AGE, --max-size SIZE or both")
            return commands.prune_cache(cache, args.older_than, args.max_size, args.dry_run, as_json)
        case "export":
            return commands.export(cache, args.key, args.output, as_json, args.sha256)
        case "import":
            return commands.import_(cache, args.tarball, as_json, args.sha256, args.max_size)
        case "dump":
            return commands.dump_artifact(cache, args.key, args.output, as_json)
    raise AssertionError(args.cache_command)


def _add_cache_parser(sub) -> None:
    from kiln.units import parse_age, parse_size

    cache = sub.add_parser("cache", help="list, check, explain, prune, move and read cached artifacts",
                           description="Inspect and manage the artifact cache ($KILN_CACHE, else ~/.cache/kiln). "
                           "KEY is a full key, a unique prefix of one (as `kiln cache ls` shows) or an artifact "
                           "directory.")
    cmds = cache.add_subparsers(dest="cache_command", required=True, metavar="SUBCOMMAND")

    def command(name: str, help: str, description: str) -> argparse.ArgumentParser:
        p = cmds.add_parser(name, help=help, description=description)
        p.add_argument("--cache-dir", metavar="DIR", help="artifact cache (default $KILN_CACHE, else ~/.cache/kiln)")
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")
        p.set_defaults(func=_cmd_cache)
        return p

    command("ls", "list artifacts", "One line per artifact: key, model, dtype, size, created, last used, torch "
            "version and CPU ISA (or GPU arch), newest first.")
    p = command("info", "show one artifact", "The artifact's model, compile options and build, then per variant "
                "its pieces (with their blobs), the passes' match counts, and the compile stage timings.")
    p.add_argument("key", metavar="KEY")
    p = command("verify", "re-hash every file of artifacts", "Check each file's size and sha256 against the "
                "manifest, and the key against the manifest's factors. Exits 1 if any artifact is corrupt, naming "
                "each bad file; an intact artifact built for another machine is reported, not failed.")
    p.add_argument("keys", nargs="*", metavar="KEY", help="artifacts to check (default: all)")
    p = command("explain", "why two keys differ, or why a model misses the cache", "Compare the key factors of "
                "two artifacts (KEY_A KEY_B), or of a model directory compiled with the given options (--model "
                "DIR) against the nearest artifact in the cache.")
    p.add_argument("keys", nargs="*", metavar="KEY")
    p.add_argument("--model", dest="model_dir", metavar="DIR", help="the model directory whose key to explain")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="with --model: "
                   "the dtype (default auto: the checkpoint's)")
    _add_compile_options(p, cache_dir=False)
    p = command("prune", "delete old or least recently used artifacts", "Delete artifacts last used (or made) "
                "longer ago than --older-than, then the least recently used ones while the cache is larger than "
                "--max-size. An artifact being compiled or loaded by a running process is never deleted.")
    p.add_argument("--older-than", type=units(parse_age), metavar="AGE", help="e.g. 12h, 7d, 2w")
    p.add_argument("--max-size", type=units(parse_size), metavar="SIZE", help="e.g. 500M, 10G")
    p.add_argument("-n", "--dry-run", action="store_true", help="show what would be deleted; delete nothing")
    p = command("export", "write an artifact to a .tar.gz", "Verify an artifact and write it as one tarball, to "
                "import on another machine with the same torch and CPU (compile in CI, serve elsewhere).")
    p.add_argument("key", metavar="KEY")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="the tarball to write (.tar.gz)")
    p.add_argument("--sha256", action="store_true", help="also write FILE.sha256 (sha256sum's format), for "
                   "`import --sha256` on the other end")
    p = command("import", "add an exported artifact to the cache", "Unpack a tarball from `kiln cache export`, "
                "verify every file and that it loads on this machine, then move it into the cache in one step. "
                "An artifact is code: serving it runs its programs/*.py and loads its shared libraries, so "
                "import only tarballs you trust, checked with --sha256. Tarballs with links, paths outside "
                "the artifact's directory, or files its manifest does not list or pins at another size are "
                "refused before anything is unpacked.")
    p.add_argument("tarball", metavar="FILE")
    p.add_argument("--sha256", metavar="HEX|FILE", help="refuse the tarball unless its sha256 is this (64 hex "
                   "digits, or the .sha256 file `export --sha256` wrote)")
    p.add_argument("--max-size", type=units(parse_size), metavar="SIZE", help="refuse the tarball if its files "
                   "add up to more than this, e.g. 500M (default: 4 times what its manifest declares)")
    p = command("dump", "write an artifact as readable code", "Write the manifest, the stitching programs, "
                "Dynamo's depyf-decompiled bytecode and graph, the graphs before and after the passes, every "
                "piece's graph and Inductor's generated code for each compiled piece.")
    p.add_argument("key", metavar="KEY")
    p.add_argument("-o", "--output", metavar="DIR", help="directory to create (default ./kiln-dump-<key>)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kiln", description="kiln: compile Hugging Face decoder models ahead of time and run them."
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="-v for INFO logs, -vv for DEBUG")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate_parser(sub)
    _add_compile_parser(sub)
    _add_serve_parser(sub)
    _add_demo_parser(sub)
    _add_cache_parser(sub)
    _add_bench_parser(sub)
    return parser


def _add_generate_parser(sub) -> None:
    gen = sub.add_parser("generate", help="generate text from prompts (eager)", description="Generate text from "
                         "one or more prompts and print it. Greedy unless --temperature is set.")
    gen.add_argument("model_dir", metavar="MODEL", help="Hugging Face model directory (config.json, "
                     "*.safetensors, tokenizer.json) or a .gguf file")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens (-1: all)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    gen.add_argument("--stop", action="append", help="stop string; repeat for several")
    gen.add_argument("--json-schema", metavar="FILE", help="constrain each output to this JSON schema (a file); "
                     "only the JSON is printed, one document per prompt")
    gen.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="weights and "
                     "activations dtype (default auto: the checkpoint's, config.json's torch_dtype)")
    gen.add_argument("--compile", action="store_true", help="run the compiled artifact (compiling it first if "
                     "it is absent or unusable)")
    gen.add_argument("--require-artifact", action="store_true", help="run the compiled artifact and fail if it is "
                     "absent or unusable instead of compiling (implies --compile)")
    _add_compile_options(gen)
    _add_threads_option(gen)
    _add_engine_options(gen)
    gen.set_defaults(func=_cmd_generate)


def _add_compile_parser(sub) -> None:
    comp = sub.add_parser("compile", help="trace and compile a model into a cached artifact",
                          description="Trace the model's decoder once, split it at attention, compile each unique "
                          "piece with AOTInductor and save one artifact (program, compiled piece libraries) "
                          "under the cache directory. Prints a table of stage timings and the artifact path. "
                          "An artifact already present and valid is reused; so is any piece already compiled "
                          "for another artifact ($KILN_PIECE_CACHE, default CACHE_DIR/pieces; 'off' disables). "
                          "Unique pieces compile side by side in $KILN_COMPILE_WORKERS forked processes "
                          "(default: one per core; CPU only).")
    comp.add_argument("model_dir", metavar="MODEL", help="Hugging Face model directory (config.json, "
                      "*.safetensors) or a .gguf file; only its config is read")
    comp.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="weights and "
                      "activations dtype (default auto: the checkpoint's, config.json's torch_dtype)")
    _add_compile_options(comp)
    _add_threads_option(comp)
    comp.add_argument("--dump-dir", metavar="DIR", help="write depyf's decompiled bytecode and the graphs before "
                      "and after splitting here")
    comp.add_argument("--force", action="store_true", help="compile even if a valid artifact is present, every piece afresh "
                      "(compiled pieces kept for reuse are not read)")
    comp.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    comp.set_defaults(func=_cmd_compile)


def _add_serve_parser(sub) -> None:
    from kiln.config import ServerConfig
    from kiln.units import parse_size

    srv = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API", description="Load the model and its "
                         "compiled artifact (compiling it first if absent, unless --require-artifact) and serve "
                         "/v1/completions, /v1/chat/completions, /v1/models, /health and /metrics with continuous "
                         "batching. Logs each start-up stage with -v.")
    srv.add_argument("model_dir", metavar="MODEL", help="Hugging Face model directory (config.json, "
                     "*.safetensors, tokenizer.json) or a .gguf file")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    srv.add_argument("--artifact", default="auto", metavar="auto|eager|PATH", help="auto: the cached artifact "
                     "for this model and options (default); eager: no compiled artifact; PATH: that artifact")
    srv.add_argument("--require-artifact", action="store_true", help="fail if the artifact is absent or unusable "
                     "instead of compiling")
    srv.add_argument("--served-model-name", metavar="NAME", help="the model name clients send (default: the "
                     "model directory's name)")
    srv.add_argument("--max-num-seqs", type=at_least(1), default=64, metavar="N", help="requests running at "
                     "once; more wait (default 64)")
    srv.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                     help="reuse the KV blocks of prompt prefixes seen before (default on)")
    srv.add_argument("--reasoning-parser", choices=["deepseek_r1", "qwen3"], help="tell a reasoning model's "
                     "thinking (before </think>) from its answer: chat gives it as reasoning_content (vLLM's parsers; "
                     "default: none, the thinking stays in the content)")
    srv.add_argument("--tool-call-parser", choices=["hermes", "llama3_json", "mistral", "qwen3"],
                     default=ServerConfig.tool_call_parser, help="the format the model writes tool calls in "
                     "(vLLM's names): hermes <tool_call> JSON blocks (Qwen2.5, Hermes); qwen3 those or Qwen3-Coder's "
                     "<function=...> XML in them; llama3_json Llama 3.x JSON; mistral [TOOL_CALLS] (default "
                     "%(default)s)")
    srv.add_argument("--pooling", choices=["last", "mean"], default=ServerConfig.pooling, help="/v1/embeddings: "
                     "pool a prompt's final hidden states at its last token (vLLM's default for decoder models) or "
                     "by their mean; L2-normalized (default %(default)s)")
    srv.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help="weights and "
                     "activations dtype (default auto: the checkpoint's, config.json's torch_dtype)")
    limits = srv.add_argument_group("limits")
    limits.add_argument("--max-queued-requests", type=at_least(0), default=ServerConfig.max_queued_requests,
                        metavar="N", help="sequences waiting beyond the max-num-seqs running; past it a request is "
                        f"answered 503 with Retry-After (default {ServerConfig.max_queued_requests})")
    limits.add_argument("--request-timeout", type=positive, metavar="SECONDS", help="abort a request this "
                        "long after it arrived, queueing included, and answer 408 (default: no limit)")
    limits.add_argument("--shutdown-timeout", type=not_negative, default=ServerConfig.shutdown_timeout,
                        metavar="SECONDS", help="on SIGTERM or SIGINT, admit no more requests (503, /health 503) and "
                        "let those running finish for this long; then end the rest with an error and exit 0. A "
                        f"second signal exits at once (default {ServerConfig.shutdown_timeout:g})")
    for name, kind, says in _REQUEST_LIMITS:  # each a 400 (413, 408) naming its flag when a request passes it
        default = getattr(ServerConfig, name)
        metavar = "SIZE" if kind == "size" else "SECONDS" if name.endswith("timeout") else "N"
        limits.add_argument("--" + name.replace("_", "-"), type=units(parse_size) if kind == "size" else kind,
                            default=default, metavar=metavar, help=f"{says} (default {default if isinstance(default, int) else f'{default:g}'})")
    security = srv.add_argument_group("security")
    security.add_argument("--api-key", metavar="KEY", help="require `Authorization: Bearer KEY` (else 401) on the "
                          "paths --api-key-scope names; default $KILN_API_KEY, else none")
    security.add_argument("--api-key-scope", choices=["v1", "all"], default=ServerConfig.api_key_scope,
                          help="v1: the API under /v1/ needs the key, as in vLLM (/health, /metrics, /docs, "
                          "/openapi.json, /tokenize, /version stay open); all: every path but --auth-exempt ones "
                          "(default %(default)s)")
    security.add_argument("--auth-exempt", action="append", choices=["/health", "/metrics"], metavar="PATH",
                          help="with --api-key-scope all: serve /health or /metrics without the key (for probes "
                          "and scrapers); repeatable")
    security.add_argument("--ssl-keyfile", metavar="FILE", help="serve HTTPS with this private key (PEM)")
    security.add_argument("--ssl-certfile", metavar="FILE", help="... and this certificate chain (PEM)")
    security.add_argument("--ssl-ciphers", metavar="LIST", help="OpenSSL cipher list for TLS 1.2 (default: "
                          "Python's ssl defaults: forward-secret AEAD suites, no SHA-1)")
    security.add_argument("--allowed-origins", nargs="+", metavar="ORIGIN", help="browser origins allowed by "
                          "CORS, e.g. https://app.example.com, or * (default: none)")
    _add_compile_options(srv)
    _add_threads_option(srv)
    _add_engine_options(srv)
    srv.set_defaults(func=_cmd_serve)


def _add_demo_parser(sub) -> None:
    from kiln.models.demo import DEMO_ARCHS, MOE_DEMO_ARCHS, TRAIN_STEPS

    demo = sub.add_parser("demo-model", help="write a tiny model kiln can run (nothing is downloaded)",
                          description="Write a tiny Hugging Face-format model and a byte-level BPE tokenizer, "
                          "both trained on a short text shipped with kiln (training takes seconds on 2 cores; "
                          "--train-steps 0 keeps the random weights).")
    demo.add_argument("out_dir", metavar="OUT_DIR")
    demo.add_argument("--arch", default="llama", choices=DEMO_ARCHS + MOE_DEMO_ARCHS, help="architecture (default "
                      "llama; qwen3_moe and mixtral are mixture-of-experts)")
    demo.add_argument("--num-layers", type=at_least(1), default=4, metavar="N", help="decoder layers (default 4)")
    demo.add_argument("--seed", type=int, default=0, help="weight init and training seed (default 0)")
    demo.add_argument("--train-steps", type=at_least(0), default=TRAIN_STEPS, metavar="N",
                      help=f"training steps on the shipped text (default {TRAIN_STEPS}; 0: random weights)")
    demo.set_defaults(func=_cmd_demo_model)


def _add_bench_parser(sub) -> None:
    from kiln.bench import decode, startup

    bench = sub.add_parser("bench", help="benchmark kiln on a model directory (JSON on stdout)",
                           description="Benchmarks of kiln on a model directory; each prints one JSON object.")
    benches = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    st = benches.add_parser("startup", help="cold and warm compile, artifact and eager first token, each in fresh "
                            "processes", description=startup.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    startup.add_arguments(st)
    st.set_defaults(func=startup.run)
    dec = benches.add_parser("decode", help="decode ms/token per batch size, against the memory-bandwidth floor",
                             description=decode.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    decode.add_arguments(dec)
    dec.set_defaults(func=decode.run)


UNUSABLE_PATH = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EEXIST, errno.ELOOP, errno.EISDIR)
"""OSErrors that say a path cannot be used as it is (read-only, not a directory, a link loop): a one-line error
naming the path, not a traceback."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # what _as_ranks runs again as each rank
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("kiln").setLevel(level)
    try:
        return args.func(args) or 0
    except KilnError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        if e.errno in UNUSABLE_PATH:
            where = f" {e.filename}" if e.filename else " a path"
            print(f"kiln: error: cannot use{where}: {e.strerror}. Check that path (a cache must be a writable "
                  "directory: --cache-dir, $KILN_CACHE)", file=sys.stderr)
            return 1
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = f" writing {e.filename}" if e.filename else ""
        print(f"kiln: error: no space left on the device{where} ({e.strerror}): free some space, or put the cache "
              "elsewhere (--cache-dir, $KILN_CACHE); what was being written was removed", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kiln: interrupted: what was being written was removed (a finished artifact or packed-weights file "
              "stays)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
