"""`kiln compile`: trace, split, compile each unique piece with Inductor, save one artifact.

Pieces whose graphs are the same up to input names (every middle decoder layer) are compiled once.
Each unique piece is compiled for a symbolic token count and, if asked, for static token counts;
a piece another artifact already compiled for the same inputs comes from the piece cache.
"""

import copy
import dataclasses
import hashlib
import logging
import shutil
import tempfile
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
from tqdm import tqdm

from kiln.compiler import artifact, libraries, usage
from kiln.compiler.aoti import CompiledLibrary, check_compilable, tensor_args
from kiln.compiler.counters import counters
from kiln.compiler.key import cache_key, model_factors
from kiln.compiler.piece_cache import PieceCache, piece_cache_key
from kiln.compiler.contract import arg_names
from kiln.compiler.split import Piece, split_graph, stitching_source
from kiln.compiler.trace import TracedBackbone, trace_backbone
from kiln.compiler.workers import CompileJob, NamedJobs, compile_jobs, cpu_probe_done, probe_cpu_in_background
from kiln.config import CompileConfig, dtype_name
from kiln.kernels import gemms, panel_linear
from kiln.kernels.kv_cache import row_size
from kiln.models.llama import CausalLM
from kiln.models.lm_head import Int8Head
from kiln.passes import GraphPass, PassManager, gemm_choice
from kiln.passes.base import SizeRange
from kiln.passes.manager import PassReport
from kiln.runtime import bind

logger = logging.getLogger(__name__)


def normalize(graph: fx.GraphModule) -> fx.GraphModule:
    """A copy whose inputs are named arg0..argN and values v0..vN, so identical layers print
    identical code (the traced names count across the whole backbone)."""
    g = copy.deepcopy(graph)
    for i, node in enumerate(n for n in g.graph.nodes if n.op == "placeholder"):
        node.name = node.target = f"arg{i}"
    values = [n for n in g.graph.nodes if n.op not in ("placeholder", "output")]
    for i, node in enumerate(values):
        node.name = f"_kiln_tmp{i}"  # two steps: a new name may equal an old one not yet renamed
    for i, node in enumerate(values):
        node.name = f"v{i}"
    g.recompile()
    return g


def piece_key(graph: fx.GraphModule) -> str:
    return hashlib.sha256(graph.code.encode()).hexdigest()


def _returns_tuple(graph: fx.GraphModule) -> bool:
    output = next(n for n in reversed(graph.graph.nodes) if n.op == "output")
    return isinstance(output.args[0], (tuple, list))


def _examples(piece: Piece) -> list:
    return [n.meta["val"] for n in piece.graph.graph.nodes if n.op == "placeholder"]


def _token_location(examples: list, token_symbol: str) -> tuple[int, int | None] | None:
    """Where a piece's arguments carry the token count: an int argument, else a tensor dimension."""
    for i, value in enumerate(examples):
        if isinstance(value, torch.SymInt) and str(value) == token_symbol:
            return i, None
    for i, value in enumerate(examples):
        if isinstance(value, torch.Tensor):
            for dim, size in enumerate(value.shape):
                if str(size) == token_symbol:
                    return i, dim
    return None


