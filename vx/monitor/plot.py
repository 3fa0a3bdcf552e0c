"""`vx inspect OUT --plot FILE.png`: throughput and MFU over time, one line per partition, from
the writers' progress history (vx/store/progress_log.py). Drawn with Pillow (which vLLM
installs), no plotting library needed."""

from __future__ import annotations

from pathlib import Path

from vx.errors import UsageError

W, H, MARGIN_L, MARGIN_R, MARGIN_T, GAP = 1200, 820, 90, 190, 50, 70
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f",
          "#bcbd22"]


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    import math

    span = hi - lo or 1.0
    step = 10 ** math.floor(math.log10(span / n))
    for m in (1, 2, 5, 10):
        if span / (step * m) <= n:
            step *= m
            break
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def _fmt(v: float) -> str:
    return f"{v / 1e6:,.1f}M" if abs(v) >= 1e6 else f"{v / 1e3:,.1f}k" if abs(v) >= 1e4 else f"{v:,.4g}"


def plot(history: dict[str, list[dict]], path: Path, title: str) -> dict:
    """history: writer name -> its snapshots. Writes a PNG; returns what it drew."""
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:
        raise UsageError("--plot draws with Pillow: pip install pillow") from None
    series = {name or "run": [r for r in recs if r.get("updated")] for name, recs in sorted(history.items())}
    series = {k: v for k, v in series.items() if v}
    if not series:
        raise UsageError("no progress history in this output yet (its writers record one every few seconds)")
    t0 = min(r["updated"] for recs in series.values() for r in recs)
    has_mfu = any(r.get("mfu") is not None for recs in series.values() for r in recs)
    panels = [("tokens_per_s", "tokens/s (last 30 s)", 1.0)]
    panels.append(("mfu", "MFU %", 100.0) if has_mfu else ("samples_per_s", "samples/s (last 30 s)", 1.0))
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    font, small = ImageFont.load_default(size=16), ImageFont.load_default(size=13)
    d.text((MARGIN_L, 14), title, fill="black", font=font)
    t_max = max((r["updated"] - t0) / 60 for recs in series.values() for r in recs) or 1.0
    ph = (H - MARGIN_T - GAP - 40) // 2
    for i, (key, label, scale) in enumerate(panels):
        top = MARGIN_T + i * (ph + GAP)
        x0, x1, y0, y1 = MARGIN_L, W - MARGIN_R, top + ph, top
        vals = [(r.get(key) or 0.0) * scale for recs in series.values() for r in recs]
        v_max = max(vals) * 1.1 or 1.0
        d.rectangle([x0, y1, x1, y0], outline="black")
        for v in _ticks(0, v_max):
            y = y0 - (y0 - y1) * v / v_max
            d.line([x0, y, x1, y], fill="#e5e5e5")
            d.text((x0 - 8, y), _fmt(v), fill="black", font=small, anchor="rm")
        for t in _ticks(0, t_max):
            x = x0 + (x1 - x0) * t / t_max
            d.line([x, y0, x, y0 + 5], fill="black")
            d.text((x, y0 + 8), _fmt(t), fill="black", font=small, anchor="mt")
        d.text((x0, y1 - 20), label, fill="black", font=font)
        d.text(((x0 + x1) // 2, y0 + 26), "minutes since the first record", fill="black", font=small, anchor="mt")
        for j, (name, recs) in enumerate(series.items()):
            pts = [(x0 + (x1 - x0) * (r["updated"] - t0) / 60 / t_max,
                    y0 - (y0 - y1) * ((r.get(key) or 0.0) * scale) / v_max) for r in recs]
            color = COLORS[j % len(COLORS)]
            if len(pts) > 1:
                d.line(pts, fill=color, width=2)
            for x, y in pts[-1:]:
                d.ellipse([x - 3, y - 3, x + 3, y + 3], fill=color)
            if i == 0:
                ly = MARGIN_T + 22 * j
                d.line([x1 + 15, ly + 8, x1 + 40, ly + 8], fill=color, width=3)
                d.text((x1 + 46, ly), name, fill="black", font=small)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, format="PNG")
    return {"plot": str(path), "writers": len(series), "points": sum(len(v) for v in series.values()),
            "minutes": round(t_max, 2), "panels": [p[1] for p in panels]}
