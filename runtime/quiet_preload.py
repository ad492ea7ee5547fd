"""Imported first by the worker fork server (runtime/fork_server.py), before its seconds of
library imports:
- the quiet defaults of runtime/third_party_output.py in its environment, before the libraries
  that read them, so that every worker inherits them;
- SIGINT ignored. multiprocessing's fork server ignores it only once its imports are done, so
  a Ctrl+C during them (`omnistage serve` starts it first thing) printed a second
  KeyboardInterrupt traceback, the fork server's. Its parent decides when it goes."""

import signal

from omnistage.runtime.third_party_output import quiet_environment

quiet_environment()
signal.signal(signal.SIGINT, signal.SIG_IGN)
