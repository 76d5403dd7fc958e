"""OSCAR: offline spectral covariance-aware rotations and clipping for INT2/INT4 KV caches.

The method and our extensions are described in ``docs/oscar.md``. The pieces, in the order
they run:

- :func:`calibrate` (:mod:`foscar.oscar.calibrate`): the model over calibration text,
  post-RoPE Q/K/V captured per layer, float64 covariance targets
  (:mod:`foscar.oscar.covariance`);
- :meth:`Calibration.rotations`: ``R = U * H * P_br`` per layer or per KV head
  (:mod:`foscar.oscar.rotation`, with the paper's ablations);
- :func:`fit_clips`: per-layer clip ratios for K and V minimising attention-output error;
- :func:`select_rotations` (our extension): per layer and for K and V, the candidate rotation
  (with or without ``U``, per layer or per KV head) with the smallest fitted error
  (:func:`fit_candidates` then :func:`choose_rotations`);
- :func:`gptq_factors` (our extension): GPTQ's rounding factors of the keys' metric (the
  queries' covariance in the stored basis, or :func:`attention_key_metrics`, the same weighted
  by what a key error costs the output), for GPTQ-rounded keys at the cache write;
- :class:`OscarRotations` (:mod:`foscar.oscar.policy`): the artifact, saved and loaded as
  safetensors; :func:`apply_to_cache` sets it on a :class:`foscar.QuantizedKVCache`
  (:meth:`~foscar.QuantizedKVCache.set_transform`) and :func:`oscar_cache` builds a
  transformers cache with it; :func:`fold_value_rotations` moves the value rotations into the
  model's ``v_proj`` and ``o_proj`` weights instead (two fewer rotations per layer and step);
  :func:`widths_by_error` and :func:`widths_by_budget` choose INT4 or INT2 per layer for K and V
  by the fitted errors, for a count of layers or a budget of stored bits (:func:`budget_bounds`).

:func:`calibrate_rotations` runs the first three (and optionally the selection and GPTQ
factors) from a text, as ``foscar calibrate`` does before writing the file.
"""

from .calibrate import (
    CLIP_CANDIDATES,
    PLAIN_TARGETS,
    Calibration,
    attention_key_metrics,
    calibrate,
    calibrate_rotations,
    choose_rotations,
    fit_candidates,
    fit_clips,
    gptq_factors,
    select_rotations,
)
from .policy import (
    FORMAT_VERSION,
    OscarRotations,
    apply_to_cache,
    budget_bounds,
    fold_value_rotations,
    key_widths_by_error,
    layer_key_formats,
    layer_width_formats,
    layers_by_gain,
    layers_by_key_gain,
    oscar_cache,
    widths_by_budget,
    widths_by_error,
)
from .rotation import RECIPES, RotationRecipe, bit_reversal, hadamard, rotation

__all__ = [
    "CLIP_CANDIDATES",
    "Calibration",
    "FORMAT_VERSION",
    "OscarRotations",
    "PLAIN_TARGETS",
    "RECIPES",
    "RotationRecipe",
    "apply_to_cache",
    "attention_key_metrics",
    "bit_reversal",
    "budget_bounds",
    "calibrate",
    "calibrate_rotations",
    "choose_rotations",
    "fit_candidates",
    "fit_clips",
    "fold_value_rotations",
    "gptq_factors",
    "hadamard",
    "key_widths_by_error",
    "layer_key_formats",
    "layer_width_formats",
    "layers_by_gain",
    "layers_by_key_gain",
    "oscar_cache",
    "rotation",
    "select_rotations",
    "widths_by_budget",
    "widths_by_error",
]
