"""Depth-mapping policies: identity, share_blocks (conservation), equal(_all), resolve, apply."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import cast

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fslr_func import policies
from fslr_func.training.policies import (
    DEFAULT_PATTERN,
    POLICIES,
    Policy,
    apply,
    equal,
    equal_all,
    identity,
    resolve,
    share_blocks,
)

SETTINGS = settings(max_examples=50, deadline=None)

positive = st.floats(min_value=1e-6, max_value=1e3, allow_nan=False, allow_infinity=False)
ROLES = ("attn.weight", "mlp.weight", "mlp.bias")


def model_names(depth: int, stack: str = "blocks") -> list[str]:
    """Tensor names of a toy residual model with ``depth`` blocks, in named_parameters order."""
    names = ["embed.weight"]
    for i in range(depth):
        names += [f"{stack}.{i}.{r}" for r in ROLES]
    return [*names, "norm.weight", "head.weight"]


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


@st.composite
def base_values(draw: st.DrawFn, depth: int) -> dict[str, float]:
    return {n: draw(positive) for n in model_names(depth)}


# ---------------------------------------------------------------------------------- identity


@SETTINGS
@given(
    names=st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=8, unique=True),
    data=st.data(),
)
def test_identity_round_trip(names: list[str], data: st.DataObject) -> None:
    base = {n: data.draw(positive) for n in names}
    order = data.draw(st.permutations(names))
    out = identity(base, order)
    assert list(out) == list(order)
    assert out == base
    assert apply(identity, base, order) == out


@SETTINGS
@given(
    names=st.lists(st.text(min_size=1, max_size=10), min_size=2, max_size=8, unique=True),
    data=st.data(),
)
def test_identity_error_lists_missing_and_extra(names: list[str], data: st.DataObject) -> None:
    k = data.draw(st.integers(1, len(names) - 1))
    base_names, only_scaled = names[:k], names[k:]
    dropped = data.draw(st.lists(st.sampled_from(base_names), unique=True, max_size=k - 1))
    base = dict.fromkeys(base_names, 1.0)
    scaled = [n for n in base_names if n not in dropped] + only_scaled
    with pytest.raises(ValueError) as info:
        identity(base, scaled)
    msg = str(info.value)
    # only the parts that list names: never an empty "[]" (one side may have none)
    assert "record: []" not in msg and "model: []" not in msg
    assert ("base tensors absent from the scaled model:" in msg) == bool(dropped)
    missing_part, _, extra_part = msg.partition("base tensors absent from the scaled model:")
    for n in only_scaled[:10]:
        assert repr(n) in missing_part
    for n in dropped[:10]:
        assert repr(n) in extra_part


def test_identity_error_message_is_actionable() -> None:
    with pytest.raises(ValueError, match=r"missing from the base record: \['x'\]") as info:
        identity({"w": 1.0, "v": 1.0}, ["w", "x"])
    assert "absent from the scaled model: ['v']" in str(info.value)
    assert "share_blocks" in str(info.value)
    with pytest.raises(ValueError, match="unique"):
        identity({"w": 1.0}, ["w", "w"])


def test_a_policy_that_edits_the_names_it_is_given_is_still_checked_against_all() -> None:
    def drops_one(base: Mapping[str, float], scaled: Sequence[str]) -> dict[str, float]:
        names = cast(list, scaled)
        names.pop()  # it escaped the missing-names check, which read the same list
        return {n: 1.0 for n in names}

    with pytest.raises(ValueError, match=r"without a target: \['b'\]"):
        policies.apply(drops_one, {"a": 1.0, "b": 1.0}, ["a", "b"])


# ---------------------------------------------------------------------------------- share_blocks


def answering(n_base: int, n_scaled: int) -> dict[int, list[int]]:
    """Base block -> scaled blocks answering to it (independent reference, for L >= B)."""
    out: dict[int, list[int]] = defaultdict(list)
    for ll in range(n_scaled):
        out[math.floor(ll * n_base / n_scaled)].append(ll)
    return out


@SETTINGS
@given(n_base=st.integers(1, 6), n_scaled=st.integers(1, 24), data=st.data())
def test_share_blocks_conservation(n_base: int, n_scaled: int, data: st.DataObject) -> None:
    base = data.draw(base_values(n_base))
    scaled = model_names(n_scaled)
    out = share_blocks()(base, scaled)
    # every scaled tensor gets a target, names round trip in order
    assert list(out) == scaled
    assert all(v > 0 and math.isfinite(v) for v in out.values())
    # block-less tensors map one to one
    for n in ("embed.weight", "norm.weight", "head.weight"):
        assert out[n] == base[n]
    # totals per role and overall are conserved for any B, L
    for r in ROLES:
        assert close(
            sum(out[f"blocks.{i}.{r}"] for i in range(n_scaled)),
            sum(base[f"blocks.{i}.{r}"] for i in range(n_base)),
        )
    assert close(sum(out.values()), sum(base.values()))
    if n_scaled >= n_base:
        groups = answering(n_base, n_scaled)
        assert sorted(groups) == list(range(n_base))  # every base block used, in order
        sizes = {len(v) for v in groups.values()}
        assert sizes <= {n_scaled // n_base, -(-n_scaled // n_base)}
        for m, ls in groups.items():
            assert ls == list(range(ls[0], ls[-1] + 1))  # contiguous
            for r in ROLES:
                # the scaled tensors answering to one base tensor sum to its value, equally
                targets = [out[f"blocks.{ll}.{r}"] for ll in ls]
                assert close(sum(targets), base[f"blocks.{m}.{r}"])
                assert all(close(t, base[f"blocks.{m}.{r}"] / len(ls)) for t in targets)


@SETTINGS
@given(n_base=st.integers(1, 6), n_scaled=st.integers(1, 24), data=st.data())
def test_counterparts_are_the_base_tensors_a_target_is_made_of(
    n_base: int, n_scaled: int, data: st.DataObject
) -> None:
    """``share_blocks`` and ``equal``: each scaled target is the sum over its counterparts
    ``c`` of ``base[c] / (number of scaled tensors answering to c)``, deeper or shallower."""
    base = data.draw(base_values(n_base))
    scaled = model_names(n_scaled)
    for policy, values in ((share_blocks(), base), (equal(), dict.fromkeys(base, 1 / len(base)))):
        links = policies.counterparts(policy, list(base), scaled)
        assert list(links) == scaled and all(links.values())
        sharing = defaultdict(int)
        for bases in links.values():
            for b in bases:
                sharing[b] += 1
        out = policy(base, scaled)
        for n, bases in links.items():
            assert close(out[n], sum(values[b] / sharing[b] for b in bases)), (policy, n)


def test_counterparts_of_identity_custom_and_broken_policies() -> None:
    base, scaled = ["w", "v"], ["w", "u"]
    assert policies.counterparts(identity, base, scaled) == {"w": ("w",)}
    assert policies.counterparts(lambda b, s: {}, base, scaled) == {"w": ("w",)}  # by name

    def custom(b: Mapping[str, float], s: Sequence[str]) -> dict[str, float]:
        return {}

    for wrong, message in (
        (lambda b, s: 3, "returned int"),
        (lambda b, s: {"w": "w"}, "'w': 'w'"),  # a string is not a sequence of names
        (lambda b, s: {"w": ("x",)}, "'w': \\('x',\\)"),  # not a base tensor
        (lambda b, s: {"x": ("w",)}, "'x'"),  # not a scaled tensor
    ):
        custom.counterparts = wrong  # type: ignore[attr-defined]
        with pytest.raises(ValueError, match=message):
            policies.counterparts(cast(Policy, custom), base, scaled)


@SETTINGS
@given(n_base=st.integers(2, 12), data=st.data())
def test_share_blocks_shallower_sums_base_blocks(n_base: int, data: st.DataObject) -> None:
    n_scaled = data.draw(st.integers(1, n_base - 1))
    base = data.draw(base_values(n_base))
    out = share_blocks()(base, model_names(n_scaled))
    # base block m goes to scaled block floor(m L / B): contiguous, order preserving, onto
    owner = [math.floor(m * n_scaled / n_base) for m in range(n_base)]
    assert owner == sorted(owner) and set(owner) == set(range(n_scaled))
    for ll in range(n_scaled):
        ms = [m for m in range(n_base) if owner[m] == ll]
        for r in ROLES:
            expect = sum(base[f"blocks.{m}.{r}"] for m in ms)
            assert close(out[f"blocks.{ll}.{r}"], expect)
    assert close(sum(out.values()), sum(base.values()))


def test_share_blocks_shallower_example() -> None:
    base = {f"blocks.{m}.w": float(10**m) for m in range(6)}
    out = share_blocks()(base, [f"blocks.{i}.w" for i in range(4)])
    # 0,1 -> 0 ; 2 -> 1 ; 3,4 -> 2 ; 5 -> 3
    assert list(out.values()) == [11.0, 100.0, 11000.0, 100000.0]


@SETTINGS
@given(depth=st.integers(1, 8), data=st.data())
def test_share_blocks_equals_identity_at_same_depth(depth: int, data: st.DataObject) -> None:
    base = data.draw(base_values(depth))
    assert share_blocks()(base, model_names(depth)) == identity(base, model_names(depth))


def test_share_blocks_paper_example_4x_deeper() -> None:
    base = {"blocks.0.w": 1.0, "blocks.1.w": 0.5}
    scaled = [f"blocks.{i}.w" for i in range(8)]
    out = share_blocks()(base, scaled)
    assert [out[n] for n in scaled] == [0.25] * 4 + [0.125] * 4


def test_share_blocks_non_integer_ratio() -> None:
    base = {f"blocks.{m}.w": float(2**m) for m in range(4)}
    out = share_blocks()(base, [f"blocks.{i}.w" for i in range(6)])
    # 0,1 -> 0 ; 2 -> 1 ; 3,4 -> 2 ; 5 -> 3
    assert list(out.values()) == [0.5, 0.5, 2.0, 2.0, 2.0, 8.0]


def test_share_blocks_default_pattern_recognises_common_names() -> None:
    p = share_blocks()
    for base_names, scaled_names in [
        (
            ["transformer.h.0.attn.c_attn.weight"],
            [f"transformer.h.{i}.attn.c_attn.weight" for i in range(2)],
        ),
        (
            ["encoder.layer.0.output.dense.weight"],
            [f"encoder.layer.{i}.output.dense.weight" for i in range(2)],
        ),
        (["layers.0.weight"], ["layers.0.weight", "layers.1.weight"]),
        (["block.0.conv.weight"], ["block.0.conv.weight", "block.1.conv.weight"]),
    ]:
        assert p(dict.fromkeys(base_names, 1.0), scaled_names) == dict.fromkeys(scaled_names, 0.5)
    # 'layer1' (a torchvision stage) is not a block list: one to one
    assert p({"layer1.0.w": 1.0}, ["layer1.0.w"]) == {"layer1.0.w": 1.0}
    with pytest.raises(ValueError, match=r"layer1\.1\.w"):
        p({"layer1.0.w": 1.0}, ["layer1.0.w", "layer1.1.w"])


def test_share_blocks_independent_stacks_and_non_contiguous_indices() -> None:
    base = {"enc.layers.0.w": 1.0, "enc.layers.1.w": 1.0, "dec.layers.0.w": 3.0}
    scaled = ["enc.layers.0.w", "enc.layers.1.w", "enc.layers.2.w", "enc.layers.3.w"]
    scaled += ["dec.layers.0.w", "dec.layers.1.w", "dec.layers.2.w"]
    out = share_blocks()(base, scaled)
    assert [out[n] for n in scaled] == [0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 1.0]
    # block indices are ranked, not used as positions
    out = share_blocks()({"blocks.5.w": 2.0}, ["blocks.10.w", "blocks.20.w"])
    assert out == {"blocks.10.w": 1.0, "blocks.20.w": 1.0}


def test_share_blocks_custom_pattern() -> None:
    p = share_blocks(r"\.res(\d+)\.")
    out = p({"net.res0.w": 1.0, "net.head": 2.0}, ["net.res0.w", "net.res1.w", "net.head"])
    assert out == {"net.res0.w": 0.5, "net.res1.w": 0.5, "net.head": 2.0}
    with pytest.raises(ValueError, match="no group"):
        share_blocks(r"blocks\.\d+")
    with pytest.raises(ValueError, match="invalid block pattern"):
        share_blocks(r"(")
    with pytest.raises(ValueError, match="group 1 must capture the block index"):
        share_blocks(r"blocks\.(\w+)\.")({"blocks.a.w": 1.0}, ["blocks.a.w"])


def test_share_blocks_errors_name_tensors() -> None:
    p = share_blocks()
    base = {"embed.weight": 1.0, "blocks.0.mlp.weight": 1.0, "blocks.0.attn.weight": 1.0}
    # a scaled role not in the base, a base role absent, a block-less name missing
    scaled = ["emb.weight", "blocks.0.mlp.weight", "blocks.1.mlp.weight", "blocks.0.norm.weight"]
    with pytest.raises(ValueError) as info:
        p(base, scaled)
    msg = str(info.value)
    assert "outside blocks missing from the base record: ['emb.weight']" in msg
    assert "absent from the scaled model: ['embed.weight']" in msg
    assert "blocks.*.norm.weight" in msg and "'blocks.0.norm.weight'" in msg
    assert "blocks.*.attn.weight" in msg
    assert DEFAULT_PATTERN in msg or "block pattern" in msg
    # heterogeneous blocks: block 1 of the scaled model lacks a tensor that its base block has
    base = {"blocks.0.w": 1.0, "blocks.0.b": 1.0, "blocks.1.w": 1.0, "blocks.1.b": 1.0}
    with pytest.raises(ValueError, match=r"'blocks.1.b'.*scaled block 1"):
        p(base, ["blocks.0.w", "blocks.0.b", "blocks.1.w"])
    with pytest.raises(ValueError, match=r"'blocks.1.b'.*base block 1"):
        p({"blocks.0.w": 1.0, "blocks.0.b": 1.0, "blocks.1.w": 1.0}, list(base))


# ---------------------------------------------------------------------------------- equal


@SETTINGS
@given(
    n_base=st.integers(1, 6),
    n_scaled=st.integers(1, 24),
    total=st.floats(min_value=1e-3, max_value=1e3),
    data=st.data(),
)
def test_equal_sums_to_total_and_keeps_embedding(
    n_base: int, n_scaled: int, total: float, data: st.DataObject
) -> None:
    base = data.draw(base_values(n_base))  # values are ignored
    n = len(base)
    eq = {k: total / n for k in base}
    assert close(sum(eq.values()), total)
    out = equal(total)(base, model_names(n_scaled))
    assert list(out) == model_names(n_scaled)
    assert close(sum(out.values()), total)  # conserved over depth
    for name in ("embed.weight", "norm.weight", "head.weight"):
        assert close(out[name], total / n)  # independent of depth
    assert out == pytest.approx(share_blocks()(eq, model_names(n_scaled)))


def test_equal_errors() -> None:
    with pytest.raises(ValueError, match="total"):
        equal(0.0)
    with pytest.raises(ValueError, match="total"):
        equal(math.nan)
    for bad in ("x", None, True):  # a string or None gave float()'s own error; True read as 1
        with pytest.raises(ValueError, match=rf"total must be a finite number > 0, got {bad!r}"):
            equal(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no tensors"):
        equal()({}, ["w"])
    with pytest.raises(ValueError, match=r"missing from the base record: \['v'\]"):
        equal()({"w": 1.0}, ["w", "v"])


@SETTINGS
@given(
    names=st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=30, unique=True),
    total=st.floats(min_value=1e-3, max_value=1e3),
)
def test_equal_all_sums_to_total(names: list[str], total: float) -> None:
    out = equal_all(total)({"ignored": 5.0}, names)
    assert list(out) == names
    assert len(set(out.values())) == 1
    assert close(sum(out.values()), total)
    assert equal_all()({}, []) == {}
    with pytest.raises(ValueError, match="total"):
        equal_all(-1.0)


# ---------------------------------------------------------------------------------- resolve / apply


def test_resolve() -> None:
    assert resolve(None) is identity
    assert resolve("identity") is identity
    base = {"blocks.0.w": 1.0}
    scaled = ["blocks.0.w", "blocks.1.w"]
    assert resolve("share_blocks")(base, scaled) == {"blocks.0.w": 0.5, "blocks.1.w": 0.5}
    assert resolve("equal")(base, scaled) == {"blocks.0.w": 0.5, "blocks.1.w": 0.5}
    assert resolve("equal_all")(base, ["a", "b"]) == {"a": 0.5, "b": 0.5}
    # passing a factory itself builds it with defaults
    assert resolve(share_blocks)(base, scaled) == {"blocks.0.w": 0.5, "blocks.1.w": 0.5}
    assert resolve(equal_all)(base, ["a"]) == {"a": 1.0}

    def mine(base: Mapping[str, float], scaled: Sequence[str]) -> dict[str, float]:
        return dict.fromkeys(scaled, 1.0)

    assert resolve(mine) is mine
    p: Policy = mine  # custom callables satisfy the protocol (checked by mypy)
    assert p(base, ["x"]) == {"x": 1.0}
    assert set(POLICIES) == {"identity", "share_blocks", "equal", "equal_all"}
    for bad in ("shareblocks", "", 3):
        with pytest.raises(ValueError) as info:
            resolve(bad)  # type: ignore[arg-type]
        for name in POLICIES:
            assert repr(name) in str(info.value)


def test_apply_validates_custom_policies() -> None:
    base = {"w": 1.0, "b": 2.0}
    scaled = ["w", "b"]
    assert apply(None, base, iter(scaled)) == base
    assert apply("identity", base, scaled) == base
    # tensors and ints are converted to float
    out = apply(cast(Policy, lambda b, s: {"w": torch.tensor(3.0), "b": 1}), base, scaled)
    assert out == {"w": 3.0, "b": 1.0} and all(type(v) is float for v in out.values())

    def bad_type(b: Mapping[str, float], s: Sequence[str]) -> dict[str, float]:
        return [1.0, 2.0]  # type: ignore[return-value]

    cases = [
        (bad_type, r"bad_type returned list"),
        (lambda b, s: {"w": 1.0}, r"without a target: \['b'\]"),
        (lambda b, s: {"w": 1.0, "b": 1.0, "z": 1.0}, r"not in the scaled model: \['z'\]"),
        (lambda b, s: {"w": 0.0, "b": 1.0}, r"not finite numbers > 0: 'w' = 0.0"),
        (lambda b, s: {"w": 1.0, "b": -2.0}, r"'b' = -2.0"),
        (lambda b, s: {"w": math.nan, "b": math.inf}, r"'w' = nan, 'b' = inf"),
        (lambda b, s: {"w": "1.0", "b": 1.0}, r"'w' = '1.0'"),
        (lambda b, s: {"w": None, "b": 1.0}, r"'w' = None"),
        (lambda b, s: {"w": True, "b": 1.0}, r"'w' = True"),
        (lambda b, s: {"w": torch.ones(2), "b": 1.0}, r"'w' = tensor"),
    ]
    for policy, match in cases:
        with pytest.raises(ValueError, match=match):
            apply(policy, base, scaled)  # type: ignore[arg-type]
    # only the side that has names is listed (no "names not in the scaled model: []")
    with pytest.raises(ValueError, match=r"without a target: \['b'\]$"):
        apply(lambda b, s: {"w": 1.0}, base, scaled)

    def broken(b: Mapping[str, float], s: Sequence[str]) -> dict[str, float]:
        raise KeyError("blocks.9.w")

    with pytest.raises(KeyError) as info:  # the policy's own error, saying whose it is
        apply(broken, base, scaled)
    assert "raised by policy" in "".join(info.value.__notes__)
    assert "broken" in "".join(info.value.__notes__)
    with pytest.raises(ValueError, match="unique"):
        apply(identity, base, ["w", "w"])
    # a base FSLR of zero gives a zero target: rejected, naming the tensor
    with pytest.raises(ValueError, match=r"identity gave targets.*'w' = 0.0"):
        apply("identity", {"w": 0.0, "b": 1.0}, scaled)


def test_policies_module_exports() -> None:
    for name in policies.__all__:
        assert hasattr(policies, name)


def test_hold_under_share_blocks_holds_the_tensor_answering_to_an_unknown_base_block() -> None:
    # A one-block model answers to base blocks 0, 1 and 2, block 1 unknown: unknown="hold"
    # summed the known two into a target of 2 instead of holding it, and the note named base
    # tensors the scaled model lacks
    import warnings

    import fslr_func as ff

    def net(depth: int) -> torch.nn.Module:
        torch.manual_seed(0)
        blocks = [torch.nn.Linear(6, 6) for _ in range(depth)]
        return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Sequential(*blocks))

    names = [n for n, _ in net(3).named_parameters()]
    fslr: dict[str, list[float | None]] = {n: [1.0] for n in names}
    fslr["1.1.weight"] = [None]
    record = ff.FSLRRecord(steps=[0], fslr=fslr, meta={"base_lr": 1e-2})
    fm = ff.with_fslr(net(1), samples=2, seed=0)
    opt = torch.optim.Adam(fm.parameters(), lr=1e-2)
    with pytest.warns(RuntimeWarning, match=r"\['1\.0\.weight'\] answer to base tensors whose"):
        flerm = ff.FLeRM(
            fm, opt, record, probe_batches=[torch.randn(8, 4)], warmup_samples=2,
            policy=share_blocks(r"^1\.(\d+)\."), unknown="hold",
        )  # fmt: skip
    fm(torch.randn(8, 4)).square().mean().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with flerm.step():
            opt.step()
    point = flerm.history[0]
    assert point.targets["1.0.weight"] == 0.0 and "1.0.weight" in point.held
    assert point.targets["1.0.bias"] == pytest.approx(3.0)  # the sum of the three base blocks
