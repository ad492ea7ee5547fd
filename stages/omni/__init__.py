"""Qwen2.5-Omni stage kinds: audio/vision encoders, thinker, talker and token2wav."""
