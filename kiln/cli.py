"""The `kiln` command. Subcommands import their heavy dependencies only when run, so --help is fast."""

import argparse
import logging
import sys

from kiln.errors import KilnError


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts like 1,2,4,8, got {text!r}") from None
    return sizes  # CompileConfig checks the range


def _at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def _compile_config(args: argparse.Namespace):
    from kiln.config import CompileConfig, PassConfig

    passes = PassConfig(**{name.replace("-", "_"): False for name in args.disable_pass or []})
    return CompileConfig(max_num_tokens=args.max_num_tokens, sizes=args.sizes, range_splits=args.range_splits,
                         passes=passes)


def _custom_passes(args: argparse.Namespace) -> list:
    from kiln.passes import load_pass

    return [load_pass(spec) for spec in args.passes or []]


def _cmd_compile(args: argparse.Namespace) -> None:
    import time
    from pathlib import Path

    from kiln.compiler.compile import build_artifact
    from kiln.config import default_cache_dir, parse_dtype
    from kiln.models.config import ModelConfig
    from kiln.models.registry import create_model

    start = time.perf_counter()
    if not Path(args.model_dir).is_dir():
        raise KilnError(f"model directory {args.model_dir} does not exist")
    # Compiling needs shapes and dtypes only: the weights stay uninitialized and are never read.
    model = create_model(ModelConfig.from_model_dir(Path(args.model_dir)), parse_dtype(args.dtype))
    if args.quantization:
        from kiln.models.quantization import quantize_model

        quantize_model(model, args.quantization)
    result = build_artifact(
        model,
        _compile_config(args),
        Path(args.cache_dir or default_cache_dir()),
        dump_dir=Path(args.dump_dir) if args.dump_dir else None,
        progress=False if args.quiet else None,  # None: a bar on terminals only
        force=args.force,
        passes=_custom_passes(args),
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


def _llm(args: argparse.Namespace, compile: bool, **options):
    """The LLM that `generate` and `serve` run, from the model and compile options they share."""
    from kiln import LLM

    return LLM(
        args.model_dir,
        dtype=args.dtype,
        compile=compile or args.require_artifact,
        cache_dir=args.cache_dir,
        require_artifact=args.require_artifact,
        compile_config=_compile_config(args),
        quantization=args.quantization,
        passes=_custom_passes(args),
        max_num_batched_tokens=args.max_num_tokens,
        **options,
    )


def _cmd_generate(args: argparse.Namespace) -> None:
    from kiln import SamplingParams

    llm = _llm(args, args.compile, seed=args.seed)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop or [],
    )
    for out in llm.generate(args.prompt, params):
        print(out.prompt + out.text if len(args.prompt) == 1 else f"[{out.prompt!r}] {out.text}")


def _cmd_demo_model(args: argparse.Namespace) -> None:
    from kiln.models.demo import write_demo_model

    out = write_demo_model(args.out_dir, arch=args.arch, num_layers=args.num_layers, seed=args.seed,
                           train_steps=args.train_steps)
    print(out)


def _add_compile_options(parser: argparse.ArgumentParser) -> None:
    import dataclasses

    from kiln.config import PassConfig

    pass_names = [f.name.replace("_", "-") for f in dataclasses.fields(PassConfig)]
    parser.add_argument("--cache-dir", metavar="DIR", help="artifact cache (default $KILN_CACHE, else "
                        "~/.cache/kiln)")
    parser.add_argument("--max-num-tokens", type=int, default=2048, metavar="N", help="largest batch in tokens "
                        "the compiled pieces serve (default 2048)")
    parser.add_argument("--quantization", choices=["int8", "fp8"], help="W8A8: weights per channel, "
                        "activations per token (default: none)")
    parser.add_argument("--sizes", type=_sizes, default=(), metavar="N,N,...", help="token counts that also get "
                        "a static-shape compile, e.g. 1,2,4,8 (default: none)")
    parser.add_argument("--range-splits", type=_sizes, default=(), metavar="N,N,...", help="cut the dynamic "
                        "token range after these counts, e.g. 64 gives 1-64 and 65-max, for passes that apply "
                        "to some sizes only (default: one range)")
    parser.add_argument("--pass", dest="passes", action="append", metavar="MODULE:NAME", help="add your own "
                        "graph pass (a kiln.passes.GraphPass subclass), run after kiln's fusions; repeatable")
    parser.add_argument("--disable-pass", action="append", choices=pass_names, metavar="NAME",
                        help=f"turn off one of kiln's passes ({', '.join(pass_names)}); repeatable")


