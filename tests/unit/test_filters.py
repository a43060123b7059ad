"""Filter chain, built-in DAPO filter, Miles sample views and filter loading."""

from __future__ import annotations

import math
import sys
import textwrap
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ingest.core.filters import (
    DynamicFilterOutput,
    FilterArgs,
    FilterOutput,
    MilesSample,
    apply_filter_chain,
    clear_filter_cache,
    flatten,
    load_filter,
    miles_group,
    reward_nonzero_std,
)
from ingest.core.model import FilterVerdict, Fragment, Group, Rollout
from schemas.errors import FilterLoadError
from schemas.events import DAPO_FILTER_PATH, MILES_DAPO_FILTER_ALIASES, RunConfig

# ---------------------------------------------------------------- group builders


@dataclass
class Aborted:
    """An aborted rollout in a group spec; `reward` is whatever reward it carries."""

    reward: Any = None
    reason: str = "timeout"
    fragments: int = 0


def _rollout(rid: int, spec: Any) -> Rollout:
    """A plain value is a one-fragment rollout; a list is one compacted rollout whose
    fragments all carry the list's (shared) reward; `Aborted` is an aborted rollout."""
    if isinstance(spec, Aborted):
        r = Rollout(rollout_id=rid, status="aborted", reward=spec.reward, sample_index=rid)
        r.abort_reason = spec.reason
        n_frags = spec.fragments
    elif isinstance(spec, list):
        assert spec and all(x == spec[0] for x in spec), "siblings share one reward"
        r = Rollout(rollout_id=rid, status="completed", reward=spec[0], sample_index=rid)
        n_frags = len(spec)
    else:
        r = Rollout(rollout_id=rid, status="completed", reward=spec, sample_index=rid)
        n_frags = 1
    for i in range(n_frags):
        r.fragments[i] = Fragment(
            rollout_id=rid,
            fragment_index=i,
            prompt_tokens=[100, 101],
            response_tokens=[rid * 10 + i] * (i + 1),
        )
    r.fragment_count, r.reward_known = max(n_frags, 1), True
    return r


def make_group(*specs: Any, group_index: int = 7) -> Group:
    g = Group(run_id="run", group_index=group_index, step=0, n_samples=len(specs), started=True)
    for rid, spec in enumerate(specs):
        g.rollouts[rid] = _rollout(rid, spec)
    return g


class Spy:
    """A user filter that records its calls and returns a fixed result."""

    def __init__(self, result: Any = True):
        self.result = result
        self.calls: list[tuple[Any, Any, dict[str, Any]]] = []

    def __call__(self, args: Any, samples: Any, **kwargs: Any) -> Any:
        self.calls.append((args, samples, kwargs))
        return self.result


def args_for(reward_key: str | None = None, **extra: Any) -> FilterArgs:
    return FilterArgs.from_config(
        RunConfig(n_samples_per_prompt=2, rollout_batch_size=1, reward_key=reward_key, **extra)
    )


# ---------------------------------------------------------------- MILES 4.2 conformance

MISSING = "group_has_missing_reward"


@pytest.mark.parametrize(
    ("specs", "reward_key", "reason"),
    [
        ([Aborted(None), 1.0], None, "group_has_aborted"),
        ([Aborted(1.0)], None, "group_has_aborted"),
        ([Aborted(None)], None, "group_has_aborted"),  # aborted check runs first
        ([Aborted(1.0, fragments=2), 1.0], None, "group_has_aborted"),
        ([None], None, MISSING),
        ([1.0, [None]], None, MISSING),  # nested
        ([{"score": None}], "score", MISSING),
        # CONTRACT precedence: a dict lacking reward_key is missing, not KeyError.
        ([{"other": 1.0}], "score", MISSING),
        ([{"score": 1.0}, {"score": 0.0}], None, MISSING),  # dict with no key configured
        ([1.0, {"score": 1.0}], None, MISSING),
    ],
)
def test_chain_drops_before_user_filter(specs: list[Any], reward_key: str | None, reason: str):
    spy = Spy(True)
    verdict = apply_filter_chain(args_for(reward_key), make_group(*specs), spy)
    assert verdict == FilterVerdict(False, reason)
    assert spy.calls == []


