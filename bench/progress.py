"""Progress over a sweep: a tqdm bar on a terminal when tqdm is installed, else (logs, CI, no
tqdm) one counter line per case."""

from __future__ import annotations

import sys
import time

try:
    from tqdm import tqdm
except ImportError:  # optional: the counter lines below do the same job in logs
    tqdm = None


class Progress:
    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.done, self.t0 = total, desc, 0, time.perf_counter()
        self.bar = (tqdm(total=total, desc=desc, unit="case", dynamic_ncols=True,
                         file=sys.stderr) if tqdm is not None and sys.stderr.isatty() else None)

    def start(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=True)
        else:
            print(f"[{self.desc} {self.done + 1}/{self.total} "
                  f"{time.perf_counter() - self.t0:6.1f}s] {label}", flush=True)

    def finish(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def close(self) -> float:
        if self.bar is not None:
            self.bar.close()
        return time.perf_counter() - self.t0
