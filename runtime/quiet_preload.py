"""Imported first by the worker fork server (runtime/fork_server.py): the quiet defaults of
runtime/third_party_output.py in its environment, before it imports the libraries that read
them, so that every worker inherits them."""

from omnistage.runtime.third_party_output import quiet_environment

quiet_environment()
