"""The declared parameters (stages/params.py) of every stage kind: their JSON Schema agrees with
their checks (jsonschema is the judge), every bad or unknown value is refused naming the
parameter, every stage kind refuses unknown request params alike, and docs/params.md is what
the declarations generate."""

from pathlib import Path

import jsonschema
import pytest
import torch

from omnistage.errors import InvalidRequestError
from omnistage.graph.spec import BatchingSpec
from omnistage.models.recipes import build_recipe
from omnistage.stages.base import StageContext, StageRequest
from omnistage.stages.params import Param, ParamSet, kind_params, params_doc
from omnistage.stages.registry import KIND_MODULES

KINDS = sorted(KIND_MODULES)
DOCS = Path(__file__).resolve().parents[2] / "docs" / "params.md"

# Values of every JSON shape, including the edges of the usual ranges.
CANDIDATES = [
    None, True, False, 0, 1, -1, -2, 2, 20, 21, 1000, 2.5, 0.5, -0.5, 1.5, -2.5, 1e12,
    "", "x", "512MiB", "image", "video", "uint8", "float", "none", "stack", "pkg.mod:fn",
    [], [0, 1], [-1], [1.5], ["a", "b"], [True], {}, {"x": "tensor"},
]  # fmt: skip


def _all_param_sets():
    for kind in KINDS:
        kp = kind_params(kind)
        yield kind, "stage", kp.stage
        yield kind, "request", kp.request


def _every_param():
    return [(f"{kind}.{side}.{p.name}", p) for kind, side, ps in _all_param_sets() for p in ps]


@pytest.mark.parametrize("name,param", _every_param(), ids=lambda v: v if isinstance(v, str) else "")
def test_schema_and_checks_agree(name, param: Param):
    validator = jsonschema.Draft202012Validator(param.json_schema())
    for value in CANDIDATES:
        if param.type in ("integer", "integer_list") and value in (1e12,):
            continue  # JSON Schema calls 1e12 an integer; Python (and we) call it a float
        ours = param.problem(value) is None
        theirs = validator.is_valid(value)
        if param.check is not None and theirs and not ours:
            continue  # a rule the schema cannot state (a size string, a factory reference)
        assert ours == theirs, f"{name}: {value!r} accepted by us: {ours}, by the JSON Schema: {theirs}"


@pytest.mark.parametrize("kind,side,params", list(_all_param_sets()), ids=lambda v: v if isinstance(v, str) else "")
def test_unknown_and_bad_values_are_refused_naming_the_parameter(kind, side, params: ParamSet):
    jsonschema.Draft202012Validator.check_schema(params.json_schema())
    if not params.open:
        with pytest.raises(InvalidRequestError) as err:
            params.validate({"no_such_param": 1})
        assert err.value.param == "no_such_param" and "no_such_param" in str(err.value)
    for p in params:
        bad = next((v for v in CANDIDATES if p.problem(v) is not None), None)
        if bad is None:
            continue  # type "any"
        with pytest.raises(InvalidRequestError) as err:
            params.validate({p.name: bad})
        assert err.value.param == p.name and str(err.value).startswith(p.name)
        if side == "stage":
            assert any(m.startswith(p.name) for m in params.problems({p.name: bad}))


def test_defaults_pass_their_own_checks():
    for _, _, params in _all_param_sets():
        given = {p.name: p.default for p in params if p.default is not None or p.nullable}
        given.update({p.name: next(v for v in CANDIDATES if p.problem(v) is None) for p in params.required})
        values = params.validate(given)
        assert set(values) >= set(params.names())


def test_docs_table_is_generated_from_the_declarations():
    assert DOCS.read_text(encoding="utf-8") == params_doc(), (
        "docs/params.md is stale: python -m omnistage.stages.params > docs/params.md"
    )


# -- every stage kind refuses unknown request params alike -----------------------------------


def _ctx(kind, model_path=None, policy="dynamic", **params):
    return StageContext(
        kind, kind, model_path, None, None, torch.device("cpu"), torch.float32,
        BatchingSpec(policy=policy, max_wait_ms=0.0), params,
    )  # fmt: skip


def _drain(stage):
    out = []
    for _ in range(200):
        if not stage.has_work():
            break
        out += stage.step()
    return {e.request_id: e for e in out if e.finished}


