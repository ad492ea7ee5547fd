"""omnistage: multi-stage generative pipelines (omni speech, diffusion) served from YAML graphs.

The repository root is this package; its folders are subpackages:
graph/ (YAML spec and validation), stages/ (engines), runtime/ (workers and transport),
serving/ (HTTP app and CLI), streaming/ (chunk encoders), kernels/, models/ (tiny recipes).
"""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy so that `import omnistage` stays cheap (the CLI's `validate` must not load torch).
    if name == "Pipeline":
        from omnistage.runtime.pipeline import Pipeline

        return Pipeline
    if name == "OutputChunk":
        from omnistage.runtime.pipeline import OutputChunk

        return OutputChunk
    raise AttributeError(name)


__all__ = ["Pipeline", "OutputChunk", "__version__"]