@pytest.mark.parametrize(
    ("specs", "reason"),
    [
        ([[1.0, 1.0]], "zero_std_1.0"),
        ([0.0, 0.0, 0.0, 0.0], "zero_std_0.0"),
        ([0, 0], "zero_std_0"),
        ([True, True], "zero_std_1"),
        ([-1, -1], "zero_std_-1"),
        ([0.96, 0.96], "zero_std_1.0"),
        ([0.04, 0.04], "zero_std_0.0"),
        ([1.0, 1.0 + 1e-9], "zero_std_1.0"),  # std 7.07e-10 <= 1e-8
        ([1.0], "zero_std_1.0"),  # n=1: NaN std, always dropped
        ([0], "zero_std_0"),
        ([[2.5, 2.5], 2.5], "zero_std_2.5"),
    ],
)
def test_std_filter_drops_zero_std(specs: list[Any], reason: str):
    verdict = apply_filter_chain(args_for(), make_group(*specs), reward_nonzero_std)
    assert verdict == FilterVerdict(False, reason, counted=True)


@pytest.mark.parametrize(
    "specs", [[1.0, 2.0], [0, 1], [True, False], [[1.0, 1.0], 0.0], [1.0, 1.0 + 1e-6]]
)
def test_std_filter_keeps_varied_rewards(specs: list[Any]):
    assert apply_filter_chain(args_for(), make_group(*specs), reward_nonzero_std) == (
        FilterVerdict(True, None)
    )


def test_std_filter_reads_rewards_through_reward_key():
    keep = make_group({"score": 1.0, "x": 5}, {"score": 0.0, "x": 5})
    drop = make_group({"score": 0, "x": 1}, {"score": 0, "x": 2})
    assert apply_filter_chain(args_for("score"), keep, reward_nonzero_std).keep
    assert apply_filter_chain(args_for("score"), drop, reward_nonzero_std) == FilterVerdict(
        False, "zero_std_0"
    )


def test_std_filter_counts_every_fragment_not_every_rollout():
    # Rollout rewards [1, 0] have std > 0 either way, but [1, 1, 1, 0] fragments vs the
    # rollouts' [1, 0] differ in std; the filter must see all four fragments in order.
    samples = miles_group(make_group([1.0, 1.0, 1.0], 0.0))
    assert [s.reward for s in flatten(samples)] == [1.0, 1.0, 1.0, 0.0]
    assert reward_nonzero_std(args_for(), samples) == FilterOutput(keep=True)


def test_no_filter_keeps_valid_group():
    assert apply_filter_chain(args_for(), make_group(1.0, 0.0), None) == FilterVerdict(True)


def test_user_false_is_an_uncounted_drop():
    verdict = apply_filter_chain(args_for(), make_group(1.0, 0.0), Spy(False))
    assert verdict == FilterVerdict(False, None, counted=False)


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        (FilterOutput(False, "too_easy"), FilterVerdict(False, "too_easy")),
        (FilterOutput(True, "why_not"), FilterVerdict(True, "why_not")),
        (FilterOutput(True), FilterVerdict(True)),
        (FilterOutput(False), FilterVerdict(False, None, counted=False)),
        (FilterOutput(False, ""), FilterVerdict(False, None, counted=False)),
        (DynamicFilterOutput(False, "alias"), FilterVerdict(False, "alias")),
        (np.bool_(True), FilterVerdict(True)),
        (np.bool_(False), FilterVerdict(False, None, counted=False)),
        (True, FilterVerdict(True)),
    ],
)
def test_user_result_becomes_verdict(output: Any, expected: FilterVerdict):
    assert apply_filter_chain(args_for(), make_group(1.0, 0.0), Spy(output)) == expected


def test_user_result_duck_typed_filter_output():
    @dataclass
    class OtherFilterOutput:  # e.g. Miles' own class
        keep: bool
        reason: str | None = None

    verdict = apply_filter_chain(args_for(), make_group(1.0), Spy(OtherFilterOutput(False, "x")))
    assert verdict == FilterVerdict(False, "x")


