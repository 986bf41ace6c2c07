"""The wrapper's state dict: the bare model's keys, with the wrapper's own state (EMAs, readout
roles, omega generators) in the state dict's metadata.

``fm.state_dict()`` has the keys of the bare model (no ``module.``, no ``_orig_mod.`` of a
``torch.compile``-d model), so ``model.load_state_dict(fm.state_dict())`` and
``fm.load_state_dict(model.state_dict())`` both work. The wrapper's state rides where torch
keeps module versions (``state_dict._metadata``): ``torch.save``/``torch.load`` keep it, a
copied plain ``dict`` does not, and a state dict without it (a bare model's) leaves the
wrapper's state as it is. Tensor names inside that state are the bare model's, as records
have them (:mod:`fslr_func.probe.names`).

Examples:
    >>> import torch, fslr_func as ff
    >>> fm = ff.with_fslr(torch.nn.Linear(2, 1), samples=2, seed=0)
    >>> sorted(fm.state_dict())
    ['bias', 'weight']
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from ..probe.names import WRAPPER_PREFIXES
from ..probe.options import ProbeOptions, Strategy
from ..stats.estimator import EMA, ReadoutRole
from .measurement import DropReports

__all__ = [
    "READOUT_SCALE_MARK",
    "STATE_VERSION",
    "extra_state",
    "load_bare",
    "load_bare_keys",
    "load_extra_state",
    "save_bare",
]

STATE_VERSION = 3
"""Version of the wrapper's saved state (3: tensor names are the bare model's)."""
READOUT_SCALE_MARK = "_fslr_readout_scale"
"""The attribute :func:`~fslr_func.training.readout_scale.scale_readout` leaves on the readout
module: the scale it applied. Saved with the wrapper's state and restored with it, so a
resumed run knows its readout is scaled already."""
_EXTRA = "_extra_state"
_METADATA_KEY = "fslr_state"  # the wrapper's state, in the state dict's metadata


class FSLRModule(Protocol):
    """What this module reads and restores of :class:`fslr_func.training.wrapper.FSLRModule`."""

    module: torch.nn.Module
    ema: EMA
    readout_roles: dict[str, ReadoutRole]
    generators: dict[str, torch.Generator]
    seed: int
    probes: int
    reported: DropReports
    loading_prefix: str | None
    resolved_strategy: Strategy
    options: ProbeOptions
    _readout_searched: bool

    @property
    def name_prefix(self) -> str: ...

    @property
    def wrapper_prefix(self) -> str: ...

    @property
    def beta(self) -> float: ...

    def config(self) -> dict[str, Any]: ...


def _renamed(state: Mapping[str, Any], rename: Callable[[str], str]) -> dict[str, Any]:
    """The EMA's or readout roles' state with every per-tensor dict's names renamed."""
    return {
        k: {rename(n): x for n, x in v.items()} if isinstance(v, dict) else v
        for k, v in state.items()
    }


def save_bare(fm: FSLRModule, state: dict[str, Any], prefix: str, local: dict[str, Any]) -> None:
    """State-dict post-hook: the model's keys without the wrapper prefixes, the wrapper's own
    state in the metadata (where torch keeps module versions), so the bare model loads it."""
    metadata = getattr(state, "_metadata", None)
    if metadata is None:  # a destination without metadata: the wrapper's form, state as a key
        return
    inner = prefix + fm.wrapper_prefix
    for key in [k for k in state if k.startswith(inner)]:
        state[prefix + key[len(inner) :]] = state.pop(key)
    local[_METADATA_KEY] = state.pop(prefix + _EXTRA)
    for key in [k for k in metadata if k.startswith(prefix + WRAPPER_PREFIXES[1][:-1])]:
        if key.startswith(inner):
            entry = metadata[prefix + key[len(inner) :]] = metadata.pop(key)
            if _METADATA_KEY in entry:  # a wrapper inside: kept where a load of a module
                metadata[key] = entry  # above this one looks it up too (its full path)
        elif inner.startswith(key + "."):  # a wrapper's entry; the bare model's has its version
            entry = metadata.pop(key)
            if key == inner[:-1]:
                local.update(entry)


def load_bare(
    fm: FSLRModule, state: dict[str, Any], prefix: str, local: Mapping[str, Any], *_: Any
) -> None:
    """Load-state-dict pre-hook: bare keys back under the wrapper prefixes. A state dict with
    the state as a key is in the wrapper's form already (saved before names were bare)."""
    if prefix + _EXTRA in state:
        return
    state[prefix + _EXTRA] = local.get(_METADATA_KEY)  # None: a bare model's, kept as it is
    inner = prefix + fm.wrapper_prefix
    for key in [k for k in state if k.startswith(prefix) and k != prefix + _EXTRA]:
        state[inner + key[len(prefix) :]] = state.pop(key)
    metadata = getattr(state, "_metadata", None)  # the whole load's, where this is its root
    if metadata is not None:  # the modules' entries (a nested wrapper's state) where torch
        # looks them up, under the wrapper prefix; added, not moved: the dict is the user's
        for key in [k for k in metadata if k.startswith(prefix) and k != prefix[:-1]]:
            if not key.startswith(inner):
                metadata.setdefault(inner + key[len(prefix) :], metadata[key])
    fm.loading_prefix = prefix


