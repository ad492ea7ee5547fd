"""Model resolution: local paths, hub ids (local cache only) and built-in tiny recipes."""
