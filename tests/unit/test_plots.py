"""The panels every plot of the platform is drawn with (what-if curves, loop rewards)."""

from __future__ import annotations

import matplotlib.image

from ingest.io.plots import Curve, Panel, panels_figure, save_panels

REWARD = Panel("rollout/raw_reward", "raw_reward", [
    Curve("original", [0, 1, 2], [0.1, 0.5, 0.9]),
    Curve("what-if", [0, 1], [0.2, 0.4], linestyle="--"),
])
KEPT = Panel("groups kept", "groups", [Curve("original", [0, 1, 2], [3, 3, 2])],
             ylim=(0, 4))


def test_each_panel_has_its_title_labels_legend_and_curves():
    figure = panels_figure([REWARD, KEPT, REWARD], columns=2, title="run r")
    visible = [a for a in figure.axes if a.get_visible()]
    assert len(figure.axes) == 4 and len(visible) == 3  # 2x2 grid, the fourth cell hidden
    reward, kept = visible[0], visible[1]
    assert reward.get_title() == "rollout/raw_reward" and kept.get_title() == "groups kept"
    assert (reward.get_xlabel(), reward.get_ylabel()) == ("step", "raw_reward")
    assert [t.get_text() for t in reward.get_legend().get_texts()] == ["original", "what-if"]
    original, what_if = reward.get_lines()
    assert list(original.get_xdata()) == [0, 1, 2]
    assert list(what_if.get_ydata()) == [0.2, 0.4] and what_if.get_linestyle() == "--"
    assert original.get_color() != what_if.get_color()
    assert kept.get_ylim() == (0, 4)
    assert all(tick == int(tick) for tick in reward.get_xticks())  # steps are whole
    assert figure.get_suptitle() == "run r"


def test_saved_as_png_of_the_figure_size(tmp_path):
    path = save_panels(tmp_path / "curves.png", [REWARD, KEPT], columns=2,
                       panel_size=(3, 2))
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    height, width, _ = matplotlib.image.imread(path).shape
    assert (width, height) == (600, 200)  # two 3x2 inch panels side by side at 100 dpi