@pytest.mark.parametrize("bad", ["yes", None, 1, {"keep": True}])
def test_user_result_of_wrong_type_raises(bad: Any):
    with pytest.raises(TypeError, match="expected bool or FilterOutput"):
        apply_filter_chain(args_for(), make_group(1.0), Spy(bad))


def test_user_filter_called_once_with_args_group_and_kwargs():
    spy, marker, args = Spy(True), object(), args_for()
    group = make_group(1.0, [0.0, 0.0])
    apply_filter_chain(args, group, spy, marker=marker)
    assert len(spy.calls) == 1
    called_args, samples, kwargs = spy.calls[0]
    assert called_args is args
    assert kwargs == {"marker": marker}
    assert isinstance(samples[0], MilesSample)
    assert isinstance(samples[1], list) and len(samples[1]) == 2


def test_user_filter_exceptions_propagate():
    def boom(args: Any, samples: Any, **kwargs: Any) -> bool:
        raise RuntimeError("user bug")

    with pytest.raises(RuntimeError, match="user bug"):
        apply_filter_chain(args_for(), make_group(1.0), boom)


def test_reward_nonzero_std_on_empty_group_raises():
    with pytest.raises(ValueError, match="empty group"):
        reward_nonzero_std(args_for(), [])


def test_reward_nonzero_std_accepts_kwargs_and_miles_dict_reward_keyerror():
    samples = miles_group(make_group({"other": 1.0}, {"other": 2.0}))
    # Called directly (outside the chain) it behaves like Miles: the missing key raises.
    with pytest.raises(KeyError, match="score"):
        reward_nonzero_std(args_for("score"), samples, extra=1)


# ---------------------------------------------------------------- properties

finite = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False)


@given(value=st.one_of(finite, st.integers(-5, 5), st.booleans()), n=st.integers(1, 8))
def test_constant_group_is_dropped_with_first_reward_reason(value: Any, n: int):
    verdict = apply_filter_chain(args_for(), make_group(*[value] * n), reward_nonzero_std)
    assert verdict == FilterVerdict(False, f"zero_std_{round(value, 1)}")


@given(st.lists(finite, min_size=2, max_size=12), st.randoms())
def test_std_filter_decision_is_permutation_invariant(rewards: list[float], rnd: Any):
    shuffled = rewards[:]
    rnd.shuffle(shuffled)
    a = apply_filter_chain(args_for(), make_group(*rewards), reward_nonzero_std)
    b = apply_filter_chain(args_for(), make_group(*shuffled), reward_nonzero_std)
    assert a.keep == b.keep


@given(st.lists(finite, min_size=2, max_size=12))
def test_std_filter_keeps_any_spread_above_1e_6(rewards: list[float]):
    # Unbiased std >= range / sqrt(2(n-1)), so a range > 1e-6 with n <= 12 beats 1e-8.
    verdict = apply_filter_chain(args_for(), make_group(*rewards), reward_nonzero_std)
    if max(rewards) - min(rewards) > 1e-6:
        assert verdict == FilterVerdict(True)
    elif len(set(rewards)) == 1:
        assert not verdict.keep


@given(
    st.lists(st.one_of(st.none(), finite, st.just({"score": 1.0})), min_size=0, max_size=6),
    st.integers(0, 6),
)
def test_any_abort_decides_first(rewards: list[Any], where: int):
    specs: list[Any] = list(rewards)
    specs.insert(min(where, len(specs)), Aborted(1.0))
    spy = Spy(True)
    assert apply_filter_chain(args_for("score"), make_group(*specs), spy) == FilterVerdict(
        False, "group_has_aborted"
    )
    assert spy.calls == []


@given(st.lists(st.one_of(finite, st.integers(-3, 3), st.booleans()), min_size=1, max_size=8))
def test_valid_rewards_reach_user_filter_once(rewards: list[Any]):
    spy = Spy(FilterOutput(False, "mine"))
    assert apply_filter_chain(args_for(), make_group(*rewards), spy) == FilterVerdict(False, "mine")
    assert len(spy.calls) == 1
    assert [s.reward for s in flatten(spy.calls[0][1])] == rewards


