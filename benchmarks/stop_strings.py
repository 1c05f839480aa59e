"""Stop-string matching cost per token, as the output grows: the Aho-Corasick matcher vs the previous
find-and-rescan matcher (kept here, verbatim in behaviour, as the baseline). No model: tokens are 4-character
pieces of text that never complete a stop string but keep re-entering their prefixes (the worst case).

    python benchmarks/stop_strings.py [--chars 30000] [--stop-len 256] [--json out.json]

CHECK: the automaton's per-token time at the end of the output is within 3x of its time at the start
(cost proportional to the new text, not to the output or stop length).
"""

from __future__ import annotations

import platform

from pagedserve.benchmarks import common
from pagedserve.engine.tokenizer import StopStringMatcher


class RescanMatcher:
    """The matcher before the automaton: search the tail again and test every suffix, per token."""

    def __init__(self, stop: list[str]) -> None:
        self.stop, self.longest = stop, max((len(s) for s in stop), default=0)
        self.text, self.sent, self.stopped = "", 0, False

    def feed(self, delta: str) -> None:
        start = max(0, len(self.text) - self.longest + 1)
        self.text += delta
        cut = min((i for i in (self.text.find(s, start) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:cut], True

    def take(self, final: bool) -> str:
        pending = 0
        for k in range(min(self.longest - 1, len(self.text)), 0, -1):
            if any(s.startswith(self.text[-k:]) for s in self.stop):
                pending = k
                break
        end = len(self.text) if final or self.stopped else max(self.sent, len(self.text) - pending)
        piece, self.sent = self.text[self.sent:end], end
        return piece


def per_token_us(matcher, chars: int, window: int = 500) -> tuple[float, float]:
    """Mean microseconds per token over the first `window` tokens (after 50 of warm-up) and the last `window`."""
    piece = "abca"  # re-enters the prefixes of the stop strings below without completing one

    def token() -> None:
        matcher.feed(piece)
        matcher.take(final=False)

    times = [common.timed(token) for _ in range(chars // len(piece))]
    assert not matcher.stopped
    return (sum(times[50:50 + window]) / window * 1e6, sum(times[-window:]) / window * 1e6)


def main(argv: list[str] | None = None) -> None:
    ap = common.parser(__doc__, rounds=None, baseline=False)
    ap.add_argument("--chars", type=int, default=30_000)
    ap.add_argument("--stop-len", type=int, default=256)
    args = ap.parse_args(argv)
    stops = lambda n: [("abca" * n)[:n - 1] + "Z", ("bcab" * n)[:n - 1] + "Y", ("cabc" * n)[:n - 1] + "X",
                       ("abc" * n)[:n - 1] + "W"]
    rows = []
    for name, cls, n in (("automaton", StopStringMatcher, args.stop_len), ("rescan", RescanMatcher, args.stop_len),
                         ("automaton", StopStringMatcher, 100_000), ("rescan", RescanMatcher, 100_000)):
        first, last = per_token_us(cls(stops(n)), args.chars)
        rows.append({"matcher": name, "stop_len": n, "first_us": first, "last_us": last})
    common.table(["matcher", "stop len", "us/token first 500", "us/token last 500"],
                 [[r["matcher"], r["stop_len"], f"{r['first_us']:.1f}", f"{r['last_us']:.1f}"] for r in rows],
                 f"stop-string matching, 4 stops, {args.chars} output chars in 4-char tokens; "
                 f"python {platform.python_version()}")
    ours = rows[0]
    ok = ours["last_us"] <= 3 * ours["first_us"]
    print(f"CHECK per-token cost flat with output length (last/first = {ours['last_us'] / ours['first_us']:.2f} "
          f"<= 3): {'PASS' if ok else 'FAIL'}")
    for n in (args.stop_len, 100_000):
        a, b = (next(r for r in rows if r["matcher"] == m and r["stop_len"] == n) for m in ("automaton", "rescan"))
        print(f"speed-up at {args.chars} chars, stop length {n}: {b['last_us'] / a['last_us']:.0f}x")
    common.write_json(args.json, {"rows": rows, "flat": ok})


if __name__ == "__main__":
    main()
