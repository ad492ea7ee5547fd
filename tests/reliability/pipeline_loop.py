"""A program that drives a pipeline until it is stopped: `python pipeline_loop.py NAME`.
Prints READY once requests flow (the signal tests stop it with os.killpg)."""

import faulthandler
import signal
import sys
import threading

import torch

from omnistage import Pipeline

faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hang at exit shows its stacks
p = Pipeline.from_yaml(sys.argv[1])
started = threading.Event()


def drive() -> None:
    while True:
        try:
            p.run({"x": torch.randn(4096, 8)}, timeout=60)  # 128 KiB: shared-memory segments
        except Exception:  # noqa: BLE001 - the pipeline closes under us when the signal lands
            return
        started.set()


threads = [threading.Thread(target=drive, daemon=True) for _ in range(3)]
for t in threads:
    t.start()
started.wait(120)
print("READY", flush=True)
for t in threads:
    t.join()