# ---------------------------------------------------------------- Miles sample views


def test_miles_group_nesting_order_and_shared_reward():
    g = Group(run_id="r", group_index=3, started=True, n_samples=3, prompt="p?", label="42")
    g.metadata = {"src": "ds", "k": "group"}
    late = Rollout(rollout_id=0, status="truncated", reward=0.5, sample_index=9)
    late.metadata = {"k": "rollout"}
    early = Rollout(rollout_id=1, status="completed", reward={"score": 1}, sample_index=4)
    for i in (1, 0):  # arrival order must not matter
        early.fragments[i] = Fragment(1, i, [1], [2, 3], loss_mask=[1, 0], metadata={"f": i})
    late.fragments[0] = Fragment(0, 0, [7, 8], [9])
    empty = Rollout(rollout_id=2, status="aborted", sample_index=None)
    g.rollouts = {0: late, 1: early, 2: empty}

    samples = miles_group(g)
    assert [type(s) for s in samples] == [list, MilesSample, MilesSample]
    first, second, third = samples
    assert [s.metadata["f"] for s in first] == [0, 1]
    assert all(s.reward == {"score": 1} and s.status == "completed" for s in first)
    assert all(s.rollout_id == 1 and s.index == 4 and s.group_index == 3 for s in first)
    assert first[0].tokens == [1, 2, 3] and first[0].response_length == 2
    assert first[0].loss_mask == [1, 0] and first[0].effective_response_length == 1
    assert first[0].metadata == {"src": "ds", "k": "group", "f": 0}
    assert second.tokens == [7, 8, 9] and second.status == MilesSample.Status.TRUNCATED
    assert second.metadata == {"src": "ds", "k": "rollout"}
    assert second.effective_response_length == 1 and second.loss_mask is None
    assert second.prompt == "p?" and second.label == "42"
    assert third.status == "aborted" and third.status == MilesSample.Status.ABORTED
    assert third.status.value == "aborted"
    assert third.reward is None and third.tokens == [] and third.response_length == 0


def test_miles_samples_are_copies():
    g = make_group({"score": [1.0]}, 0.0)
    g.rollouts[0].metadata["m"] = [1]
    s = flatten(miles_group(g))[0]
    s.reward["score"].append(2.0)
    s.metadata["m"].append(2)
    s.tokens.append(99)
    assert g.rollouts[0].reward == {"score": [1.0]}
    assert g.rollouts[0].metadata == {"m": [1]}
    assert g.rollouts[0].fragments[0].prompt_tokens == [100, 101]


def test_miles_group_rejects_unfinished_rollout():
    g = make_group(1.0)
    g.rollouts[0].status = None
    with pytest.raises(ValueError, match="rollout 0 is not finished"):
        miles_group(g)


@pytest.mark.parametrize(
    ("reward", "key", "expected"),
    [
        (1.0, None, 1.0),
        (True, None, True),
        ({"score": 0.25}, "score", 0.25),
        ({"score": 0.25}, None, {"score": 0.25}),
        (0.5, "score", 0.5),  # a plain number is used as is even with a key configured
        (None, "score", None),
    ],
)
def test_get_reward_value(reward: Any, key: str | None, expected: Any):
    s = MilesSample(group_index=0, index=0, rollout_id=0, status=MilesSample.Status.COMPLETED)
    s.reward = reward
    assert s.get_reward_value(args_for(key)) == expected


def test_get_reward_value_missing_key_raises_keyerror():
    s = MilesSample(0, 0, 0, MilesSample.Status.COMPLETED, reward={"other": 1})
    with pytest.raises(KeyError):
        s.get_reward_value(args_for("score"))


