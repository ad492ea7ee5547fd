"""The `serves:` section of a pipeline file: which OpenAI API families a pipeline answers and
how each family's request maps onto the pipeline's ports and its stages' per-request params.

    serves:
      chat: {messages: messages, text: text, info: info, params: [llm]}
      completions: {prompt: prompt, text: text, info: info, params: [llm]}
      images: {prompt: prompt, image: image, image_in: init_image, params: [text_encoder, denoiser, vae]}

Each family has fixed roles (FAMILIES below); a role names a pipeline input or output port of
the right type. `params` lists the stages that receive the API's sampling/generation fields:
each listed stage gets the fields its kind declares (stages/params.py), so one request field
such as `seed` reaches every stage that takes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omnistage.graph.checks import Report, did_you_mean
from omnistage.graph.nodes import Node, ScalarNode, SeqNode, describe
from omnistage.graph.spec import SourcePos


@dataclass(frozen=True)
class Role:
    side: str  # "inputs" | "outputs"
    types: tuple[str, ...]  # port types the role accepts
    required: bool = True
    doc: str = ""


@dataclass(frozen=True)
class Family:
    name: str
    doc: str
    roles: dict[str, Role]
    modalities_in: tuple[str, ...]
    modalities_out: tuple[str, ...]
    # the request field a text stage's prompt is built from: what a stage's `prompt` param
    # (a prompt past the context, an empty one) names in this API
    prompt_field: str


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "chat",
            "POST /v1/chat/completions",
            {
                "messages": Role("inputs", ("json",), doc="input port taking OpenAI-style chat messages"),
                "text": Role("outputs", ("text",), doc="output port with the reply text (streamed)"),
                "info": Role("outputs", ("json",), False, "output port with finish reason, usage, logprobs"),
                "audio": Role("outputs", ("audio",), False, "output port with the spoken reply"),
                "speech_info": Role(
                    "outputs", ("json",), False, "output port with the speech stages' usage (codec_tokens)"
                ),
                "audio_in": Role("inputs", ("audio",), False, "input port taking the messages' input_audio parts"),
                "images_in": Role("inputs", ("image",), False, "input port taking the messages' image_url parts"),
                "videos_in": Role("inputs", ("video",), False, "input port taking the messages' video_url parts"),
            },
            ("text",),
            ("text",),
            "messages",
        ),
        Family(
            "completions",
            "POST /v1/completions",
            {
                "prompt": Role("inputs", ("text",), doc="input port taking the prompt text"),
                "text": Role("outputs", ("text",), doc="output port with the completion (streamed)"),
                "info": Role("outputs", ("json",), False, "output port with finish reason, usage, logprobs"),
            },
            ("text",),
            ("text",),
            "prompt",
        ),
        Family(
            "images",
            "POST /v1/images/generations",
            {
                "prompt": Role("inputs", ("text",), doc="input port taking the prompt text"),
                "image": Role("outputs", ("image",), doc="output port with the images [n, H, W, 3]"),
                "image_in": Role("inputs", ("image",), False, "input port taking /v1/images/edits' image"),
                "preview": Role("outputs", ("image",), False, "output port streaming partial images"),
                "warnings": Role("outputs", ("json",), False, "output port with notices such as a truncated prompt"),
            },
            ("text",),
            ("image",),
            "prompt",
        ),
        Family(
            "speech",
            "POST /v1/audio/speech",
            {
                "input": Role("inputs", ("text", "json"), doc="input port taking the text to speak"),
                "audio": Role("outputs", ("audio",), doc="output port with the waveform (streamed)"),
                "instructions": Role(
                    "inputs", ("json", "text"), False, "input port taking `instructions` (json: as a user turn)"
                ),
                "info": Role("outputs", ("json",), False, "output port with the text stage's usage (input tokens)"),
                "speech_info": Role(
                    "outputs", ("json",), False, "output port with the speech stages' usage (codec_tokens)"
                ),
            },
            ("text",),
            ("audio",),
            "input",
        ),
    )
}


@dataclass
class ServeSpec:
    """One served API family: role -> pipeline port, and the stages taking its params."""

    family: str
    ports: dict[str, str]
    params: list[str] = field(default_factory=list)
    speech_params: list[str] = field(default_factory=list)  # stages taking the voice (chat with audio)
    pos: SourcePos | None = None

    def port(self, role: str) -> str | None:
        return self.ports.get(role)

    @property
    def modalities(self) -> dict[str, list[str]]:
        fam = FAMILIES[self.family]
        given, out = list(fam.modalities_in), list(fam.modalities_out)
        if self.family == "chat":
            given += [
                m
                for role, m in (("audio_in", "audio"), ("images_in", "image"), ("videos_in", "video"))
                if role in self.ports
            ]
            out += ["audio"] if "audio" in self.ports else []
        if self.family == "images" and "image_in" in self.ports:
            given.append("image")
        return {"input": given, "output": out}


def check_serves(
    node: Node,
    inputs: dict[str, str],
    outputs: dict[str, str],
    stages: set[str],
    report: Report,
) -> dict[str, ServeSpec]:
    """The validated `serves:` mapping; problems go to `report` at their file:line:col."""
    m = report.mapping(node, "serves", node.pos)
    if m is None:
        return {}
    served: dict[str, ServeSpec] = {}
    for name, body in m.entries.items():
        at = m.key_pos[name]
        family = FAMILIES.get(name)
        if family is None:
            report.add(
                at,
                f"serves: unknown API family {name!r}{did_you_mean(name, FAMILIES)}; families: {', '.join(FAMILIES)}",
            )
            continue
        spec = _check_family(family, body, at, inputs, outputs, stages, report)
        if spec is not None:
            served[name] = spec
    return served


def _check_family(family, body, at, inputs, outputs, stages, report) -> ServeSpec | None:
    where = f"serves.{family.name}"
    m = report.mapping(body, where, at)
    if m is None:
        return None
    ok = True
    ports: dict[str, str] = {}
    for key, value in m.entries.items():
        key_at = m.key_pos[key]
        if key in ("params", "speech_params"):
            continue
        role = family.roles.get(key)
        if role is None:
            choices = [*family.roles, "params", "speech_params"]
            report.add(
                key_at,
                f"unknown key {key!r} in {where}{did_you_mean(key, choices)}; expected one of: {', '.join(choices)}",
            )
            ok = False
            continue
        if not (isinstance(value, ScalarNode) and isinstance(value.value, str)):
            report.add(value.pos, f"{where}.{key} must name a pipeline {role.side[:-1]} port, got {describe(value)}")
            ok = False
            continue
        declared = inputs if role.side == "inputs" else outputs
        port = value.value
        if port not in declared:
            report.add(
                value.pos,
                f"{where}.{key}: {port!r} is not a pipeline {role.side[:-1]} port"
                f"{did_you_mean(port, declared)}; {role.side}: {', '.join(declared) or 'none'}",
            )
            ok = False
        elif declared[port] not in role.types:
            report.add(
                value.pos,
                f"{where}.{key}: port {port!r} is {declared[port]}, the role needs {' or '.join(role.types)}",
            )
            ok = False
        ports[key] = port
    for key, role in family.roles.items():
        if role.required and key not in m.entries:
            report.add(at, f"{where}: missing required field {key!r} ({role.doc})")
            ok = False
    params = _param_stages(m.get("params"), where, stages, report)
    speech = _param_stages(m.get("speech_params"), f"{where}.speech", stages, report)
    if params is None or speech is None or not ok:
        return None
    return ServeSpec(family.name, ports, params, speech, at)


def _param_stages(node: Node | None, where: str, stages: set[str], report: Report) -> list[str] | None:
    if node is None:
        return []
    if isinstance(node, ScalarNode) and isinstance(node.value, str):
        items = [node]
    elif isinstance(node, SeqNode):
        items = node.items
    else:
        report.add(node.pos, f"{where}.params must be a stage name or a list of them, got {describe(node)}")
        return None
    names: list[str] = []
    for item in items:
        if not (isinstance(item, ScalarNode) and isinstance(item.value, str)) or item.value not in stages:
            shown = item.value if isinstance(item, ScalarNode) else describe(item)
            hint = did_you_mean(shown, stages) if isinstance(shown, str) else ""
            report.add(item.pos, f"{where}.params: {shown!r} is not a stage of this pipeline{hint}")
            return None
        names.append(item.value)
    return names


def json_schema() -> dict:
    """The `serves` section's JSON Schema (graph/schema.py includes it)."""
    families = {}
    for fam in FAMILIES.values():
        props = {k: {"type": "string", "description": r.doc} for k, r in fam.roles.items()}
        stage_list = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
        props["params"] = {"description": "stage(s) receiving this API's per-request fields", **stage_list}
        props["speech_params"] = {"description": "stage(s) receiving the voice of spoken output", **stage_list}
        families[fam.name] = {
            "type": "object",
            "description": fam.doc,
            "properties": props,
            "required": [k for k, r in fam.roles.items() if r.required],
            "additionalProperties": False,
        }
    return {
        "type": "object",
        "description": "OpenAI API families this pipeline serves, mapped onto its ports and stages.",
        "properties": families,
        "additionalProperties": False,
    }
