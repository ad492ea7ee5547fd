"""Stage engines: what a stage computes. See stages/base.py for the protocol."""
