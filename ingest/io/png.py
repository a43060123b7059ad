"""A small PNG line chart (numpy and zlib only), for plots a command writes beside its
numbers: panels stacked top to bottom, each with its curves in fixed colours."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

import numpy as np

COLOURS = ((31, 119, 180), (255, 127, 14), (44, 160, 44))  # blue, orange, green
WIDTH, PANEL_HEIGHT, MARGIN = 640, 160, 12
FRAME = (200, 200, 200)

Curve = Sequence[tuple[float, float]]  # (x, y) points in x order


def encode_png(pixels: np.ndarray) -> bytes:
    """An RGB uint8 array [height, width, 3] as PNG bytes."""
    height, width, _ = pixels.shape

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    rows = np.concatenate([np.zeros((height, 1), np.uint8),  # filter type 0 per row
                           pixels.reshape(height, width * 3)], axis=1)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(rows.tobytes(), 6)) + chunk(b"IEND", b""))


def _segment(canvas: np.ndarray, a: tuple[int, int], b: tuple[int, int],
             colour: tuple[int, int, int]) -> None:
    n = max(abs(b[0] - a[0]), abs(b[1] - a[1])) + 1
    xs = np.linspace(a[0], b[0], n).round().astype(int)
    ys = np.linspace(a[1], b[1], n).round().astype(int)
    for dx in (0, 1):  # two pixels thick
        for dy in (0, 1):
            canvas[ys + dy, xs + dx] = colour


def line_panels(panels: Sequence[Sequence[Curve]]) -> bytes:
    """One panel per entry, each curve of a panel in `COLOURS` order, both axes scaled to
    the panel's points; a lone point is drawn as a dot."""
    height = len(panels) * (PANEL_HEIGHT + MARGIN) + MARGIN
    canvas = np.full((height, WIDTH, 3), 255, np.uint8)
    for i, curves in enumerate(panels):
        top = MARGIN + i * (PANEL_HEIGHT + MARGIN)
        left, right, bottom = MARGIN, WIDTH - MARGIN, top + PANEL_HEIGHT
        canvas[top, left:right] = canvas[bottom, left:right] = FRAME
        canvas[top:bottom, left] = canvas[top:bottom, right] = FRAME
        points = [p for curve in curves for p in curve]
        if not points:
            continue
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        x0, y0 = min(xs), min(ys)
        x_span, y_span = (max(xs) - x0) or 1, (max(ys) - y0) or 1
        inner_w, inner_h = right - left - 10, PANEL_HEIGHT - 8
        for curve, colour in zip(curves, COLOURS, strict=False):
            spots = [(left + 4 + round((x - x0) / x_span * inner_w),
                      top + 4 + inner_h - round((y - y0) / y_span * inner_h)) for x, y in curve]
            for a, b in zip(spots, spots[1:], strict=False):
                _segment(canvas, a, b, colour)
            if len(spots) == 1:
                x, y = spots[0]
                canvas[y - 2:y + 3, x - 2:x + 3] = colour
    return encode_png(canvas)