def test_generic_kinds_refuse_request_params_they_do_not_read():
    from omnistage.stages.generic import NoopEngine, TorchModuleEngine

    noop = NoopEngine(_ctx("noop"))
    noop.add(StageRequest("ok", {"x": 1}))
    noop.add(StageRequest("bad", {"x": 2}, {"temperature": 0.5}))
    done = _drain(noop)
    assert done["ok"].error is None and done["ok"].outputs == {"x": 1}
    assert done["bad"].error_kind == "invalid_request" and done["bad"].param == "temperature"

    module = TorchModuleEngine(_ctx("torch_module", factory="torch.nn:Identity"))
    module.add(StageRequest("bad", {"x": torch.ones(2)}, {"scale": 2}))
    assert _drain(module)["bad"].param == "scale"


def test_torch_module_request_params_follow_its_pass_params(tmp_path):
    """The kind takes any request keys with `pass_params: true` and none without: admission,
    the stage itself and the pipeline's card (GET /v1/pipelines/{name}) all say the same."""
    from omnistage.graph.inputs import check_params
    from omnistage.graph.loader import load_pipeline
    from omnistage.serving.catalog import request_params_of

    path = tmp_path / "mlp.yaml"
    path.write_text(
        "name: mlp\ninputs: {x: tensor}\noutputs: {y: tensor, z: tensor}\nstages:\n"
        "  m: {kind: torch_module, params: {factory: 'torch.nn:Identity'}}\n"
        "  p: {kind: torch_module, params: {factory: 'torch.nn:Identity', pass_params: true}}\n"
        "edges: [{from: inputs.x, to: m.x}, {from: inputs.x, to: p.x}, {from: m.y, to: outputs.y},"
        " {from: p.y, to: outputs.z}]\n"
    )
    spec = load_pipeline(str(path))
    check_params(spec, {"p": {"anything": 1}})
    with pytest.raises(InvalidRequestError) as refused:
        check_params(spec, {"m": {"anything": 1}})
    assert refused.value.param == "anything" and "pass_params: true" in str(refused.value)
    assert request_params_of(spec.stages["m"]) == ([], False)
    assert request_params_of(spec.stages["p"]) == ([], True)


def test_denoiser_refuses_unknown_request_params():
    from omnistage.stages.diffusion.denoiser import DenoiserStage

    model = build_recipe("tiny-sd3")
    stage = DenoiserStage(_ctx("denoiser", str(model), policy="step"))
    embeds = torch.zeros(2, 8, stage.adapter.transformer.config.joint_attention_dim)
    pooled = torch.zeros(2, stage.adapter.transformer.config.pooled_projection_dim)
    inputs = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
    stage.add(StageRequest("typo", inputs, {"num_inference_step": 2, "width": 32, "height": 32}))
    stage.add(StageRequest("bad", inputs, {"num_inference_steps": 2, "width": 32, "height": 32, "guidance_scale": -1}))
    done = _drain(stage)
    assert done["typo"].error_kind == "invalid_request" and done["typo"].param == "num_inference_step"
    assert "did you mean 'num_inference_steps'" in done["typo"].error
    assert done["bad"].param == "guidance_scale"


def test_admission_refuses_what_the_stage_would_before_any_worker_runs():
    """graph.inputs.check_params (the runtime's admission and POST /v1/jobs) answers from the
    declarations alone: no worker is started here."""
    from omnistage.graph.inputs import check_params
    from omnistage.graph.loader import load_pipeline

    image, llm = load_pipeline("tiny-image"), load_pipeline("tiny-llm")
    check_params(image, {"denoiser": {"width": 64, "num_inference_steps": 2}, "vae": {}})
    cases = [
        (image, {"denoiser": {"width": "x"}}, "width"),
        (image, {"vae": {"nope": 1}}, "nope"),
        (image, {"denoiser": 5}, "params.denoiser"),
        (image, {"text_encoder": {"": 0}}, "params.text_encoder"),  # a name that cannot be named
        (image, {"decoder": {}}, "params"),
        (llm, {"llm": {"min_tokens": 9, "max_tokens": 4}}, "min_tokens"),  # a rule across values
    ]
    for spec, params, param in cases:
        with pytest.raises(InvalidRequestError) as refused:
            check_params(spec, params)
        assert refused.value.param == param, (params, refused.value)


def test_a_misspelt_choice_is_answered_with_the_closest_one():
    seen = 0
    for _kind, _side, params in _all_param_sets():
        for p in params:
            for choice in [c for c in p.choices or () if isinstance(c, str) and len(c) >= 4]:
                typo = choice[:2] + choice[3:]  # one letter dropped, as `stak` for `stack`
                if typo in p.choices:
                    continue
                message = p.problem(typo)
                hint = message.split(" (did you mean ", 1)[1]
                assert hint.rstrip("?)").strip("'") in p.choices, message
                seen += 1
    assert seen > 5  # the generic kinds' `batch`, the samplers, the output formats, ...