def _static_examples(examples: list, token_symbol: str, n: int) -> tuple[list, FakeTensorMode]:
    """The piece's example inputs with the token count fixed to `n`; other symbolic dimensions (the
    KV cache's block count) stay symbolic in a fresh shape environment."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    renamed: dict[str, torch.SymInt] = {}
    out: list = []

    def hint(size) -> int:
        return n if str(size) == token_symbol else (size.node.hint if isinstance(size, torch.SymInt) else size)

    for value in examples:
        if not isinstance(value, torch.Tensor):
            out.append(value)
            continue
        dynamic = [isinstance(s, torch.SymInt) and str(s) != token_symbol for s in value.shape]
        real = torch.empty([hint(s) for s in value.shape], dtype=value.dtype)
        context = StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.DYNAMIC if d else DimDynamic.STATIC for d in dynamic],
            constraint_sizes=[None] * value.dim(),
        )
        fake = mode.from_tensor(real, symbolic_context=context)
        if fake.device != value.device:  # `real` is a lazily allocated CPU stand-in, whatever the device
            with mode:
                fake = fake.to(value.device)
        for size, new, d in zip(value.shape, fake.shape, dynamic):
            if d:
                renamed.setdefault(str(size), new)
        out.append(fake)
    for i, value in enumerate(examples):
        if isinstance(value, torch.SymInt):
            out[i] = n if str(value) == token_symbol else renamed[str(value)]
    return out, mode


@dataclass
class PieceBuild:
    """One compiled piece: its libraries by size (None: the dynamic compile), the token count's
    location among its arguments, and which arguments (the tensors) its libraries take."""

    compiled: dict[int | None, CompiledLibrary]
    tokens: tuple[int, int | None] | None
    returns_tuple: bool
    tensor_args: tuple[int, ...]
    token_args: tuple[int, ...] = ()


def compile_pieces(
    pieces: list[Piece],
    token_symbol: str,
    sizes: tuple[int, ...] = (),
    progress: bool | None = None,
    dynamic: bool = True,
    done: dict | None = None,
    cache: PieceCache | None = None,
    beside: NamedJobs | None = None,
) -> dict[str, PieceBuild]:
    """Compile every non-splitting piece (unique graphs once, per size); returns name -> build.
    `dynamic=False` compiles the static sizes only; `done` maps (graph key, size) to compiles made
    earlier (another variant's pieces that came out the same); `cache` holds compiles made for
    other artifacts; `beside` are libraries to build too (into `beside.built`). What is left to
    compile is compiled side by side (`workers.py`)."""
    done = {} if done is None else done
    todo = [(piece, normalize(piece.graph)) for piece in pieces if not piece.is_splitting]
    keys = [piece_key(graph) for _, graph in todo]
    wanted = ((None,) if dynamic else ()) + tuple(sizes)
    plans = []  # (piece, examples, tokens, sizes): what each piece's build is made of
    jobs: list[CompileJob] = []
    job_of: list[tuple[str, int | None, str | None, str]] = []  # per job: graph key, size, piece-cache key, label
    queued: set[tuple[str, int | None]] = set()
    for (piece, graph), key in zip(todo, keys):
        counters["pieces"] += 1
        examples = _examples(piece)
        check_compilable(piece.name, graph, examples)
        tokens = _token_location(examples, token_symbol)
        piece_sizes = wanted if tokens is not None else (None,)
        plans.append((piece, examples, tokens, piece_sizes))
        for size in piece_sizes:
            if (key, size) in done or (key, size) in queued:
                counters["pieces_reused"] += 1
                continue
            if size is None:
                inputs, mode = examples, detect_fake_mode(examples)
            else:
                inputs, mode = _static_examples(examples, token_symbol, size)
            label = f"{piece.name} {'dynamic' if size is None else f'size {size}'} ({key[:12]})"
            stored = piece_cache_key(graph, inputs) if cache is not None else None
            hit = cache.get(stored) if stored is not None else None
            if hit is not None:
                done[key, size] = hit
                counters["pieces_cached"] += 1
                logger.info("reused %s from the piece cache", label)
                continue
            jobs.append(CompileJob(graph, inputs, mode))
            job_of.append((key, size, stored, label))
            queued.add((key, size))
    extra = beside.todo() if beside is not None else []
    names = [label for *_, label in job_of] + [beside.describe(name) for name, _ in extra]
    disable = None if progress is None else not progress  # None: show only on a terminal
    with tqdm(total=len(names), desc="kiln compile", unit="graph", disable=disable) as bar:
        for i, compiled, seconds in compile_jobs(jobs + [beside.jobs[name] for name, _ in extra], names):
            if i >= len(job_of):
                beside.done(*extra[i - len(job_of)], compiled, seconds)
                bar.update()
                continue
            key, size, stored, label = job_of[i]
            done[key, size] = compiled
            counters["pieces_compiled"] += 1
            if stored is not None:
                cache.put(stored, compiled)
            logger.info("compiled %s in %.2fs", label, seconds)
            bar.update()
    builds: dict[str, PieceBuild] = {}
    for (piece, examples, tokens, piece_sizes), key in zip(plans, keys):
        token_args = tuple(i for i, v in enumerate(examples)
                           if isinstance(v, torch.Tensor) and v.dim() and str(v.shape[0]) == token_symbol)
        builds[piece.name] = PieceBuild({size: done[key, size] for size in piece_sizes}, tokens,
                                        _returns_tuple(piece.graph), tensor_args(examples), token_args)
    return builds


@dataclass
class VariantBuild:
    """The backbone for the token counts whose passes agree: its size ranges and static sizes, the
    passes' report, the stitching program and its compiled pieces."""

    ranges: list[SizeRange]
    sizes: list[int]
    report: PassReport
    program: str
    pieces: dict[str, PieceBuild]


def _on_cpu(traced: TracedBackbone) -> bool:
    return any(spec.kind == "weight" and node.meta["val"].device.type == "cpu"
               for node, spec in zip(traced.graph.graph.find_nodes(op="placeholder"), traced.inputs))


def _weight_formats(traced: TracedBackbone, variant: VariantBuild) -> dict[str, str]:
    """The weights a variant's projections read packed: weight name -> format (`kiln.kernels.gemms`)."""
    placeholders = [n.target for n in traced.graph.graph.find_nodes(op="placeholder")]
    names = {target: spec.name for target, spec in zip(placeholders, traced.inputs)}
    return {names[target]: fmt for target, fmt in variant.report.weight_formats.items()}


def _lm_head_choice(model: CausalLM, compile_config: CompileConfig) -> dict | None:
    """On CPU, whether the LM head (outside the compiled graph) runs on a packed weight, and the int8
    GEMM its greedy screen runs: measured at the batch sizes it sees (one row per sequence sampled in
    a step). The screen is timed only where kiln's int8 panel GEMM can run it; elsewhere it runs on
    the int8 GEMM the runtime picks (`gemms.int8_head_kernel`)."""
    weight = model.lm_head_weight()
    if not compile_config.passes.gemm_choice or weight.device.type != "cpu" or not weight.dtype.is_floating_point:
        return None
    tokens = tuple(sorted({1, min(gemm_choice.DECODE_TOKENS, compile_config.max_num_tokens)}))
    choice = gemm_choice.lm_head_choice(weight.detach(), tokens)
    logger.info("LM head %s: %s (%s)", list(weight.shape), choice.kernel, choice.ms)
    head = {"format": None if choice.kernel == gemms.ATEN.id else choice.kernel, "choice": choice.as_dict(),
            "screen": None, "screen_choice": None}
    int8_head = getattr(model, "lm_head_kernel", None)
    if isinstance(int8_head, Int8Head) and int8_head.blocks:  # its activations per block of 32, on this kernel
        probe = gemms.Projection("int8_blocked", tuple(weight.shape), torch.int8)
        head["int8_blocked"] = None if gemms.PANELS8_INT8_BLOCK.unavailable(probe) else gemms.PANELS8_INT8_BLOCK.id
    screens = weight.dtype == torch.float32 and head["format"] is not None  # what `PackedHead` screens
    if screens and panel_linear.available(tuple(weight.shape), torch.int8) is None:  # else nothing to choose
        screen = gemm_choice.lm_head_screen_choice(tuple(weight.shape), tokens)
        logger.info("LM head's greedy screen: %s (%s)", screen.kernel, screen.ms)
        head["screen"] = screen.kernel if screen.kernel in libraries.HEAD_FORMATS else None
        head["screen_choice"] = screen.as_dict()
    return head


def _library_jobs(model: CausalLM, lm_head: dict | None, pieces: PieceCache) -> NamedJobs:
    """The libraries the artifact ships beside its pieces: the panel GEMMs chosen for the LM head
    ("head:<format>"), and kiln's kernels that run outside the pieces (`kiln.compiler.libraries`, by
    name). They compile beside the first variant's pieces."""
    formats = [lm_head.get(k) for k in ("format", "screen", "int8_blocked")
               if lm_head is not None and lm_head.get(k) in libraries.HEAD_FORMATS]
    shape = tuple(model.lm_head_weight().shape)
    jobs = {f"head:{format}": libraries.head_job(format, shape) for format in dict.fromkeys(formats)}
    kernels = []
    if libraries.attention_wanted(next(model.parameters()).device, model.dtype):
        kernels.append(libraries.DECODE_ATTENTION)
    if libraries.screen_wanted(lm_head):
        kernels.append(libraries.GREEDY_SCREEN)
    jobs |= {kernel.name: kernel.job() for kernel in kernels}

    def describe(name: str) -> str:
        head = name.removeprefix("head:")
        return f"the LM head's {head} library" if head != name else f"the {name.replace('_', ' ')} library"

    return NamedJobs(jobs, pieces, describe)


@dataclass
class CompileResult:
    path: Path
    reused: bool
    timings: dict[str, float] = field(default_factory=dict)
    pass_matches: dict[str, dict[str, int | None]] = field(default_factory=dict)
    """Variant label ("1-2048") -> pass name -> matches, passes in pipeline order."""


def _token_symbol(traced: TracedBackbone) -> str:
    ids = next(i for i, spec in enumerate(traced.inputs) if spec.kind == "input" and spec.name == "input_ids")
    spec = next(s for s in traced.inputs if s.kind == "size" and s.of == ids and s.dim == 0)
    return spec.name


def _contract(traced: TracedBackbone) -> list[dict]:
    """The input contract the manifest records: each input's source, and tensors' dtype and shape
    (None where the dimension is symbolic)."""
    values = [n.meta["val"] for n in traced.graph.graph.nodes if n.op == "placeholder"]
    contract = []
    for spec, value in zip(traced.inputs, values):
        entry = dataclasses.asdict(spec)
        if isinstance(value, torch.Tensor):
            entry["dtype"] = dtype_name(value.dtype)
            entry["shape"] = [s if isinstance(s, int) else None for s in value.shape]
        contract.append(entry)
    return contract


def _graph_texts(folder: str, before_passes: str, graph: fx.GraphModule, stitched: fx.GraphModule,
                 pieces: list[Piece]) -> dict[str, str]:
    """One variant's graphs as text, by relative path: what the artifact's debug/ and --dump-dir hold."""
    texts = {f"{folder}/before_passes.py": before_passes, f"{folder}/before_split.py": graph.code,
             f"{folder}/after_split.py": stitched.code}
    return texts | {f"{folder}/{piece.name}.py": piece.graph.code for piece in pieces}


def _build_variants(traced: TracedBackbone, manager: PassManager, compile_config: CompileConfig,
                    timings: dict[str, float], debug: dict[str, str], progress: bool | None,
                    cache: PieceCache | None, beside: NamedJobs | None = None) -> list[VariantBuild]:
    """Run the passes, split and compile once per group of size ranges whose passes agree (one group
    unless a pass declines some sizes, or on CPU the GEMM kernels chosen for small batches differ from
    the rest). Pieces that come out the same in two variants compile once; `beside` compiles with the
    first variant's pieces. Each variant's graphs are added to `debug` as text."""
    ranges = compile_config.dynamic_ranges()
    if manager.gemms is not None and _on_cpu(traced):  # decode batches choose their GEMMs apart
        ranges = gemm_choice.split_at_batch_cuts(ranges)
    statics = [(s, s) for s in compile_config.sizes]
    start = time.perf_counter()
    cpu_probe_done()  # its test builds would take a core from the GEMMs timed next
    groups = manager.group([*ranges, *statics], traced.graph.graph)
    timings["gemm_choice"] = timings.get("gemm_choice", 0.0) + time.perf_counter() - start
    token_symbol = _token_symbol(traced)
    before_passes = traced.graph.code
    done: dict = {}
    variants = []
    for i, group in enumerate(groups):
        graph = traced.graph if i == len(groups) - 1 else copy.deepcopy(traced.graph)
        start = time.perf_counter()
        report = manager.run(graph, group[0])
        timings["passes"] = timings.get("passes", 0.0) + time.perf_counter() - start
        logger.info("pass matches (%d-%d): %s", *group[0], ", ".join(f"{k} {v}" for k, v in report.matches.items()))
        start = time.perf_counter()
        stitched, pieces = split_graph(graph)
        timings["split"] = timings.get("split", 0.0) + time.perf_counter() - start
        dynamic = [r for r in group if r in ranges]
        sizes = [lo for lo, hi in group if (lo, hi) in statics]
        debug |= _graph_texts("graphs" if i == 0 else f"graphs-{i}", before_passes, graph, stitched, pieces)
        start = time.perf_counter()
        builds = compile_pieces(pieces, token_symbol, tuple(sizes), progress, dynamic=bool(dynamic), done=done,
                                cache=cache, beside=beside if i == 0 else None)
        timings["compile"] = timings.get("compile", 0.0) + time.perf_counter() - start
        program = stitching_source(stitched, pieces, arg_names(traced.inputs))
        variants.append(VariantBuild(dynamic, sizes, report, program, builds))
    return variants


def ship_triton_kernels(path: Path, model: CausalLM, block_size: int = 16) -> int:
    """Run the artifact at `path` once per batch form (decodes, a prefill) in each variant, so Triton
    builds every kernel the program launches from Python, and add them to the artifact: a serve start
    then compiles none. Returns how many kernels were added."""
    import triton

    from kiln.compiler import triton_cache

    start = time.perf_counter()
    program = bind.load(path, model)
    cfg, device = model.config, next(model.parameters()).device
    kv_caches = [torch.zeros(2, 4, block_size, model.layout.num_kv_heads, row_size(cfg.head_dim, model.cache_dtype),
                             dtype=model.cache_dtype, device=device) for _ in range(cfg.num_layers)]
    with triton_cache.as_fresh_process():  # not under the TRITON_PTXAS_PATH Inductor set here
        triton_cache.forget_launched()
        with triton_cache.Recorder() as recorder, torch.inference_mode():
            batches = program.run_each_form(kv_caches, block_size)
            if device.type == "cuda":
                torch.cuda.synchronize()
        backend = triton_cache.backend_key() if device.type == "cuda" else None
        with tempfile.TemporaryDirectory() as packed:
            triton_cache.pack(recorder.builds, Path(packed))
            files = artifact.add_triton_kernels(path, Path(packed), triton.__version__, time.perf_counter() - start,
                                                backend)
    logger.info("Triton kernels: %d built (%d compiled, the rest from Triton's cache) by %d warm-up batches, "
                "%d files added to the artifact", len(recorder.builds), len(recorder.compiled), len(batches), files)
    return len(recorder.builds)


def _trace(model: CausalLM, dump_dir: Path | None) -> TracedBackbone:
    """The backbone traced, under depyf where a dump is asked for (it decompiles Dynamo's bytecode)."""
    if dump_dir is None:
        return trace_backbone(model)
    import depyf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # depyf's hints for interactive debugging
        with depyf.prepare_debug(str(dump_dir)):
            return trace_backbone(model)


def _ship_triton_kernels_if_whole(path: Path, model: CausalLM, timings: dict[str, float]) -> None:
    """A CUDA artifact's Triton kernels built into it; a failure leaves it whole, its kernels then
    compiling at first launch."""
    if model.layout.world_size > 1:
        # running the program needs every rank in its collectives, and only this one holds the lock
        logger.info("tensor-parallel artifact: its Triton kernels are not shipped, they compile at first launch")
        return
    start = time.perf_counter()
    try:
        ship_triton_kernels(path, model)
    except Exception as e:  # the artifact is whole without them: its kernels then compile at first launch
        logger.warning("could not build the Triton kernels into the artifact (%s: %s): a serve start will "
                       "compile them", type(e).__name__, e)
    timings["triton_kernels"] = time.perf_counter() - start


def build_artifact(
    model: CausalLM,
    compile_config: CompileConfig,
    cache_dir: Path,
    dump_dir: Path | None = None,
    progress: bool | None = None,
    force: bool = False,
    passes: Sequence[GraphPass] = (),
    model_name: str | None = None,
    weight_types: dict[str, int] | None = None,
) -> CompileResult:
    """Compile `model`'s backbone into `cache_dir/<key>` unless a valid artifact is already there.
    `passes` are the user's own, run after kiln's fusions; `model_name` (the model directory's name)
    is recorded for `kiln cache ls` only: one artifact serves every checkpoint of these shapes; so are a GGUF
    file's `weight_types` (tensors by stored type), which `kiln cache info` shows.

    A file lock per key makes concurrent compiles of one model wait for the first and reuse its
    artifact; the artifact appears in one `os.replace`, so a crash leaves nothing half-written.
    """
    manager = PassManager(compile_config.passes, passes, tensor_parallel_size=model.layout.world_size,
                          quantization=getattr(model, "quantization", None))
    factors = model_factors(model, compile_config, passes)
    key = cache_key(factors)
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / key
    with usage.compile_lock(path):
        for debris in cache_dir.glob(f".tmp-{key}-*"):  # left by a compile that was killed mid-save
            shutil.rmtree(debris, ignore_errors=True)
        if not force:
            try:
                manifest = artifact.verify(path)
                logger.info("artifact %s is present and valid: nothing to compile", path)
                return CompileResult(path, reused=True, pass_matches=artifact.pass_matches(manifest))
            except artifact.ArtifactError as e:
                logger.info("compiling: %s", e)
        timings: dict[str, float] = {}
        before = counters.copy()
        if next(model.parameters()).device.type == "cpu":
            probe_cpu_in_background()
        start = time.perf_counter()
        traced = _trace(model, dump_dir)
        timings["trace"] = time.perf_counter() - start
        debug = {"dynamo/decompiled.py": traced.decompiled, "dynamo/graph.py": traced.dynamo_graph}
        pieces = PieceCache.for_cache_dir(cache_dir, read=not force)
        start = time.perf_counter()
        cpu_probe_done()  # its test builds would take a core from the GEMMs timed next
        lm_head = _lm_head_choice(model, compile_config)
        timings["gemm_choice"] = time.perf_counter() - start
        beside = _library_jobs(model, lm_head, pieces)
        variants = _build_variants(traced, manager, compile_config, timings, debug, progress, pieces, beside)
        head_libraries = {name.removeprefix("head:"): lib for name, lib in beside.built.items() if name.startswith("head:")}
        kernel_libraries = {name: lib for name, lib in beside.built.items() if not name.startswith("head:")}
        if dump_dir is not None:
            for rel, text in debug.items():
                (Path(dump_dir) / rel).parent.mkdir(parents=True, exist_ok=True)
                (Path(dump_dir) / rel).write_text(text)
        start = time.perf_counter()
        artifact.save(
            path,
            factors=factors,
            inputs=_contract(traced),
            variants=[{"ranges": v.ranges, "sizes": v.sizes, "program": v.program, "pieces": v.pieces,
                       "passes": [{"name": p.name, "matches": v.report.matches.get(p.name),
                                   "seconds": round(v.report.seconds.get(p.name, 0.0), 4)}
                                  for p in manager.passes],  # a list: pipeline order
                       "kernel_choices": [c.as_dict() for c in v.report.kernel_choices],
                       "gemm_choices": [c.as_dict() for c in v.report.gemm_choices],
                       "weight_formats": _weight_formats(traced, v)}
                      for v in variants],
            debug=debug,
            head_libraries=head_libraries,
            libraries=kernel_libraries,
            info={
                "timings": timings,
                "counters": dict(counters - before),
                "architecture": model.config.architecture,
                "model_name": model_name,
                **({"weight_types": weight_types} if weight_types else {}),
                "passes": [{"name": name, "uuid": uuid} for name, uuid in manager.uuids().items()],
                "lm_head": lm_head,
            },
        )
        timings["save"] = time.perf_counter() - start
        if next(model.parameters()).device.type == "cuda":
            _ship_triton_kernels_if_whole(path, model, timings)
    logger.info("compile stages: %s", ", ".join(f"{k} {v:.2f}s" for k, v in timings.items()))
    matches = artifact.pass_matches(artifact.read_manifest(path))  # the table `kiln compile` prints, as saved
    return CompileResult(path, reused=False, timings=timings, pass_matches=matches)
