"""Autoregressive LM engine: paged KV cache, continuous batching, prefix cache, chunked prefill."""

from omnistage.stages.ar.config import EngineConfig, ModelConfig, SamplingParams
from omnistage.stages.ar.sequence import RequestOutput

__all__ = ["EngineConfig", "LLMEngine", "ModelConfig", "RequestOutput", "SamplingParams"]


def __getattr__(name):
    # LLMEngine pulls in the model code; import it lazily so `import omnistage.stages.ar` stays light.
    if name == "LLMEngine":
        from omnistage.stages.ar.engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
