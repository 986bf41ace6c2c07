r"""What the transfer matrix predicts for a model, from the measurements of a short check.

The transfer matrix (docs/reproduction.md, "Transfer matrix" and "Why FLeRM under-sets width
rates") found one quantity that separates the cells where FLeRM, matching each tensor's output
movement, transfers from those where it under-sets the hidden tensors' rates: how the *feature
gain* of the hidden tensors' first update (:mod:`fslr_func.training.feature_gains`: output
movement over movement of the readout's input) grows with width. With :math:`G_s` the
geometric mean over the hidden tensors of the gain at scale :math:`s` and :math:`m` the
largest scale over the smallest, the *gain exponent* is

.. math::

    e = \frac{\log (G_m / G_1)}{\log m} .

Holding a hidden tensor's output movement at the base's, as FLeRM does, holds its feature
movement at :math:`G_1 / G_m = m^{-e}` of the base's, which is the factor by which
``FLeRM(..., match="features")`` raises its rate. Measured with ``fslr check`` on the
matrix's families (:data:`MATRIX_FAMILIES`), and what the matrix's cells of each family
found:

- :math:`e` from 0.28 to 0.46 (the ResMLP and the residual conv nets, whose readout reads
  an un-normalised stream): FLeRM's optimum at 8x moved up by one to three octaves on 11 of
  their 12 cells and it lost more than 2% to re-tuned standard training at the base's best
  rate on 8 of them (up to 51%); ``match="features"`` was within 2% of re-tuning, or better,
  on 11 of the 12 (it loses the 600-step ResMLP, by 11%).
- :math:`e = 0.04` (the PreNorm transformer, whose readout reads a layer-normalised
  stream): FLeRM matched re-tuning (ratio 1.000) and ``match="features"`` changes nothing.

:func:`predict` places a model by its :math:`e` (:data:`FLAT` bounds the band around 0) and
says which of these it resembles; a model outside both (the features moving *more* per unit
of output movement as width grows) is outside what the matrix measured.

Examples:
    >>> p = predict({"scales": [1.0, 8.0], "gains": {"w": [2.0, 5.6]}})
    >>> p["kind"], round(p["exponent"], 2), round(p["factor"], 2)
    ('grows', 0.5, 2.8)
    >>> predict({"scales": [1.0, 8.0], "gains": {}})["kind"]
    'no hidden tensor'
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["FLAT", "MATRIX_FAMILIES", "predict"]

FLAT = 0.15
"""``|e|`` below this: the gain does not grow with width (the matrix's transformer: 0.04; its
other families: 0.28 and more)."""

MATRIX_FAMILIES = {
    "resmlp-w32 (MNIST-1D)": 0.45,
    "resmlp-w64 (MNIST-1D)": 0.46,
    "resmlp-w32 (digits_aug)": 0.41,
    "conv1d-w16": 0.28,
    "conv1d-w32": 0.37,
    "conv1d-bn-w16": 0.30,
    "conv2d-w8": 0.41,
    "conv2d-bn-w8": 0.39,
    "transformer-d16": 0.04,
}
"""The gain exponent ``e`` of the matrix's families at 8x (seed 0), as ``fslr check --model
MODEL --width W [--data DATA] --scales 1,8 --steps 2`` prints it (docs/reproduction.md,
"What fslr check predicts")."""

_GROWS = (
    "like the matrix's ResMLP and conv nets (e 0.28 to 0.46): matching output movement holds the "
    "hidden tensors' feature movement at {inverse:.2f} of the base's at {top:g}x. There FLeRM's "
    "optimum at 8x moved up by 1 to 3 octaves (11 of 12 cells) and it lost more than 2% to "
    "re-tuned standard training at the base's rate on 8 of 12 (up to 51%); "
    "FLeRM(..., match='features'), which multiplies these tensors' rates by {factor:.2f} here, "
    "was within 2% of re-tuning or better on 11 of 12 (it loses the 600-step ResMLP by 11%). "
    "Use match='features' (Recorder(..., feature_gains=True) for the base run). Giving the "
    "wide model muP's readout first (ff.scale_readout before the first step) with "
    "match='features_all' was within 2% on 11 of the 12 and below muP at the base's rate on 9 "
    "(behind it on the conv nets without BatchNorm)."
)
_FLAT = (
    "like the matrix's transformer (e 0.04, a readout behind a normalisation): matching "
    "output movement also holds the features' (factor {factor:.2f}); there FLeRM matched "
    "re-tuned standard training at the base's rate (ratio 1.000) and match='features' changed "
    "nothing. FLeRM as it is (with ff.scale_readout and match='features_all': 1.003, behind "
    "muP)."
)
_FALLS = (
    "the features move more per unit of output movement as the model grows (factor "
    "{factor:.2f}): no cell of the transfer matrix does this, so it predicts nothing here."
)


def predict(check: Mapping[str, Any]) -> dict[str, Any]:
    """The matrix's prediction for a model from its check (module docstring).

    Args:
        check: a :func:`~fslr_func.experiments.check.coord_check` result: ``"scales"`` and
            ``"gains"`` (hidden tensor -> its feature gain at each scale; ``None``: not
            measured).

    Returns:
        ``{"kind", "exponent", "factor", "tensors", "text"}``: ``kind`` one of ``"grows"``,
        ``"flat"``, ``"falls"``, ``"no hidden tensor"``, ``"not measured"``; ``factor`` the
        geometric mean of ``G_m / G_1`` (what ``match="features"`` multiplies the hidden
        rates by), ``exponent`` ``e``, ``tensors`` how many hidden tensors it averages
        (``None``/0 where there is nothing to average).
    """
    gains = check.get("gains")
    scales = [float(s) for s in check["scales"]]
    empty: dict[str, Any] = {"exponent": None, "factor": None, "tensors": 0}
    if gains is None:
        return {
            **empty,
            "kind": "not measured",
            "text": "no feature gains were measured (the probe found no readout layer), so "
            "the matrix predicts nothing",
        }
    ratios = [g[-1] / g[0] for g in gains.values() if g[0] > 0 and g[-1] > 0]
    if not ratios or scales[-1] <= scales[0]:
        return {
            **empty,
            "kind": "no hidden tensor",
            "text": "no tensor grows in both fan-in and fan-out over these scales: the "
            "transfer matrix measured width, so it predicts nothing here",
        }
    factor = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    exponent = math.log(factor) / math.log(scales[-1] / scales[0])
    kind = "flat" if abs(exponent) < FLAT else "grows" if exponent > 0 else "falls"
    template = {"grows": _GROWS, "flat": _FLAT, "falls": _FALLS}[kind]
    text = template.format(factor=factor, inverse=1.0 / factor, top=scales[-1] / scales[0])
    return {
        "kind": kind,
        "exponent": exponent,
        "factor": factor,
        "tensors": len(ratios),
        "text": f"gain exponent e = {exponent:.2f} over {len(ratios)} hidden tensor(s): {text}",
    }
