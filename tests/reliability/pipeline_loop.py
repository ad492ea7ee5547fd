"""A program that drives a pipeline until it is stopped: `python pipeline_loop.py NAME`.
Prints READY once requests flow (the signal tests stop it with os.killpg)."""

import faulthandler
import signal
import sys
import threading

import torch

from omnistage import Pipeline

faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hang at exit shows its stacks
# Ctrl+C as in a terminal: a runner started in the background (`nohup ... &`, some CI launchers)
# passes SIGINT down ignored, and a program that inherits that never stops on it
signal.signal(signal.SIGINT, signal.default_int_handler)
p = Pipeline.from_yaml(sys.argv[1])
started = threading.Event()


def drive() -> None:
    while True:
        try:
            p.run({"x": torch.randn(4096, 8)}, timeout=60)  # 128 KiB: shared-memory segments
        except Exception:  # noqa: BLE001 - the pipeline closes under us when the signal lands
            return
        started.set()


# a careful program's own threads block the stop signals too: CPython acts on a signal only in
# the main thread, and one taken by another thread never wakes the main thread's join() below
threads = [threading.Thread(target=drive, daemon=True) for _ in range(3)]
previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
for t in threads:
    t.start()
signal.pthread_sigmask(signal.SIG_SETMASK, previous)
started.wait(120)
print("READY", flush=True)
for t in threads:
    t.join()