def _cmd_serve(args: argparse.Namespace) -> None:
    from kiln.runtime.server import serve

    llm = _llm(args, args.artifact != "eager", artifact=None if args.artifact in ("auto", "eager") else args.artifact,
               max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
               enable_prefix_caching=args.enable_prefix_caching)
    serve(llm, args.host, args.port, args.served_model_name)


def build_parser() -> argparse.ArgumentParser:
    from kiln.models.demo import DEMO_ARCHS, TRAIN_STEPS

    parser = argparse.ArgumentParser(
        prog="kiln", description="kiln: compile Hugging Face decoder models ahead of time and run them."
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="-v for INFO logs, -vv for DEBUG")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate text from prompts (eager)", description="Generate text from "
                         "one or more prompts and print it. Greedy unless --temperature is set.")
    gen.add_argument("model_dir", metavar="MODEL_DIR", help="Hugging Face model directory (config.json, "
                     "*.safetensors, tokenizer.json)")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens (-1: all)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    gen.add_argument("--stop", action="append", help="stop string; repeat for several")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and "
                     "activations dtype (default float32)")
    gen.add_argument("--compile", action="store_true", help="run the compiled artifact (compiling it first if "
                     "it is absent or unusable)")
    gen.add_argument("--require-artifact", action="store_true", help="run the compiled artifact and fail if it is "
                     "absent or unusable instead of compiling (implies --compile)")
    _add_compile_options(gen)
    gen.set_defaults(func=_cmd_generate)

    comp = sub.add_parser("compile", help="trace and compile a model into a cached artifact",
                          description="Trace the model's decoder once, split it at attention, compile each unique "
                          "piece with Inductor and save one artifact (program, compiled pieces, built kernels) "
                          "under the cache directory. Prints a table of stage timings and the artifact path. "
                          "An artifact already present and valid is reused.")
    comp.add_argument("model_dir", metavar="MODEL_DIR", help="Hugging Face model directory (config.json, "
                      "*.safetensors); only its config is read")
    comp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="activations dtype "
                      "(default float32)")
    _add_compile_options(comp)
    comp.add_argument("--dump-dir", metavar="DIR", help="write depyf's decompiled bytecode and the graphs before "
                      "and after splitting here")
    comp.add_argument("--force", action="store_true", help="compile even if a valid artifact is present")
    comp.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    comp.set_defaults(func=_cmd_compile)

    srv = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API", description="Load the model and its "
                         "compiled artifact (compiling it first if absent, unless --require-artifact) and serve "
                         "/v1/completions, /v1/chat/completions, /v1/models, /health and /metrics with continuous "
                         "batching. Logs each start-up stage with -v.")
    srv.add_argument("model_dir", metavar="MODEL_DIR", help="Hugging Face model directory (config.json, "
                     "*.safetensors, tokenizer.json)")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    srv.add_argument("--artifact", default="auto", metavar="auto|eager|PATH", help="auto: the cached artifact "
                     "for this model and options (default); eager: no compiled artifact; PATH: that artifact")
    srv.add_argument("--require-artifact", action="store_true", help="fail if the artifact is absent or unusable "
                     "instead of compiling")
    srv.add_argument("--served-model-name", metavar="NAME", help="the model name clients send (default: the "
                     "model directory's name)")
    srv.add_argument("--max-model-len", type=_at_least(2), metavar="N", help="prompt + generated tokens per "
                     "request (default: the model's max_position_embeddings)")
    srv.add_argument("--max-num-seqs", type=_at_least(1), default=64, metavar="N", help="requests running at "
                     "once; more wait (default 64)")
    srv.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                     help="reuse the KV blocks of prompt prefixes seen before (default on)")
    srv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and "
                     "activations dtype (default float32)")
    _add_compile_options(srv)
    srv.set_defaults(func=_cmd_serve)

    demo = sub.add_parser("demo-model", help="write a tiny model kiln can run (nothing is downloaded)",
                          description="Write a tiny Hugging Face-format model and a byte-level BPE tokenizer, "
                          "both trained on a short text shipped with kiln (training takes ~25 s on 2 cores; "
                          "--train-steps 0 keeps the random weights).")
    demo.add_argument("out_dir", metavar="OUT_DIR")
    demo.add_argument("--arch", default="llama", choices=DEMO_ARCHS, help="architecture (default llama)")
    demo.add_argument("--num-layers", type=_at_least(1), default=4, metavar="N", help="decoder layers (default 4)")
    demo.add_argument("--seed", type=int, default=0, help="weight init and training seed (default 0)")
    demo.add_argument("--train-steps", type=_at_least(0), default=TRAIN_STEPS, metavar="N",
                      help=f"training steps on the shipped text (default {TRAIN_STEPS}; 0: random weights)")
    demo.set_defaults(func=_cmd_demo_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("kiln").setLevel(level)
    try:
        args.func(args)
    except KilnError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
