"""``foscar eval``'s harness: every KV format against BF16 on a real model (CPU or GPU).

:mod:`~foscar.eval.harness` runs a measurement (:class:`~foscar.eval.harness.EvalConfig`,
:func:`~foscar.eval.harness.evaluate`); :mod:`~foscar.eval.metrics` holds the measurements,
:mod:`~foscar.eval.formats` the formats compared, :mod:`~foscar.eval.oscar_rows` OSCAR's rows,
:mod:`~foscar.eval.clips` the clipped formats' ratio fit, :mod:`~foscar.eval.texts` the texts,
:mod:`~foscar.eval.model` the model loader and :mod:`~foscar.eval.report` the output.
"""
