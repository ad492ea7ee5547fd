"""Pipeline YAML loading and validation: one test per class of problem, each asserting the exact
FILE:LINE:COL of the report, plus interpolation, overrides and a valid fan-out/fan-in graph.

Stage kinds used here are small classes registered by this module (names start with gtest_),
so these tests depend only on the engine protocol, not on the real kinds.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from omnistage.graph.loader import PipelineValidationError, load_pipeline, resolve_pipeline_path
from omnistage.graph.spec import Endpoint, StreamSpec
from omnistage.stages import registry
from omnistage.stages.base import Port, StageEngine
from omnistage.stages.params import Param, ParamSet
from omnistage.stages.registry import register_stage


@register_stage("gtest_encoder")
class _Encoder(StageEngine):
    inputs = {"text": Port("text")}
    outputs = {"emb": Port("embeddings")}


@register_stage("gtest_lm")
class _LM(StageEngine):
    inputs = {"emb": Port("embeddings", streaming=True), "prefix": Port("text", optional=True)}
    outputs = {"text": Port("text"), "tokens": Port("tokens", streaming=True)}
    batching_policies = ("continuous",)
    needs_model = True

    @classmethod
    def validate_params(cls, params):
        problems = []
        t = params.get("temperature", 0.0)
        if not isinstance(t, (int, float)) or t < 0:
            problems.append(f"temperature must be a number >= 0, got {t!r}")
        return problems


@register_stage("gtest_vocoder")
class _Vocoder(StageEngine):
    inputs = {"tokens": Port("tokens")}  # not streaming
    outputs = {"audio": Port("audio", streaming=True)}


@register_stage("gtest_any")
class _Any(StageEngine):
    inputs = {"x": Port("any")}
    outputs = {"y": Port("any")}


@register_stage("gtest_mix")
class _Mix(StageEngine):
    inputs = {"a": Port("text"), "b": Port("embeddings")}
    outputs = {"out": Port("json")}


@register_stage("gtest_fanin")
class _FanIn(StageEngine):
    """Ports from params: `n` text inputs in0..in{n-1}."""

    stage_params = ParamSet("gtest_fanin", (Param("n", "integer", 1, "Number of text inputs.", minimum=1),))

    @classmethod
    def ports(cls, params):
        return {f"in{i}": Port("text") for i in range(params.get("n", 1))}, {"out": Port("text")}


def write(tmp_path: Path, text: str, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def problems(tmp_path: Path, text: str, overrides=(), environ=None) -> tuple[str, list[str]]:
    path = write(tmp_path, text)
    with pytest.raises(PipelineValidationError) as info:
        load_pipeline(path, overrides=overrides, environ=environ or {})
    return str(path), info.value.problems


def has(lines: list[str], prefix: str, *fragments: str) -> None:
    """Some line starts with `prefix` (FILE:LINE:COL:) and contains every fragment."""
    for line in lines:
        if line.startswith(prefix + " ") and all(f in line for f in fragments):
            return
    raise AssertionError(f"no line {prefix} ... {fragments} in:\n" + "\n".join(lines))


# A valid baseline: prompt -> enc -> lm (streamed) -> vocoder; every test breaks one thing.
GOOD = """
name: speech
inputs: {prompt: text}
outputs: {audio: audio, text: text}
stages:
  enc:
    kind: gtest_encoder
  lm:
    kind: gtest_lm
    model: tiny:tiny-llm
    batching: {policy: continuous, max_num_seqs: 4}
    params: {temperature: 0.5}
  voc:
    kind: gtest_vocoder
    pool: {devices: [cpu], replicas: 2}
edges:
  - {from: inputs.prompt, to: enc.text}
  - {from: enc.emb, to: lm.emb, stream: {chunk: 4}}
  - {from: lm.tokens, to: voc.tokens}
  - {from: voc.audio, to: outputs.audio, stream: true}
  - {from: lm.text, to: outputs.text}
