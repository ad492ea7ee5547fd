"""The OpenAI Realtime protocol (GA events, beta names as aliases) over a websocket, on any
pipeline that `serves: chat` with audio in and out (docs/realtime.md).

events.py (client event models, server event framing), config.py (session configuration),
audio.py (pcm16 / G.711 formats, resampling), buffer.py (input audio buffer), vad.py
(silero-vad batched across sessions, turn detection), conversation.py (items, truncation,
the prompt), overrides.py + response.py (one response from the pipeline's stream),
session.py (the state machine behind one connection). The websocket route is
serving/routes/realtime.py.
"""
