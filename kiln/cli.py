"""The `kiln` command. Subcommands import their heavy dependencies only when run, so --help is fast."""

import argparse
import logging
import sys

from kiln.errors import KilnError


def _cmd_generate(args: argparse.Namespace) -> None:
    from kiln import LLM, SamplingParams

    llm = LLM(args.model_dir, dtype=args.dtype, seed=args.seed)
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

    out = write_demo_model(args.out_dir, arch=args.arch, num_layers=args.num_layers, seed=args.seed)
    print(out)


def build_parser() -> argparse.ArgumentParser:
    from kiln.models.demo import DEMO_ARCHS

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
    gen.set_defaults(func=_cmd_generate)

    demo = sub.add_parser("demo-model", help="write a tiny random model kiln can run (nothing is downloaded)",
                          description="Write a tiny Hugging Face-format model with random weights and a "
                          "byte-level BPE tokenizer trained on text shipped with kiln.")
    demo.add_argument("out_dir", metavar="OUT_DIR")
    demo.add_argument("--arch", default="llama", choices=DEMO_ARCHS, help="architecture (default llama)")
    demo.add_argument("--num-layers", type=int, default=4, help="decoder layers (default 4)")
    demo.add_argument("--seed", type=int, default=0, help="weight init seed (default 0)")
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
