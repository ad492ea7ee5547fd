"""Validate one `stages:` entry: kind, model, pool, batching, params -> StageSpec + its ports."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from omnistage.graph import fields as F
from omnistage.graph.checks import Report, did_you_mean
from omnistage.graph.nodes import MapNode, Node, ScalarNode, SeqNode, describe, plain
from omnistage.graph.spec import (
    BATCHING_POLICIES,
    PIPELINE_INPUTS,
    PIPELINE_OUTPUTS,
    BatchingSpec,
    ModelRef,
    PoolSpec,
    SourcePos,
    StageSpec,
)
from omnistage.stages.base import Port


@dataclass
class StageInfo:
    """A stage as validation sees it. ports are None when the kind could not be resolved,
    so wiring checks skip that stage instead of cascading errors."""

    spec: StageSpec
    key_pos: SourcePos
    inputs: dict[str, Port] | None = None
    outputs: dict[str, Port] | None = None
    ok: bool = True
    kind_label: str = ""
    extra: dict = field(default_factory=dict)


def check_stage(name: str, key_pos: SourcePos, node: Node, report: Report, base_dir: Path | None) -> StageInfo:
    where = f"stages.{name}"
    spec = StageSpec(name=name, kind="", pos=key_pos)
    info = StageInfo(spec=spec, key_pos=key_pos)
    if not re.match(F.NAME_PATTERN, name):
        report.add(
            key_pos,
            f"stage name {name!r} is not valid (letters, digits, _ and -, starting "
            "with a letter or _; no dots: edges write stage.port)",
        )
        info.ok = False
    elif name in (PIPELINE_INPUTS, PIPELINE_OUTPUTS):
        report.add(key_pos, f"stage name {name!r} is reserved (edges use {name}.PORT for the pipeline's own ports)")
        info.ok = False
    m = report.mapping(node, where, key_pos)
    if m is None:
        if isinstance(node, ScalarNode) and node.value is None:
            report.add(key_pos, f"{where}: missing required field 'kind'")
        info.ok = False
        return info
    report.keys(m, F.STAGE, where, key_pos)

    cls = None
    kind_node = m.get("kind")
    if kind_node is not None:
        ok, kind = report.scalar(kind_node, F.STAGE["kind"], f"{where}.kind")
        if ok:
            spec.kind = kind
            info.kind_label = kind
            cls = _stage_class(kind, kind_node.pos, report)
    if cls is None:
        info.ok = False

    if m.get("model") is not None:
        spec.model = _model(m.get("model"), f"{where}.model", report, base_dir)
    if cls is not None and getattr(cls, "needs_model", False) and spec.model is None and m.get("model") is None:
        report.add(
            key_pos, f"{where}: stage kind {spec.kind!r} needs a model (model: <local path | hub id | tiny:recipe>)"
        )

    pool_node = m.get("pool")
    if pool_node is not None:
        spec.pool = _pool(pool_node, f"{where}.pool", report)

    spec.batching = _batching(
        m.get("batching"), cls, spec.kind, f"{where}.batching", m.key_pos.get("batching", key_pos), report
    )

    params_at = m.key_pos.get("params", key_pos)
    params_node = m.get("params")
    params_ok = True
    if params_node is not None:
        pm = report.mapping(params_node, f"{where}.params", params_at)
        params_ok = pm is not None
        spec.params = plain(pm) if pm is not None else {}
    if cls is not None and params_ok:
        _kind_params_and_ports(cls, spec, info, params_at, where, report, pm if params_node is not None else None)
    else:
        info.ok = False

    defaults_node = m.get("request_defaults")
    if defaults_node is not None:
        defaults_at = m.key_pos.get("request_defaults", key_pos)
        dm = report.mapping(defaults_node, f"{where}.request_defaults", defaults_at)
        if dm is None:
            info.ok = False
        else:
            spec.request_defaults = plain(dm)
            accepted = cls.request_params_for(spec.params) if cls is not None else None
            if accepted is not None and not _request_defaults_ok(accepted, spec.request_defaults, dm, where, report):
                info.ok = False
    return info


def _request_defaults_ok(accepted, defaults: dict, node, where: str, report: Report) -> bool:
    """Each default is a request parameter of the kind with a value it accepts; the rules
    across values (min <= max) are left to each request, which may override either side."""
    ok = True
    for key, value in defaults.items():
        why = accepted.key_problem(key, value)
        if why:
            pos = node.entries[key].pos if key in accepted else node.key_pos[key]
            report.add(pos, f"{where}.request_defaults: {why}")
            ok = False
    return ok


def _stage_class(kind: str, pos: SourcePos, report: Report):
    from omnistage.stages.registry import KIND_MODULES, get_stage_class, known_kinds

    known = known_kinds()
    if kind not in known:
        report.add(pos, f"unknown stage kind {kind!r}{did_you_mean(kind, known)}; known kinds: {', '.join(known)}")
        return None
    try:
        return get_stage_class(kind)
    except KeyError:
        report.add(pos, f"stage kind {kind!r}: module {KIND_MODULES.get(kind)} did not register it")
    except BaseException as exc:  # noqa: BLE001 - a broken kind module must not crash validation
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        report.add(
            pos, f"stage kind {kind!r} could not be loaded from {KIND_MODULES.get(kind)}: {type(exc).__name__}: {exc}"
        )
    return None


def _kind_params_and_ports(
    cls, spec: StageSpec, info: StageInfo, params_at: SourcePos, where: str, report: Report, params: MapNode | None
) -> None:
    try:
        messages = list(cls.validate_params(dict(spec.params)) or [])
    except Exception as exc:  # noqa: BLE001
        messages = [f"validate_params raised {type(exc).__name__}: {exc}"]
    for message in messages:
        report.add(_param_pos(params, message, params_at), f"{where}.params: {message}")
    if messages:
        info.ok = False
    try:
        info.inputs, info.outputs = cls.ports(dict(spec.params))
    except Exception as exc:  # noqa: BLE001
        info.ok = False
        if not messages:  # with bad params a failing ports() is expected, not news
            report.add(
                params_at, f"{where}.params: kind {spec.kind!r} could not derive its ports: {type(exc).__name__}: {exc}"
            )


def _param_pos(params: MapNode | None, message: str, default: SourcePos) -> SourcePos:
    """Where a kind's message about its params points (the kinds say which param in words):
    the value of the param the message starts with, else the key of the first one it quotes
    (an unknown name); else the params block."""
    if params is None:
        return default
    for key, node in params.entries.items():
        if message.startswith((f"{key} ", f"{key}:", f"{key}.")):
            return node.pos
    quoted = [(message.find(f"{key!r}"), key) for key in params.entries if f"{key!r}" in message]
    return params.key_pos.get(min(quoted)[1], default) if quoted else default


# -- model ---------------------------------------------------------------------------------
def _model(node: Node, where: str, report: Report, base_dir: Path | None) -> ModelRef | None:
    if isinstance(node, ScalarNode) and isinstance(node.value, str):
        return _model_source(node, where, report, base_dir, None, None)
    if isinstance(node, MapNode):
        report.keys(node, F.MODEL, where, node.pos)
        values = report.fields(node, F.MODEL, where)
        source_node = node.get("source")
        if source_node is None or "source" not in values:
            return None
        return _model_source(
            source_node, f"{where}.source", report, base_dir, values.get("subfolder"), values.get("prefix")
        )
    report.add(
        node.pos,
        f"{where} must be a string (path, hub id or tiny:recipe) or a mapping "
        f"{{source, subfolder, prefix}}, got {describe(node)}",
    )
    return None


def _model_source(
    node: ScalarNode, where: str, report: Report, base_dir: Path | None, subfolder: str | None, prefix: str | None
) -> ModelRef | None:
    source = node.value.strip()
    if not source:
        report.add(node.pos, f"{where} is empty")
        return None
    if source.startswith("tiny:"):
        from omnistage.models.recipes import known_recipes

        recipe = source[len("tiny:") :]
        known = known_recipes()
        if recipe not in known:
            report.add(
                node.pos,
                f"{where}: unknown tiny recipe {recipe!r}{did_you_mean(recipe, known)}; known: {', '.join(known)}",
            )
            return None
    elif base_dir is not None and (source.startswith("./") or source.startswith("../")):
        source = str((base_dir / source).resolve())
    return ModelRef(source=source, subfolder=subfolder, prefix=prefix, pos=node.pos)


# -- pool ----------------------------------------------------------------------------------
def _pool(node: Node, where: str, report: Report) -> PoolSpec:
    pool = PoolSpec()
    m = report.mapping(node, where, node.pos)
    if m is None:
        return pool
    pool.pos = m.pos
    report.keys(m, F.POOL, where, m.pos)
    values = report.fields(m, F.POOL, where)
    for key in ("replicas", "dtype", "threads", "step_timeout_s"):
        if key in values:
            setattr(pool, key, values[key])
    if m.get("devices") is not None:
        devices = _devices(m.get("devices"), f"{where}.devices", report)
        if devices:
            pool.devices = devices
    if m.get("cpus") is not None:
        pool.cpus = _cpus(m.get("cpus"), f"{where}.cpus", report)  # that they exist: at start
    if m.get("memory") is not None:
        pool.memory = _memory(m.get("memory"), f"{where}.memory", report)
    if m.get("max_rss") is not None:
        pool.max_rss = _memory(m.get("max_rss"), f"{where}.max_rss", report)
    if m.get("autoscaling") is not None:
        pool.autoscaling = _autoscaling(m.get("autoscaling"), f"{where}.autoscaling", report)
    if m.get("resources") is not None:
        pool.resources = _resources(m.get("resources"), f"{where}.resources", report)
    return pool


def _cpus(node: Node, where: str, report: Report) -> list[int] | None:
    value = node.value if isinstance(node, ScalarNode) else None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return [value]
    if isinstance(value, str):
        try:
            return F.parse_cpu_list(value)
        except ValueError as err:
            report.add(node.pos, f"{where}: {err}")
            return None
    if isinstance(node, SeqNode) and node.items:
        cpus = []
        for item in node.items:
            v = item.value if isinstance(item, ScalarNode) else None
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                report.add(item.pos, f"{where}: a CPU id must be an integer >= 0, got {describe(item)}")
                return None
            cpus.append(v)
        return sorted(set(cpus))
    report.add(node.pos, f"{where} must be a list of CPU ids or a string like 0-3,6, got {describe(node)}")
    return None


def _resources(node: Node, where: str, report: Report) -> dict | None:
    m = report.mapping(node, where, node.pos)
    if m is None:
        return None
    amounts = {}
    for name, amount in m.entries.items():
        value = amount.value if isinstance(amount, ScalarNode) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            report.add(amount.pos, f"{where}.{name} must be a number >= 0, got {describe(amount)}")
        else:
            amounts[name] = value
    return amounts


def _autoscaling(node: Node, where: str, report: Report) -> dict | None:
    m = report.mapping(node, where, node.pos)
    if m is None:
        return None
    report.keys(m, F.AUTOSCALING, where, m.pos)
    values = report.fields(m, F.AUTOSCALING, where)
    low, high = values.get("min_replicas", 1), values.get("max_replicas")
    initial = values.get("initial_replicas", low)
    if high is not None and not low <= initial <= high:
        at = (m.get("initial_replicas") or m.get("max_replicas")).pos
        report.add(at, f"{where}: needs min_replicas <= initial_replicas <= max_replicas, got {low}, {initial}, {high}")
    return values


_CUDA_TYPO = re.compile(r"^(?:cuda|gpu|cud|cuda_|cuda-)\s*[:_\- ]?\s*([0-9]+)$", re.I)


def _devices(node: Node, where: str, report: Report) -> list[str]:
    items: list[tuple[str, object]] = []  # (text, position-or-node)
    if isinstance(node, ScalarNode) and isinstance(node.value, str):
        offset = 0
        for part in node.value.split(","):
            lead = len(part) - len(part.lstrip())
            items.append((part.strip(), node.sub_pos(offset + lead)))
            offset += len(part) + 1
    elif isinstance(node, SeqNode):
        for item in node.items:
            if isinstance(item, ScalarNode) and isinstance(item.value, str):
                items.append((item.value.strip(), item.pos))
            else:
                report.add(item.pos, f"{where}: a device must be a string like cpu or cuda:0, got {describe(item)}")
                return []
    else:
        report.add(
            node.pos,
            f"{where} must be a list or a comma-separated string of devices (cpu, cuda, cuda:N), got {describe(node)}",
        )
        return []
    if not items:
        report.add(node.pos, f"{where} is empty; list at least one device")
        return []
    devices = []
    for text, pos in items:
        if re.match(F.DEVICE_PATTERN, text):
            devices.append(text)
            continue
        hint = ""
        typo = _CUDA_TYPO.match(text)
        if typo:
            hint = f" (did you mean 'cuda:{int(typo.group(1))}'?)"
        elif text.lower() in ("gpu", "cuda", "cpu"):
            hint = f" (did you mean {'cuda' if text.lower() == 'gpu' else text.lower()!r}?)"
        elif re.fullmatch(r"cpu\s*[:_\- ]?\s*[0-9]+", text, re.I):  # one CPU device: threads set its cores
            hint = " (did you mean 'cpu'? pool.threads sets how many cores a replica uses)"
        report.add(pos, f"{where}: malformed device {text!r}; expected cpu, cuda or cuda:N{hint}")
    return devices if len(devices) == len(items) else []


def _memory(node: Node, where: str, report: Report) -> str | None:
    if isinstance(node, ScalarNode) and isinstance(node.value, int) and not isinstance(node.value, bool):
        if node.value > 0:
            return str(node.value)
    elif isinstance(node, ScalarNode) and isinstance(node.value, str):
        try:
            if F.memory_bytes(node.value) > 0:
                return node.value.strip()
        except ValueError:
            pass
    report.add(node.pos, f"{where}: {plain(node)!r} is not a memory size; write e.g. 512MiB, 2GiB or a byte count")
    return None


# -- batching ------------------------------------------------------------------------------
def _batching(node: Node | None, cls, kind: str, where: str, at: SourcePos, report: Report) -> BatchingSpec:
    supported = tuple(getattr(cls, "batching_policies", BATCHING_POLICIES)) if cls else BATCHING_POLICIES
    spec = BatchingSpec(policy=supported[0] if supported else "dynamic", pos=at)
    if node is None:
        return spec
    policy_node: Node | None = None
    m: MapNode | None = None
    if isinstance(node, ScalarNode) and isinstance(node.value, str):
        policy_node = node
    else:
        m = report.mapping(node, f"{where}", at)
        if m is None:
            return spec
        spec.pos = m.pos
        policy_node = m.get("policy")
    if policy_node is not None:
        ok, policy = report.scalar(policy_node, F.BATCHING_POLICY, f"{where}.policy")
        if not ok:
            return spec
        if cls is not None and policy not in supported:
            report.add(
                policy_node.pos,
                f"{where}: stage kind {kind!r} does not support batching "
                f"policy {policy!r} (supported: {', '.join(supported)})",
            )
            return spec
        spec.policy = policy
    if m is None:
        return spec
    knobs = F.BATCHING_KNOBS[spec.policy]
    all_knobs = {k for fields in F.BATCHING_KNOBS.values() for k in fields}
    for key, child in m.entries.items():
        if key == "policy":
            continue
        key_pos = m.key_pos[key]
        if key not in knobs:
            owners = [p for p, fields in F.BATCHING_KNOBS.items() if key in fields]
            if owners:
                report.add(
                    key_pos,
                    f"{where}.{key} is a knob of the {' / '.join(owners)} policy, "
                    f"not {spec.policy!r} ({spec.policy} knobs: "
                    f"{', '.join(knobs) or 'none'})",
                )
            else:
                report.add(
                    key_pos, f"unknown key {key!r} in {where}{did_you_mean(key, sorted(all_knobs | {'policy'}))}"
                )
            continue
        ok, value = report.scalar(child, knobs[key], f"{where}.{key}")
        if ok:
            setattr(spec, key, value)
    return spec
