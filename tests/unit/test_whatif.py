"""What-if `--config KEY=VALUE` parsing and the PNG the what-if diff plots with."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

from ingest.core.whatif import parse_what_if
from ingest.io.png import COLOURS, encode_png, line_panels
from schemas.errors import ConfigError, FilterLoadError
from schemas.events import DAPO_FILTER_PATH, RunConfig

ORIGINAL = RunConfig(n_samples_per_prompt=4, rollout_batch_size=2, over_sampling_batch_size=3,
                     dynamic_sampling_filter_path=DAPO_FILTER_PATH, reward_key="score")


def test_every_key_parses_to_its_config_field():
    what_if = parse_what_if([
        "filter=none", "rollout_batch_size=6", "over_sampling_batch_size=8",
        "advantage_estimator=gspo", "std_normalization=false", "reward_key=none",
        "max_staleness=1", "arg.max_len=100", "arg.tag=blue"])
    config = what_if.apply(ORIGINAL)
    assert config.dynamic_sampling_filter_path is None
    assert (config.rollout_batch_size, config.over_sampling_batch_size) == (6, 8)
    assert config.advantage_estimator == "gspo" and config.std_normalization is False
    assert config.reward_key is None and config.max_staleness == 1
    assert config.extra_args == {"max_len": 100, "tag": "blue"}
    assert config.n_samples_per_prompt == 4  # not a what-if key: kept from the run


def test_filter_names_the_builtin_or_a_user_filter():
    assert parse_what_if(["filter=dapo"]).overrides == {
        "dynamic_sampling_filter_path": DAPO_FILTER_PATH}
    user = "tests.support.user_filters.drop_long"
    assert parse_what_if([f"filter={user}"]).apply(ORIGINAL).resolved_filter_path == user
    with pytest.raises(FilterLoadError, match="no.such"):
        parse_what_if(["filter=no.such.fn"])


@pytest.mark.parametrize(("items", "message"), [
    (["batch=3"], "--config 'batch=3': unknown key 'batch' (keys: filter, rollout_batch_size,"),
    (["rollout_batch_size"], "--config 'rollout_batch_size': expected KEY=VALUE"),
    (["rollout_batch_size=0"], "--config 'rollout_batch_size=0': rollout_batch_size must be >= 1"),
    (["max_staleness=soon"], "--config 'max_staleness=soon': max_staleness not an integer"),
    (["advantage_estimator=ppo"], "advantage_estimator must be one of grpo, gspo, "
                                  "reinforce_plus_plus_baseline, none"),
    (["std_normalization=maybe"], "std_normalization must be true or false"),
    (["max_staleness=1", "max_staleness=2"], "max_staleness is given twice"),
    (["arg.reward_key=x"], "reward_key is a config field; pass reward_key=VALUE"),
])
def test_bad_items_are_one_line_errors(items, message):
    with pytest.raises(ConfigError) as err:
        parse_what_if(items)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_contradiction_with_the_run_names_the_fix():
    with pytest.raises(ConfigError) as err:
        parse_what_if(["rollout_batch_size=6"]).apply(ORIGINAL)
    assert "over_sampling_batch_size (3) must be >= rollout_batch_size (6)" in str(err.value)
    assert "\n" not in str(err.value)


def _decode(png: bytes) -> np.ndarray:
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    pos, idat, size = 8, b"", None
    while pos < len(png):
        length, kind = struct.unpack(">I4s", png[pos:pos + 8])
        data = png[pos + 8:pos + 8 + length]
        crc = struct.unpack(">I", png[pos + 8 + length:pos + 12 + length])[0]
        assert crc == zlib.crc32(kind + data)
        if kind == b"IHDR":
            size = struct.unpack(">II", data[:8])
        elif kind == b"IDAT":
            idat += data
        pos += 12 + length
    width, height = size
    rows = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(height, width * 3 + 1)
    assert (rows[:, 0] == 0).all()
    return rows[:, 1:].reshape(height, width, 3)


def test_png_round_trips():
    pixels = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    assert (_decode(encode_png(pixels)) == pixels).all()


def test_line_panels_draw_each_curve_in_its_colour():
    rising, falling = [(0, 0.0), (1, 1.0), (2, 2.0)], [(0, 2.0), (2, 0.0)]
    image = _decode(line_panels([[rising, falling], [[(5, 1.0)], []]]))
    first, second = image[:image.shape[0] // 2], image[image.shape[0] // 2:]

    def where(panel, colour):
        return np.argwhere((panel == colour).all(axis=2))

    blue, orange = where(first, COLOURS[0]), where(first, COLOURS[1])
    assert len(blue) and len(orange)
    # Rising: its leftmost pixels are lower (larger row) than its rightmost.
    assert blue[blue[:, 1].argmin()][0] > blue[blue[:, 1].argmax()][0]
    assert orange[orange[:, 1].argmin()][0] < orange[orange[:, 1].argmax()][0]
    assert len(where(second, COLOURS[0])) == 25  # a lone point is a 5x5 dot
