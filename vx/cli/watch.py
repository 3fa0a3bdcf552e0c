"""`vx inspect OUT --watch` and `--plot`: the display of vx/monitor/watch.py and vx/monitor/plot.py."""

from __future__ import annotations

import json
import sys


def _eta(s) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def lines(poll) -> list[str]:
    total = f"/{poll.total:,}" if poll.total is not None else ""
    head = (f"{'ended' if poll.ended else 'running'}: {poll.samples:,}{total} samples  "
            f"{poll.samples_per_s:,.1f} samples/s  {poll.tokens_per_s:,.0f} tok/s"
            + (f"  MFU {poll.mfu:.1%}" if poll.mfu is not None else "") + f"  ETA {_eta(poll.eta_s)}")
    out = [head]
    for r in poll.rows:
        total = f"/{r['total']:,}" if r.get("total") is not None else ""
        out.append(f"  {r['partition']:<22} {r['state']:<8} {r['samples']:,}{total}  {r['samples_per_s']:,.1f}/s"
                   + (f"  MFU {r['mfu']:.1%}" if r.get("mfu") is not None and r["state"] == "running" else "")
                   + (f"  {r['bad_records']:,} bad" if r.get("bad_records") else "")
                   + (f"  {r['host']}" if r.get("host") else ""))
    out += [f"  ! {f}" for f in poll.flags]
    return out


def run_watch(output: str, endpoint_url, watch: bool, interval: float, stall_after: float, plot, json_out: bool):
    from vx.monitor.watch import Watch

    w = Watch(output, endpoint_url, stall_after)
    if watch:
        if json_out:
            def show(poll):
                print(json.dumps(poll.to_json()), flush=True)
        elif sys.stdout.isatty():
            from rich.console import Console
            from rich.live import Live

            live = Live(console=Console(), auto_refresh=False)
            live.start()

            def show(poll):
                live.update("\n".join(lines(poll)), refresh=True)
        else:
            def show(poll):
                print("\n".join(lines(poll)), flush=True)
        try:
            w.run(interval, show)
        finally:
            if not json_out and sys.stdout.isatty():
                live.stop()
    if plot:
        from vx.monitor.plot import plot as draw
        from vx.store.progress_log import read_progress

        drawn = draw(read_progress(output, src=w.src, history=True)["history"], plot, f"vx: {output}")
        print(json.dumps(drawn) if json_out else f"plot         {drawn['plot']}: {drawn['writers']} writers, "
              f"{drawn['points']} points over {drawn['minutes']:,.1f} min ({', '.join(drawn['panels'])})")