"""


def test_valid_baseline_builds_the_spec(tmp_path):
    spec = load_pipeline(write(tmp_path, GOOD))
    assert spec.name == "speech"
    assert spec.inputs == {"prompt": "text"} and spec.outputs == {"audio": "audio", "text": "text"}
    assert spec.topo_order() == ["enc", "lm", "voc"]
    lm = spec.stages["lm"]
    assert lm.batching.policy == "continuous" and lm.batching.max_num_seqs == 4
    assert lm.model.source == "tiny:tiny-llm" and lm.model.is_tiny_recipe
    assert lm.params == {"temperature": 0.5}
    assert spec.stages["enc"].batching.policy == "dynamic"  # the kind's first policy
    assert spec.stages["voc"].pool.replicas == 2
    stream_edge = spec.edges[1]
    assert (stream_edge.src, stream_edge.dst) == (Endpoint("enc", "emb"), Endpoint("lm", "emb"))
    assert stream_edge.stream == StreamSpec(chunk=4, left_context=0)
    assert spec.edges[3].stream == StreamSpec()  # `stream: true`
    assert str(lm.pos) == f"{tmp_path / 'p.yaml'}:7:3"


def test_fan_out_and_fan_in_are_valid(tmp_path):
    spec = load_pipeline(
        write(
            tmp_path,
            """
        name: diamond
        inputs: {q: text}
        outputs: {o: text, copy: text}
        stages:
          a: {kind: gtest_any}
          b: {kind: gtest_any}
          c: {kind: gtest_any}
          d: {kind: gtest_fanin, params: {n: 2}}
        edges:
          - {from: inputs.q, to: a.x}
          - {from: a.y, to: b.x}
          - {from: a.y, to: c.x}
          - {from: b.y, to: d.in0}
          - {from: c.y, to: d.in1}
          - {from: d.out, to: outputs.o}
          - {from: a.y, to: outputs.copy}
    """,
        )
    )
    order = spec.topo_order()
    assert order[0] == "a" and order[-1] == "d" and set(order) == {"a", "b", "c", "d"}
    assert [str(e.dst) for e in spec.in_edges("d")] == ["d.in0", "d.in1"]


def test_yaml_syntax_error_has_line_and_column(tmp_path):
    f, lines = problems(
        tmp_path,
        """
        name: x
        stages:
          a: {kind: gtest_any
        edges: []
    """,
    )
    assert len(lines) == 1
    has(lines, f"{f}:4:6:", "YAML syntax error", "expected ',' or '}'")
    f, lines = problems(tmp_path, "name: x\nname: y\n")
    has(lines, f"{f}:2:1:", "duplicate key")


def test_unknown_keys_with_did_you_mean(tmp_path):
    f, lines = problems(
        tmp_path,
        GOOD.replace("edges:", "edgse:").replace(
            "pool: {devices: [cpu], replicas: 2}", "pool: {devices: [cpu], replica: 2}"
        ),
    )
    has(lines, f"{f}:14:28:", "unknown key 'replica' in stages.voc.pool", "(did you mean 'replicas'?)")
    has(lines, f"{f}:15:1:", "unknown key 'edgse'", "(did you mean 'edges'?)")
    # the suggested key is not reported missing a second time
    assert not any("missing required field 'edges'" in line for line in lines)
    f, lines = problems(tmp_path, GOOD.replace("stream: {chunk: 4}", "stream: {chunks: 4}"))
    has(lines, f"{f}:17:42:", "unknown key 'chunks' in edges[1].stream", "(did you mean 'chunk'?)")


def test_unknown_stage_kind_with_did_you_mean(tmp_path):
    f, lines = problems(tmp_path, GOOD.replace("kind: gtest_encoder", "kind: gtest_encodr"))
    has(lines, f"{f}:6:11:", "unknown stage kind 'gtest_encodr'", "(did you mean 'gtest_encoder'?)")
    # no cascade: edges into the unknown stage's ports are not reported on top
    assert len(lines) == 1, lines


def test_kind_whose_module_fails_to_import_is_reported_at_the_kind(tmp_path, monkeypatch):
    monkeypatch.setitem(registry.KIND_MODULES, "gtest_broken", "omnistage.no_such_module_here")
    f, lines = problems(tmp_path, GOOD.replace("kind: gtest_encoder", "kind: gtest_broken"))
    has(lines, f"{f}:6:11:", "stage kind 'gtest_broken' could not be loaded", "ModuleNotFoundError")


def test_missing_required_fields(tmp_path):
    f, lines = problems(
        tmp_path,
        """
        inputs: {q: text}
        outputs: {o: any}
        stages:
          a:
            pool: {replicas: 1}
        edges:
          - {from: inputs.q}
    """,
    )
    has(lines, f"{f}:1:1:", "missing required field 'name'")
    has(lines, f"{f}:4:3:", "stages.a: missing required field 'kind'")
    has(lines, f"{f}:7:5:", "edges[0]: missing required field 'to'")


def test_a_pipeline_without_outputs_is_refused(tmp_path):
    f, lines = problems(
        tmp_path,
        """
        name: e
        inputs: {x: tensor}
        outputs: {}
        stages:
          n: {kind: noop}
        edges:
          - {from: inputs.x, to: n.x}
    """,
    )
    assert lines == [f"{f}:3:10: outputs: a pipeline needs at least one output port {{port: type}}"]


def test_a_port_mapping_reports_its_type_and_dtype_at_once(tmp_path):
    f, lines = problems(
        tmp_path,
        """
        name: e
        inputs:
          x: {type: tensr, dtype: float23}
        outputs: {y: tensor}
        stages:
          n: {kind: noop}
        edges:
          - {from: inputs.x, to: n.x}
          - {from: n.x, to: outputs.y}
    """,
    )
    assert len(lines) == 2, lines
    has(lines, f"{f}:3:13:", "got string 'tensr' (did you mean 'tensor'?)")
    has(lines, f"{f}:3:27:", "inputs.x.dtype must be one of", "(did you mean 'float32'?)")


def test_bad_values_types_and_ranges(tmp_path):
    f, lines = problems(
        tmp_path,
        GOOD.replace(
            "pool: {devices: [cpu], replicas: 2}",
            "pool: {devices: [cpu], replicas: 0, dtype: fp16, threads: two, memory: 2 gigs}",
        )
        .replace("max_num_seqs: 4", "max_num_seqs: 4.5")
        .replace("{chunk: 4}", "{chunk: 0}")
        + textwrap.dedent("""
        limits: {max_queued_requests: -1, deadline_s: 0}
    """),
    )
    has(lines, f"{f}:14:38:", "stages.voc.pool.replicas must be >= 1, got 0")
    has(lines, f"{f}:14:48:", "'fp16' is not one of float32, float16, bfloat16", "(did you mean 'float16'?)")
    has(lines, f"{f}:14:63:", "stages.voc.pool.threads must be an integer >= 1, got string 'two'")
    has(lines, f"{f}:14:76:", "'2 gigs' is not a memory size")
    has(lines, f"{f}:10:50:", "stages.lm.batching.max_num_seqs must be an integer >= 1, got number 4.5")
    has(lines, f"{f}:17:49:", "edges[1].stream.chunk must be >= 1, got 0")
    has(lines, f"{f}:22:31:", "limits.max_queued_requests must be >= 1, got -1")
    has(lines, f"{f}:22:47:", "limits.deadline_s must be > 0, got 0")
    f, lines = problems(
        tmp_path, GOOD.replace("outputs: {audio: audio, text: text}", "outputs: {audio: sound, text: text}")
    )
    has(lines, f"{f}:3:18:", "unknown port type 'sound'")


def test_cycle_is_named(tmp_path):
    f, lines = problems(
        tmp_path,
        """
        name: loop
        inputs: {q: text}
        outputs: {o: any}
        stages:
          a: {kind: gtest_fanin, params: {n: 2}}
          b: {kind: gtest_any}
          c: {kind: gtest_any}
        edges:
          - {from: inputs.q, to: a.in0}
          - {from: a.out, to: b.x}
          - {from: b.y, to: c.x}
          - {from: c.y, to: a.in1}
          - {from: c.y, to: outputs.o}
    """,
    )
    assert lines == [f"{f}:10:5: cycle: a -> b -> c -> a (a pipeline graph must be acyclic)"]


def test_edges_naming_unknown_stages_and_ports(tmp_path):
    f, lines = problems(
        tmp_path,
        GOOD.replace("{from: lm.tokens, to: voc.tokens}", "{from: lm.tokns, to: vox.tokens}").replace(
            "{from: inputs.prompt, to: enc.text}", "{from: inputs.promt, to: enc.txt}"
        ),
    )
    has(lines, f"{f}:16:19:", "the pipeline has no input 'promt'", "(did you mean 'prompt'?)")
    has(lines, f"{f}:16:34:", "stage 'enc' (kind gtest_encoder) has no input port 'txt'", "(did you mean 'text'?)")
    has(lines, f"{f}:18:15:", "has no output port 'tokns'", "(did you mean 'tokens'?)")
    has(lines, f"{f}:18:26:", "no stage named 'vox'", "(did you mean 'voc'?)")
    f, lines = problems(tmp_path, GOOD.replace("{from: lm.text, to: outputs.text}", "{from: outputs.text, to: lm}"))
    has(lines, f"{f}:20:12:", "an edge cannot start at outputs.text")
    has(lines, f"{f}:20:30:", "'lm' is not stage.port")


def test_unconnected_required_inputs_and_outputs(tmp_path):
    # drop the edge into voc.tokens; lm.prefix stays unconnected but is optional
    f, lines = problems(
        tmp_path,
        GOOD.replace("  - {from: lm.tokens, to: voc.tokens}\n", "").replace(
            "  - {from: lm.text, to: outputs.text}\n", ""
        ),
    )
    assert lines == [
        f"{f}:3:25: pipeline output 'text' is not connected; add an edge `to: outputs.text`",
        f"{f}:12:3: input port 'tokens' (tokens) of stage 'voc' is not connected; add an edge `to: voc.tokens`",
    ]


def test_two_producers_on_one_input_port(tmp_path):
    f, lines = problems(tmp_path, GOOD + "  - {from: lm.text, to: outputs.audio}\n")
    has(lines, f"{f}:21:25:", "outputs.audio already has a producer (voc.audio at", ":19:27)")
    has(lines, f"{f}:21:25:", "type mismatch: lm.text is text but outputs.audio takes audio")


def test_type_mismatch_and_any(tmp_path):
    f, lines = problems(
        tmp_path,
        """
        name: mix
        inputs: {q: text, e: embeddings, z: audio}
        outputs: {o: json, p: any}
        stages:
          m: {kind: gtest_mix}
          n: {kind: gtest_any}
        edges:
          - {from: inputs.q, to: m.b}
          - {from: inputs.e, to: m.a}
          - {from: m.out, to: outputs.o}
          - {from: inputs.z, to: n.x}
          - {from: n.y, to: outputs.p}
    """,
    )
    assert lines == [
        f"{f}:8:26: type mismatch: inputs.q is text but m.b takes embeddings",
        f"{f}:9:26: type mismatch: inputs.e is embeddings but m.a takes text",
    ]


def test_streaming_edge_into_non_streaming_port(tmp_path):
    f, lines = problems(
        tmp_path,
        GOOD.replace("{from: lm.tokens, to: voc.tokens}", "{from: lm.tokens, to: voc.tokens, stream: {chunk: 8}}"),
    )
    assert lines == [
        f"{f}:18:39: streaming edge into voc.tokens, which does not accept chunks "
        "(its port is not streaming); drop `stream:` or connect a streaming port"
    ]


def test_malformed_device_names(tmp_path):
    f, lines = problems(tmp_path, GOOD.replace("devices: [cpu]", "devices: [cpu, gpu0, cuda:x]"))
    has(lines, f"{f}:14:27:", "malformed device 'gpu0'", "(did you mean 'cuda:0'?)")
    has(lines, f"{f}:14:33:", "malformed device 'cuda:x'")
    f, lines = problems(tmp_path, GOOD.replace("devices: [cpu]", 'devices: "cuda:0, cuda1"'))
    has(lines, f"{f}:14:30:", "malformed device 'cuda1'", "(did you mean 'cuda:1'?)")
    f, lines = problems(tmp_path, GOOD.replace("devices: [cpu]", "devices: [cpu:0]"))
    has(lines, f"{f}:14:22:", "malformed device 'cpu:0'", "(did you mean 'cpu'? pool.threads sets how many cores")
    # A GPU pipeline validates on this CPU machine: device existence is checked at start.
    spec = load_pipeline(write(tmp_path, GOOD.replace("devices: [cpu]", 'devices: "cuda:0, cuda:7"')))
    assert spec.stages["voc"].pool.devices == ["cuda:0", "cuda:7"]


def test_pool_cpus_forms_and_errors(tmp_path):
    for text, cpus in (("[1, 0, 1]", [0, 1]), ("1", [1]), ('"0-2,5"', [0, 1, 2, 5]), ('" 3 "', [3])):
        spec = load_pipeline(write(tmp_path, GOOD.replace("devices: [cpu]", f"devices: [cpu], cpus: {text}")))
        assert spec.stages["voc"].pool.cpus == cpus, text
    assert load_pipeline(write(tmp_path, GOOD)).stages["voc"].pool.cpus is None
    f, lines = problems(tmp_path, GOOD.replace("devices: [cpu]", "devices: [cpu], cpus: [1, -1]"))
    has(lines, f"{f}:14:38:", "voc.pool.cpus: a CPU id must be an integer >= 0, got")
    f, lines = problems(tmp_path, GOOD.replace("devices: [cpu]", 'devices: [cpu], cpus: "2-0"'))
    has(lines, f"{f}:14:34:", "voc.pool.cpus: '2-0': the range 2-0 runs backwards")
    f, lines = problems(tmp_path, GOOD.replace("devices: [cpu]", "devices: [cpu], cpus: {a: 1}"))
    has(lines, f"{f}:14:34:", "voc.pool.cpus must be a list of CPU ids")
    # CPUs this machine lacks validate (the file may be for another machine): checked at start
    spec = load_pipeline(write(tmp_path, GOOD.replace("devices: [cpu]", "devices: [cpu], cpus: [4096]")))
    assert spec.stages["voc"].pool.cpus == [4096]


def test_batching_policy_not_supported_by_kind(tmp_path):
    f, lines = problems(
        tmp_path, GOOD.replace("{policy: continuous, max_num_seqs: 4}", "{policy: dynamic, max_batch_size: 4}")
    )
    assert lines == [
        f"{f}:10:24: stages.lm.batching: stage kind 'gtest_lm' does not support "
        "batching policy 'dynamic' (supported: continuous)"
    ]
    f, lines = problems(tmp_path, GOOD.replace("max_num_seqs: 4", "max_batch_size: 4"))
    has(lines, f"{f}:10:36:", "max_batch_size is a knob of the dynamic / step policy, not 'continuous'")
    f, lines = problems(tmp_path, GOOD.replace("policy: continuous", "policy: continous"))
    has(lines, f"{f}:10:24:", "'continous' is not one of", "(did you mean 'continuous'?)")


def test_model_required_and_tiny_recipe_checked(tmp_path):
    f, lines = problems(tmp_path, GOOD.replace("    model: tiny:tiny-llm\n", ""))
    assert lines == [
        f"{f}:7:3: stages.lm: stage kind 'gtest_lm' needs a model (model: <local path | hub id | tiny:recipe>)"
    ]
    f, lines = problems(tmp_path, GOOD.replace("tiny:tiny-llm", "tiny:tiny-lm"))
    has(lines, f"{f}:9:12:", "unknown tiny recipe 'tiny-lm'", "(did you mean 'tiny-llm'?)")


def test_model_mapping_and_relative_path(tmp_path):
    spec = load_pipeline(
        write(
            tmp_path,
            GOOD.replace("model: tiny:tiny-llm", "model: {source: ./ckpt, subfolder: thinker, prefix: 'thinker.'}"),
        )
    )
    model = spec.stages["lm"].model
    assert model.source == str((tmp_path / "ckpt").resolve())
    assert (model.subfolder, model.prefix) == ("thinker", "thinker.")
    f, lines = problems(tmp_path, GOOD.replace("model: tiny:tiny-llm", "model: {subfolder: x}"))
    has(lines, f"{f}:9:12:", "stages.lm.model: missing required field 'source'")


def test_validate_params_messages_point_at_the_param(tmp_path):
    f, lines = problems(tmp_path, GOOD.replace("temperature: 0.5", "temperature: -1"))
    assert lines == [f"{f}:11:27: stages.lm.params: temperature must be a number >= 0, got -1"]  # the value
    from omnistage.graph.loader import package_configs_dir

    text = (package_configs_dir() / "tiny-llm.yaml").read_text().replace("block_size:", "blok_size:")
    row = next(i for i, line in enumerate(text.splitlines(), 1) if "blok_size:" in line)
    col = text.splitlines()[row - 1].index("blok_size") + 1
    path = tmp_path / "llm.yaml"
    path.write_text(text)
    with pytest.raises(PipelineValidationError) as info:
        load_pipeline(path)
    (line,) = info.value.problems
    assert line.startswith(f"{path}:{row}:{col}: stages.llm.params: unknown ar_lm parameter 'blok_size'"), line


def test_every_problem_is_reported_in_file_order(tmp_path):
    f, lines = problems(
        tmp_path,
        GOOD.replace("name: speech", "nme: speech")
        .replace("replicas: 2", "replicas: 0")
        .replace("{from: lm.text, to: outputs.text}", "{from: lm.txt, to: outputs.text}"),
    )
    assert [line.split(": ")[0] for line in lines] == [f"{f}:1:1", f"{f}:14:38", f"{f}:20:15"]


# -- environment interpolation ----------------------------------------------------------------
ENV_GOOD = GOOD.replace(
    "pool: {devices: [cpu], replicas: 2}", 'pool: {devices: "${VOC_DEVICES:-[cpu]}", replicas: "${VOC_REPLICAS:-2}"}'
).replace("name: speech", "name: speech-${FLAVOR:-base}")


def test_env_defaults_and_values(tmp_path):
    spec = load_pipeline(write(tmp_path, ENV_GOOD), environ={})
    assert spec.name == "speech-base"
    assert spec.stages["voc"].pool.devices == ["cpu"] and spec.stages["voc"].pool.replicas == 2
    spec = load_pipeline(
        write(tmp_path, ENV_GOOD), environ={"VOC_DEVICES": "[cuda:0, cuda:1]", "VOC_REPLICAS": "4", "FLAVOR": "big"}
    )
    assert spec.name == "speech-big"
    assert spec.stages["voc"].pool.devices == ["cuda:0", "cuda:1"]
    assert spec.stages["voc"].pool.replicas == 4


def test_env_reads_os_environ_and_literal_dollar(tmp_path, monkeypatch):
    monkeypatch.setenv("GTEST_PIPELINE_NAME", "from-env")
    spec = load_pipeline(
        write(
            tmp_path,
            GOOD.replace("name: speech", "name: ${GTEST_PIPELINE_NAME}").replace(
                "{temperature: 0.5}", "{temperature: 0.5, note: '$${not}'}"
            ),
        )
    )
    assert spec.name == "from-env"
    assert spec.stages["lm"].params["note"] == "${not}"


def test_env_missing_without_default_is_an_error_at_its_position(tmp_path):
    f, lines = problems(tmp_path, GOOD.replace("name: speech", "name: speech-${GTEST_UNSET_VAR}"))
    assert lines == [
        f"{f}:1:14: environment variable GTEST_UNSET_VAR is not set and "
        "'${GTEST_UNSET_VAR}' gives no default (write ${GTEST_UNSET_VAR:-default})"
    ]


def test_null_is_a_value_in_overrides_and_env_defaults(tmp_path):
    """`null` (or ~) given to --set or as ${VAR:-null} is YAML's null, as written in the file;
    it used to be read as an empty file."""
    text = GOOD + "limits:\n  deadline_s: ${GTEST_DEADLINE:-null}\n"
    assert load_pipeline(write(tmp_path, text), environ={}).default_deadline_s is None
    assert load_pipeline(write(tmp_path, text), environ={"GTEST_DEADLINE": "7"}).default_deadline_s == 7
    path = write(tmp_path, GOOD + "limits:\n  deadline_s: 5\n")
    for null in ("null", "~", "Null"):
        assert load_pipeline(path, overrides=[f"limits.deadline_s={null}"]).default_deadline_s is None


def test_env_value_is_validated_like_a_literal(tmp_path):
    f, lines = problems(tmp_path, ENV_GOOD, environ={"VOC_REPLICAS": "0"})
    has(lines, f"{f}:14:56:", "stages.voc.pool.replicas must be >= 1, got 0")


# -- --set overrides ---------------------------------------------------------------------------
def test_overrides_set_values_and_create_sections(tmp_path):
    path = write(tmp_path, GOOD)
    spec = load_pipeline(
        path,
        overrides=[
            "stages.voc.pool.devices=[cuda:0, cuda:1]",
            "stages.enc.pool.threads=2",  # enc has no pool: it is created
            "edges.1.stream.chunk=16",
            "stages.lm.params.temperature=0",
            "limits.max_queued_requests=8",
        ],
    )
    assert spec.stages["voc"].pool.devices == ["cuda:0", "cuda:1"]
    assert spec.stages["enc"].pool.threads == 2
    assert spec.edges[1].stream.chunk == 16
    assert spec.stages["lm"].params["temperature"] == 0
    assert spec.max_queued_requests == 8


def test_override_problems_point_into_the_override(tmp_path):
    f, lines = problems(
        tmp_path,
        GOOD,
        overrides=[
            "stages.vox.pool.replicas=2",
            "stages.voc.pool.replica=2",
            "stages.voc.pool.devices=[gpu:0]",
            "edges.9.max_inflight=2",
            "novalue",
        ],
    )
    assert lines == [
        "<--set #1>:1:8: unknown override path 'stages.vox.pool.replicas': no stage named 'vox' (did you mean 'voc'?)",
        "<--set #2>:1:17: unknown key 'replica' in stages.voc.pool (did you mean 'replicas'?)",
        "<--set #3>:1:26: stages.voc.pool.devices: malformed device 'gpu:0'; expected cpu, cuda or "
        "cuda:N (did you mean 'cuda:0'?)",
        "<--set #4>:1:7: unknown override path 'edges.9.max_inflight': edges is a list of 5 items; use an index 0..4",
        "<--set #5>:1:1: override 'novalue' is not PATH=VALUE (e.g. stages.llm.pool.devices=[cuda:0])",
    ]


# -- names -------------------------------------------------------------------------------------
def test_bare_name_resolves_under_the_package_configs(tmp_path):
    import omnistage

    configs = Path(omnistage.__file__).parent / "configs"
    assert resolve_pipeline_path("tiny-llm") == configs / "tiny-llm.yaml"
    assert resolve_pipeline_path("x/tiny-llm") == Path("x/tiny-llm")
    assert resolve_pipeline_path("tiny-llm.yaml") == Path("tiny-llm.yaml")
    with pytest.raises(PipelineValidationError) as info:
        load_pipeline("gtest-no-such-pipeline")
    assert info.value.problems[0].startswith(f"{configs / 'gtest-no-such-pipeline.yaml'}:1:1: no such pipeline file")
    with pytest.raises(PipelineValidationError) as info:
        load_pipeline("tiny_llm")
    assert "no such pipeline file (did you mean 'tiny-llm'?)" in info.value.problems[0]
    with pytest.raises(PipelineValidationError) as info:  # what a vLLM user types first
        load_pipeline("Qwen/Qwen2.5-0.5B-Instruct")
    assert "a model goes in a stage's `model:`" in info.value.problems[0]


def test_edge_ends_reversed_and_broken_stream_still_checks_endpoints(tmp_path):
    f, lines = problems(
        tmp_path,
        GOOD + "  - {from: enc.emb, to: inputs.prompt}\n" + "  - {from: lm.txt, to: outputs.text, stream: 3}\n",
    )
    has(lines, f"{f}:21:25:", "an edge cannot end at inputs.prompt: pipeline inputs are sources")
    has(lines, f"{f}:22:15:", "has no output port 'txt'")
    has(lines, f"{f}:22:46:", "edges[6].stream must be a mapping, got number 3")


def test_memory_budget_parses_to_bytes(tmp_path):
    spec = load_pipeline(write(tmp_path, GOOD.replace("replicas: 2}", "replicas: 2, memory: 1.5GiB}")))
    assert spec.stages["voc"].pool.memory == "1.5GiB"
    assert spec.stages["voc"].pool.memory_bytes == 3 * 2**29
    spec = load_pipeline(write(tmp_path, GOOD), overrides=["stages.voc.pool.memory=500MB"])
    assert spec.stages["voc"].pool.memory_bytes == 500 * 10**6
    assert spec.stages["enc"].pool.memory_bytes is None


def test_a_missing_relative_configs_path_names_the_packaged_file(tmp_path, monkeypatch):
    """The docs' `configs/tiny-llm.yaml`, run from another directory than the checkout."""
    from omnistage.graph.loader import package_configs_dir

    monkeypatch.chdir(tmp_path)
    with pytest.raises(PipelineValidationError) as err:
        load_pipeline("configs/tiny-llm.yaml")
    (line,) = err.value.problems
    assert line.startswith("configs/tiny-llm.yaml:1:1: no such pipeline file in ")
    assert f"the name 'tiny-llm' or {package_configs_dir() / 'tiny-llm.yaml'}" in line
