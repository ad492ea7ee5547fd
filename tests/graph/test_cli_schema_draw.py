"""`omnistage validate` / `omnistage graph` as real subprocesses, the JSON Schema checked with
jsonschema against every shipped config, and the Mermaid/DOT drawings."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
from ruamel.yaml import YAML

import omnistage
from omnistage.graph.draw import draw_command, to_dot, to_mermaid
from omnistage.graph.loader import load_pipeline
from omnistage.graph.schema import json_schema

PACKAGE = Path(omnistage.__file__).parent
EXAMPLES = sorted((PACKAGE / "configs" / "examples").glob("*.yaml"))
SHIPPED = sorted((PACKAGE / "configs").glob("*.yaml")) + EXAMPLES
DIAMOND = PACKAGE / "configs" / "examples" / "diamond.yaml"
CLI = Path(sys.executable).parent / "omnistage"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONSAFEPATH": "1", "OMNISTAGE_TEST_THREADS": "1"}
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, env=env, timeout=120)


def test_cli_validate_exit_codes(tmp_path):
    ok = run_cli("validate", str(DIAMOND))
    assert ok.returncode == 0, ok.stderr
    assert "ok (diamond: 4 stages, 7 edges)" in ok.stdout

    bad = tmp_path / "bad.yaml"
    bad.write_text(
        DIAMOND.read_text().replace("replicas: 2", "replicas: 0").replace("to: left.input}", "to: left.inptu}")
    )
    result = run_cli("validate", str(bad), "--set", "stages.embed.pool.devices=[cuda:0, tpu]")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert all(re.match(r"^[^:]+:\d+:\d+: ", line) for line in lines), lines
    text = DIAMOND.read_text().splitlines()
    replicas_line = next(i for i, line in enumerate(text, 1) if "replicas: 2" in line)
    col = text[replicas_line - 1].index("2") + 1
    assert f"{bad}:{replicas_line}:{col}: stages.right.pool.replicas must be >= 1, got 0" in lines
    assert any(
        line.startswith(f"{bad}:") and "has no input port 'inptu' (did you mean 'input'?)" in line for line in lines
    ), lines
    assert "<--set #1>:1:36: stages.embed.pool.devices: malformed device 'tpu'; expected cpu, cuda or cuda:N" in lines

    # several files at once, as serve takes them: each reported, overrides scoped by file stem
    both = run_cli("validate", str(DIAMOND), str(bad), "--set", "bad:stages.right.pool.replicas=1")
    assert both.returncode == 2
    assert "ok (diamond: 4 stages, 7 edges)" in both.stdout
    assert "replicas must be >= 1" not in both.stderr and "'inptu'" in both.stderr


def test_cli_graph_prints_mermaid():
    result = run_cli("graph", str(DIAMOND))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("flowchart LR")
    assert 's_embed -.->|"y → input (stream chunk=2)"| s_right' in result.stdout


def test_png_through_graphviz_or_a_clear_error(tmp_path, capsys):
    out = tmp_path / "g.png"
    code = draw_command(str(DIAMOND), "png", str(out), [])
    if shutil.which("dot"):
        assert code == 0 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert code == 1 and "needs graphviz's `dot`" in capsys.readouterr().err
        assert not out.exists()


def test_schema_is_valid_and_accepts_every_shipped_config():
    schema = json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    assert EXAMPLES, "configs/examples/ holds annotated examples"
    for path in SHIPPED:
        data = YAML(typ="safe").load(path.read_text())
        errors = [e.message for e in validator.iter_errors(data)]
        assert not errors, (path, errors)


def test_schema_rejects_what_validation_rejects():
    validator = jsonschema.Draft202012Validator(json_schema())
    base = YAML(typ="safe").load(DIAMOND.read_text())

    def errors(mutate) -> list[str]:
        data = YAML(typ="safe").load(DIAMOND.read_text())
        mutate(data)
        return [e.message for e in validator.iter_errors(data)]

    assert not errors(lambda d: None)
    assert errors(lambda d: d.update(stagez={}))
    assert errors(lambda d: d["stages"]["right"]["pool"].update(replica=2))
    assert errors(lambda d: d["stages"]["right"]["pool"].update(devices=["gpu0"]))
    assert errors(lambda d: d["stages"]["embed"].update(batching={"policy": "dynamic", "max_num_seqs": 2}))
    assert errors(lambda d: d["edges"][0].update(to="embed"))
    assert errors(lambda d: d.pop("name"))
    assert errors(lambda d: d["outputs"].update(y="sound"))
    assert base["name"] == "diamond"


def test_mermaid_and_dot_contain_every_edge():
    spec = load_pipeline(DIAMOND)
    mermaid, dot = to_mermaid(spec), to_dot(spec)
    for edge in spec.edges:
        src = f"in_{edge.src.port}" if edge.src.stage == "inputs" else f"s_{edge.src.stage}"
        dst = f"out_{edge.dst.port}" if edge.dst.stage == "outputs" else f"s_{edge.dst.stage}"
        arrow = "-.->" if edge.streaming else "-->"
        assert re.search(
            rf"^    {src} {re.escape(arrow)}\|\"{edge.src.port} → {edge.dst.port}[^\"]*\"\| {dst}$", mermaid, re.M
        ), (edge, mermaid)
        assert re.search(
            rf'^    "{src}" -> "{dst}" \[label="{edge.src.port} → {edge.dst.port}[^"]*"'
            rf"{', style=dashed' if edge.streaming else ''}\];$",
            dot,
            re.M,
        ), (edge, dot)
    assert mermaid.count("-->") + mermaid.count("-.->") == len(spec.edges)
    assert dot.count(" -> ") == len(spec.edges)


def test_draw_command_writes_files(tmp_path, capsys):
    out = tmp_path / "g.dot"
    assert draw_command(str(DIAMOND), "dot", str(out), ["stages.right.pool.devices=[cuda:0,cuda:1]"]) == 0
    assert out.read_text().startswith('digraph "diamond"')
    assert "2 x cuda:0,cuda:1 float32" in out.read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\n")
    assert draw_command(str(bad), "mermaid", None, []) == 2
    assert f"{bad}:1:1: the pipeline: missing required field 'outputs'" in capsys.readouterr().err
    nowhere = tmp_path / "missing-dir" / "g.dot"
    assert draw_command(str(DIAMOND), "dot", str(nowhere), []) == 2
    assert capsys.readouterr().err.strip() == f"omnistage graph: cannot write {nowhere}: No such file or directory"


def test_cli_refuses_a_port_outside_the_tcp_range():
    for port in ("99999", "-1", "0", "http"):
        result = run_cli("serve", "tiny-llm", "--port", port)
        assert result.returncode == 2 and "argument --port" in result.stderr, (port, result.stderr)


def test_examples_load():
    for path in EXAMPLES:
        spec = load_pipeline(path)
        assert spec.stages and spec.edges


def test_cli_schema_prints_the_schema(capsys):
    import json

    from omnistage.serving.cli import main

    assert main(["schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(json_schema()))
    assert printed["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert set(printed["properties"]) == {
        "name",
        "description",
        "inputs",
        "outputs",
        "stages",
        "edges",
        "limits",
        "serves",
    }


def test_load_pipeline_text_and_lazy_package_exports():
    from omnistage.graph import PipelineValidationError as Err
    from omnistage.graph import load_pipeline as lp
    from omnistage.graph.loader import load_pipeline_text

    assert lp is load_pipeline
    spec = load_pipeline_text(DIAMOND.read_text(), "mem.yaml")
    assert spec.name == "diamond" and spec.source is None
    try:
        load_pipeline_text("name: [", "mem.yaml")
    except Err as err:
        assert err.problems[0].startswith("mem.yaml:1:8: YAML syntax error")  # end of `name: [`
    else:
        raise AssertionError("invalid YAML loaded")