def test_filter_args_from_config_has_fields_and_extras():
    cfg = RunConfig(
        n_samples_per_prompt=4, rollout_batch_size=8, reward_key="acc", my_threshold=0.3
    )
    args = FilterArgs.from_config(cfg)
    assert args.n_samples_per_prompt == 4 and args.rollout_batch_size == 8
    assert args.reward_key == "acc" and args.my_threshold == 0.3
    assert args.over_sampling_batch_size == 8  # resolved default, as Miles does
    assert args.advantage_estimator == "grpo" and args.std_normalization is True
    assert args.dynamic_sampling_filter_path is None and args.partial_rollout is False
    for name in RunConfig.model_fields:
        assert hasattr(args, name)
    with pytest.raises(AttributeError):
        _ = args.not_a_field
    assert "my_threshold=0.3" in repr(args)
    assert args == FilterArgs.from_config(cfg)


# ---------------------------------------------------------------- loading


@pytest.fixture
def user_module(tmp_path: Any, monkeypatch: pytest.MonkeyPatch):
    """A throwaway importable package `userfilters_<id>` with a few module variants."""
    name = f"userfilters_{id(tmp_path)}"
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "good.py").write_text(
        textwrap.dedent(
            """
            IMPORTS = []
            IMPORTS.append(1)
            NOT_CALLABLE = 3

            def keep_all(args, samples, **kwargs):
                return True

            class Holder:
                @staticmethod
                def drop(args, samples, **kwargs):
                    return False
            """
        )
    )
    (pkg / "broken.py").write_text("raise RuntimeError('module is broken')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    clear_filter_cache()
    yield name
    clear_filter_cache()
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]


def test_load_filter_none_and_builtin_aliases():
    assert load_filter(None) is None
    assert load_filter(DAPO_FILTER_PATH) is reward_nonzero_std
    for alias in MILES_DAPO_FILTER_ALIASES:
        assert load_filter(alias) is reward_nonzero_std


def test_load_filter_dotted_and_colon_paths(user_module: str):
    fn = load_filter(f"{user_module}.good.keep_all")
    assert fn is not None and fn(None, []) is True
    assert load_filter(f"{user_module}.good:keep_all") is fn
    assert load_filter(f"{user_module}.good:Holder.drop")(None, []) is False  # type: ignore[misc]


def test_load_filter_caches(user_module: str):
    path = f"{user_module}.good.keep_all"
    fn = load_filter(path)
    del sys.modules[f"{user_module}.good"]  # a re-import would build a new function object
    assert load_filter(path) is fn


@pytest.mark.parametrize(
    ("suffix", "why"),
    [
        (".missing_module.fn", "cannot import module"),
        (".good.nope", "has no attribute 'nope'"),
        (".good.NOT_CALLABLE", "is not callable (got int)"),
        (".broken.fn", "raised RuntimeError: module is broken"),
        (".good:Holder.nope", "has no attribute 'Holder.nope'"),
    ],
)
def test_load_filter_errors_name_path_and_reason(user_module: str, suffix: str, why: str):
    path = user_module + suffix
    with pytest.raises(FilterLoadError) as info:
        load_filter(path)
    message = str(info.value)
    assert repr(path) in message and why in message
    assert "\n" not in message


@pytest.mark.parametrize("path", ["nodots", "", ".leading", "trailing.", "mod:"])
def test_load_filter_rejects_malformed_paths(path: str):
    with pytest.raises(FilterLoadError, match="is not of the form"):
        load_filter(path)


def test_load_filter_failure_not_cached(user_module: str, tmp_path: Any):
    path = f"{user_module}.later.fn"
    with pytest.raises(FilterLoadError):
        load_filter(path)
    (tmp_path / user_module / "later.py").write_text("def fn(args, samples):\n    return 1\n")
    import importlib

    importlib.invalidate_caches()
    assert load_filter(path)(None, []) == 1  # type: ignore[misc]


@pytest.mark.parametrize("reward", [1.0, 0, True])
def test_one_fragment_group_dropped_without_numpy_warning(reward: Any):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "Degrees of freedom <= 0" noise in processor logs
        verdict = reward_nonzero_std(args_for(), miles_group(make_group(reward)))
    assert verdict == FilterOutput(False, f"zero_std_{round(reward, 1)}")


def test_nan_reward_is_dropped_not_kept():
    verdict = apply_filter_chain(args_for(), make_group(math.nan, 1.0), reward_nonzero_std)
    assert verdict.keep is False and verdict.reason == "zero_std_nan"
