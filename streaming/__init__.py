"""omnistage.streaming: encoders that turn stage outputs into bytes for clients.

images.py (PNG/JPEG/WebP), video.py (MP4 H.264, incremental fMP4), audio.py (PCM16, WAV),
sse.py (server-sent events framing). Pure functions and small stateful muxers; no serving code.
"""
