"""Keeps an inference engine from outliving the process that started it.

Run by path with the engine venv's Python (standard library only):
`python engine_guard.py -- CMD...`. The engine runs in a process group of its own; when the
starter goes away (this guard's stdin, a pipe from the starter, reaches end of file - also
after a kill -9) or sends SIGTERM, the whole group ends. A signal to the engine alone would
not do: vLLM's engine-core child processes do not watch their parent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

GRACE_S = 10.0


def _end_group(engine: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(engine.pid, signal.SIGTERM)
        engine.wait(timeout=GRACE_S)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(engine.pid, signal.SIGKILL)  # whatever the engine left behind
    except ProcessLookupError:
        pass


def main(argv: list[str]) -> None:
    if argv[:1] != ["--"] or len(argv) < 2:
        sys.exit("usage: engine_guard.py -- CMD...")
    engine = subprocess.Popen(argv[1:], start_new_session=True, stdin=subprocess.DEVNULL)
    stopping = threading.Event()

    def stop(*_: object) -> None:
        stopping.set()
        _end_group(engine)
        os._exit(0)

    def follow_engine() -> None:
        code = engine.wait()
        if not stopping.is_set():
            _end_group(engine)
            os._exit(code if code >= 0 else 128 - code)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the starter handles Ctrl-C
    threading.Thread(target=follow_engine, daemon=True).start()
    sys.stdin.buffer.read()  # returns at end of file: the starter is gone
    stop()


if __name__ == "__main__":
    main(sys.argv[1:])
