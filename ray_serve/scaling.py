"""Autoscaling on what a stage replica's engine holds, not on Serve's ongoing calls.

A request occupies its stage replica between `open` and its last emit, but the Serve calls
it makes there are short (`open`, `deliver`) or shared (one `listen` stream per driver), so
Serve's own count of ongoing requests says little about load. Each replica reports the
requests it holds (`record_autoscaling_stats` in replica.py); this policy asks for enough
replicas that each holds `target_ongoing_requests`. Serve applies min/max replicas and the
up/down-scaling delays around it.
"""

from __future__ import annotations

import math
from typing import Any

METRIC = "omnistage_requests_held"
POLICY_PATH = "omnistage.ray_serve.scaling:engine_requests_policy"


def engine_requests_policy(ctx: Any) -> tuple[int, dict[str, Any]]:
    """ctx: ray.serve.config.AutoscalingContext."""
    held = (ctx.aggregated_metrics or {}).get(METRIC)
    total = sum(held.values()) if held else float(ctx.total_num_requests)
    target = ctx.config.get_target_ongoing_requests()
    return max(0, math.ceil(total / target)), {}