def load_bare_keys(fm: FSLRModule, incompatible: Any) -> None:
    """Load-state-dict post-hook: the missing and unexpected keys of a load that
    :func:`load_bare` renamed, named back as the user passed them (bare), in place, so
    ``strict=False``'s result and ``strict=True``'s error name the model's keys."""
    prefix, fm.loading_prefix = fm.loading_prefix, None
    if prefix is None:
        return
    inner = prefix + fm.wrapper_prefix
    for keys in (incompatible.missing_keys, incompatible.unexpected_keys):
        keys[:] = [prefix + k[len(inner) :] if k.startswith(inner) else k for k in keys]


def extra_state(fm: FSLRModule) -> dict[str, Any]:
    """The wrapper's own state: EMA, readout roles, omega generators, configuration and the
    readout scale applied (if any), with tensors under the bare model's names."""
    bare = fm.name_prefix
    return {
        "version": STATE_VERSION,
        "config": fm.config(),
        "ema": _renamed(fm.ema.state_dict(), lambda n: n.removeprefix(bare)),
        "readout_roles": {n.removeprefix(bare): r for n, r in fm.readout_roles.items()},
        "generators": {k: g.get_state() for k, g in fm.generators.items()},
        # the seed of generators not made yet (none before the first probe): a run resumed
        # into a wrapper built without seed= draws the saved run's omegas
        "seed": fm.seed,
        "probes": fm.probes,
        "resolved_strategy": fm.resolved_strategy,
        "readout_scales": {
            n.removeprefix(bare): getattr(m, READOUT_SCALE_MARK)
            for n, m in fm.module.named_modules()
            if hasattr(m, READOUT_SCALE_MARK)
        },
    }


def _restored_generators(saved: Mapping[str, Any]) -> dict[str, torch.Generator]:
    """The omega generators of a saved state, per device. The generator of a device this
    machine lacks (a GPU run's state loaded on a CPU) is left out with a warning: probes
    there draw a fresh sequence from the wrapper's seed, as a new run's would."""
    generators: dict[str, torch.Generator] = {}
    for key, generator_state in saved.items():
        if generator_state is None:
            continue
        try:
            generator = torch.Generator(device=torch.device(key))
        except RuntimeError as e:
            warnings.warn(
                f"this FSLRModule state holds the omega generator of {key}, which this "
                f"machine cannot make ({e}): probes on {key} start a fresh omega sequence "
                f"from the seed; the averages and the other generators are restored",
                RuntimeWarning,
                stacklevel=4,
            )
            continue
        generator.set_state(generator_state)
        generators[key] = generator
    return generators


def load_extra_state(fm: FSLRModule, state: Any, strict: bool) -> None:
    """Restore :func:`extra_state` into ``fm`` after checking its configuration.

    Raises:
        ValueError: a state of another fslr_func version, or (``strict``) saved by a wrapper
            with another configuration (each difference named).
    """
    if state is None:  # a bare model's state dict: the wrapper's state stays as it is
        return
    if not isinstance(state, dict) or state.get("version") not in (1, 2, STATE_VERSION):
        raise ValueError("this FSLRModule state was saved by an incompatible fslr_func version")
    saved = state.get("config", {})
    differ = {k: (v, saved[k]) for k, v in fm.config().items() if k in saved and saved[k] != v}
    if differ and strict:
        listed = "; ".join(f"{k}: this wrapper {v!r}, saved {w!r}" for k, (v, w) in differ.items())
        raise ValueError(
            f"the FSLRModule state was saved with another configuration ({listed}): build "
            f"the wrapper with the saved settings, or load with strict=False to keep this "
            f"wrapper's settings and the saved averages"
        )
    if "exact" in differ.get("estimator", ()):
        own, other = differ["estimator"]
        raise ValueError(
            f"the FSLRModule state was saved with estimator {other!r} and this "
            f"wrapper uses {own!r}: exact values and a sampled estimator's statistics "
            "are different averages, which strict=False cannot carry over; build the wrapper "
            f"with estimator={other!r}, or load the bare model's state dict "
            "(without the wrapper's state)"
        )
    prefix = fm.name_prefix if state["version"] == STATE_VERSION else ""
    # everything is read and checked before anything changes: a refused state leaves fm as it was
    try:
        ema = copy.copy(fm.ema)  # its load rebinds the copy's fields, never fm.ema's
        ema.load_state_dict(_renamed(state["ema"], lambda n: prefix + n))
        ema.beta = fm.beta
        roles = {prefix + n: r for n, r in state["readout_roles"].items()}
        saved_generators = state.get("generators", {"cpu": state.get("generator")})
        generators = _restored_generators(saved_generators)
        probes = int(state.get("probes", 0))
        seed = int(state.get("seed", fm.seed))
        scales = {prefix + n: float(c) for n, c in state.get("readout_scales", {}).items()}
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        raise ValueError(
            f"this FSLRModule state is damaged or edited ({type(e).__name__}: {e}); load the "
            "state as it was saved"
        ) from e
    if probes < 0:
        raise ValueError(f"this FSLRModule state's 'probes' is {probes}, not a count (>= 0)")
    vars(fm.ema).update(vars(ema))
    fm.readout_roles, fm.generators, fm.probes = roles, generators, probes
    fm._readout_searched = bool(roles)
    fm.seed = seed
    fm.reported = DropReports({n: int(v) for n, v in fm.ema.dropped.items()})
    fm.resolved_strategy = state.get("resolved_strategy", fm.options.strategy)
    if "readout_scales" in state:  # the weights loaded are scaled where the saved ones were
        for name, module in fm.module.named_modules():
            if name in scales:
                setattr(module, READOUT_SCALE_MARK, scales[name])
            elif hasattr(module, READOUT_SCALE_MARK):
                delattr(module, READOUT_SCALE_MARK)
