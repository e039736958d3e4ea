"""The loader: YAML with line numbers, friendly schema errors, ``extends``, safety limits."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.errors import PatchsetError
from engine.loader import (
    MAX_DEPTH,
    bundled_dir,
    bundled_names,
    json_schema,
    load_patchset,
    resolve,
    write_json_schema,
)
from engine.schema import Patchset, patch_key

REPO = Path(__file__).resolve().parent.parent

VALID = """\
name: demo
model_types: [qwen3]
patches:
  - target: Qwen3RMSNorm
    op: rms_norm
    scale: weight
  - target: Qwen3MLP
    op: swiglu
"""


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def error_of(source) -> PatchsetError:
    with pytest.raises(PatchsetError) as info:
        load_patchset(source)
    return info.value


# --------------------------------------------------------------------------------------
# Valid input


def test_valid_minimal(tmp_path):
    patchset = load_patchset(write(tmp_path, "demo.yaml", VALID))
    assert isinstance(patchset, Patchset)
    assert patchset.name == "demo"
    assert patchset.model_types == ["qwen3"]
    assert [patch_key(p) for p in patchset.patches] == ["Qwen3RMSNorm", "Qwen3MLP"]
    assert patchset.patches[0].scale == "weight"
    assert patchset.extends is None


def test_string_path_and_dict_sources(tmp_path):
    path = write(tmp_path, "demo.yaml", VALID)
    assert load_patchset(str(path)).name == "demo"
    data = {"name": "mem", "model_types": ["qwen3"], "patches": [{"target": "A", "op": "swiglu"}]}
    assert load_patchset(data).name == "mem"
    assert data["patches"] == [{"target": "A", "op": "swiglu"}]  # not mutated


def test_in_memory_errors_have_no_file():
    err = error_of({"name": "mem", "model_types": ["q"], "patches": [{"target": "A", "op": "rms_norm", "scale": "w"}]})
    assert err.file is None and err.line is None
    assert str(err) == "patches[0].scale: 'w' is not one of 'weight', 'one_plus_weight'"


def test_yaml_merge_keys_and_comments(tmp_path):
    path = write(
        tmp_path,
        "merge.yaml",
        """\
        # yaml-language-server: $schema=../schemas/patchset.schema.json
        name: merge
        model_types: [qwen3]
        patches:
          - &norm
            target: Qwen3RMSNorm
            op: rms_norm
            scale: weight
          - <<: *norm
            target: Qwen3QNorm
            scale: one_plus_weight
        """,
    )
    patchset = load_patchset(path)
    assert [patch_key(p) for p in patchset.patches] == ["Qwen3RMSNorm", "Qwen3QNorm"]
    assert patchset.patches[1].scale == "one_plus_weight"
    assert patchset.patches[1].op == "rms_norm"


def test_bundled_patchsets_resolve_and_load():
    names = bundled_names()
    assert names == sorted(names)
    assert bundled_dir().is_dir() == bool(names)
    for name in names:
        assert resolve(name) == bundled_dir() / f"{name}.yaml"
        assert resolve(f"{name}.yaml") == bundled_dir() / f"{name}.yaml"
        assert load_patchset(name).patches


# --------------------------------------------------------------------------------------
# Errors, each with file:line: key: problem


def test_malformed_yaml_reports_line(tmp_path):
    path = write(tmp_path, "bad.yaml", "name: demo\nmodel_types: [qwen3\npatches: []\n")
    err = error_of(path)
    assert err.file == str(path)
    assert err.line == 3
    assert str(err).startswith(f"{path}:3: YAML syntax error:")


def test_unknown_key_did_you_mean(tmp_path):
    path = write(tmp_path, "x.yaml", VALID.replace("    scale: weight", "    scael: weight"))
    err = error_of(path)
    assert f"{path}:6: patches[0].scael: unknown key 'scael'; did you mean 'scale'?" in str(err).splitlines()
    # scale is then missing, reported at the patch's line
    assert f"{path}:4: patches[0]: missing required key 'scale'" in str(err).splitlines()


def test_unknown_key_without_close_match_lists_valid_keys(tmp_path):
    path = write(tmp_path, "x.yaml", VALID + "zzz: 1\n")
    assert str(error_of(path)) == (
        f"{path}:9: zzz: unknown key 'zzz'; valid keys: name, description, extends, model_types, requires, "
        "on_unsupported, tiny_model, patches, fused_cross_entropy"
    )


def test_wrong_enum_value_with_line(tmp_path):
    path = write(tmp_path, "x.yaml", VALID.replace("scale: weight", "scale: one_plus_weigth"))
    err = error_of(path)
    assert str(err) == f"{path}:6: patches[0].scale: 'one_plus_weigth' is not one of 'weight', 'one_plus_weight'"
    assert (err.file, err.line, err.key) == (str(path), 6, "patches[0].scale")
    assert err.problem == "'one_plus_weigth' is not one of 'weight', 'one_plus_weight'"


def test_missing_op(tmp_path):
    path = write(tmp_path, "x.yaml", VALID.replace("    op: swiglu\n", ""))
    assert str(error_of(path)) == (
        f"{path}:7: patches[1]: missing required key 'op' (one of 'rms_norm', 'gated_rms_norm', 'swiglu', 'geglu', 'layer_norm', 'mlp', 'rope', 'linear_attention', 'fused_linear_cross_entropy', 'moe_experts')"
    )


def test_unknown_op(tmp_path):
    path = write(tmp_path, "x.yaml", VALID.replace("op: rms_norm", "op: rmsnorm"))
    assert str(error_of(path)) == (
        f"{path}:5: patches[0].op: op 'rmsnorm' is not one of 'rms_norm', 'gated_rms_norm', 'swiglu', 'geglu', 'layer_norm', 'mlp', 'rope', 'linear_attention', 'fused_linear_cross_entropy', 'moe_experts'; did you mean 'rms_norm'?"
    )


def test_unknown_kernel_lists_known_kernels(tmp_path):
    from engine.kernels.registry import kernel_names

    path = write(tmp_path, "x.yaml", VALID + "    kernel: nosuch\n")
    err = error_of(path)
    assert str(err).startswith(f"{path}:9: patches[1].kernel: unknown kernel 'nosuch'; known kernels: auto, ")
    assert "Value error" not in str(err)
    for name in kernel_names():
        assert name in err.problem


def test_kernel_of_the_wrong_type(tmp_path):
    path = write(tmp_path, "x.yaml", VALID + "    kernel: 5\n")
    assert str(error_of(path)) == f"{path}:9: patches[1].kernel: expected 'auto', a string or a mapping, got 5"
    path = write(tmp_path, "y.yaml", VALID + "    kernel: {gpu: torch}\n")
    assert str(error_of(path)) == (
        f"{path}:9: patches[1].kernel.gpu: 'gpu' is not one of 'cpu', 'cuda', 'npu', 'xpu', 'mps'"
    )


def test_duplicate_mapping_key(tmp_path):
    path = write(tmp_path, "x.yaml", VALID.replace("    scale: weight\n", "    scale: weight\n    scale: weight\n"))
    assert str(error_of(path)) == f"{path}:7: patches[0].scale: duplicate key 'scale' (first at line 6)"


def test_duplicate_target(tmp_path):
    path = write(tmp_path, "x.yaml", VALID + "  - target: Qwen3MLP\n    op: swiglu\n")
    err = error_of(path)
    assert str(err) == (
        f"{path}:9: patches[2].target: duplicate target 'Qwen3MLP', already patched by patches[1] (line 7); "
        "merge them into one patch"
    )


def test_duplicate_function_with_default_name(tmp_path):
    path = write(tmp_path, "x.yaml", VALID + "  - op: rope\n  - op: rope\n    function: apply_rotary_pos_emb\n")
    err = error_of(path)
    assert str(err).startswith(f"{path}:11: patches[3].function: duplicate function 'apply_rotary_pos_emb'")


def test_all_errors_are_reported_in_line_order(tmp_path):
    text = VALID.replace("scale: weight", "scale: one_plus_weigth").replace("op: swiglu", "op: swigl")
    path = write(tmp_path, "x.yaml", text.replace("name: demo", "name: demo\nnmae: demo"))
    err = error_of(path)
    lines = str(err).splitlines()
    assert lines == [
        f"{path}:2: nmae: unknown key 'nmae'; did you mean 'name'?",
        f"{path}:7: patches[0].scale: 'one_plus_weigth' is not one of 'weight', 'one_plus_weight'",
        f"{path}:9: patches[1].op: op 'swigl' is not one of 'rms_norm', 'gated_rms_norm', 'swiglu', 'geglu', 'layer_norm', 'mlp', 'rope', 'linear_attention', 'fused_linear_cross_entropy', 'moe_experts'; did you mean 'swiglu'?",
    ]
    assert (err.line, err.key) == (2, "nmae")
    assert [str(e) for e in err.errors] == lines


def test_non_string_key(tmp_path):
    path = write(tmp_path, "x.yaml", VALID + "on: 1\n")
    err = error_of(path)
    assert str(err).startswith(f"{path}:9: key 'on' is read as true, not a string")


# --------------------------------------------------------------------------------------
# extends


BASE = """\
name: base
description: the base
model_types: [qwen3]
on_unsupported: skip
patches:
  - target: Qwen3RMSNorm
    op: rms_norm
    scale: weight
  - target: Qwen3MLP
    op: swiglu
  - op: rope
"""


def test_extends_merges_and_replaces_in_place(tmp_path):
    write(tmp_path, "base.yaml", BASE)
    child = write(
        tmp_path,
        "child.yaml",
        """\
        name: child
        extends: base.yaml
        model_types: [qwen3_moe]
        patches:
          - target: Qwen3MLP
            op: swiglu
            kernel: torch
          - target: Qwen3MoeSparseMoeBlock
            op: swiglu
            optional: true
        """,
    )
    patchset = load_patchset(child)
    assert patchset.name == "child"
    assert patchset.extends == "base.yaml"
    assert patchset.model_types == ["qwen3_moe"]  # child overrides
    assert patchset.description == "the base"  # inherited
    assert patchset.on_unsupported == "skip"
    assert [patch_key(p) for p in patchset.patches] == [
        "Qwen3RMSNorm",
        "Qwen3MLP",
        "function:apply_rotary_pos_emb",
        "Qwen3MoeSparseMoeBlock",
    ]
    assert patchset.patches[1].kernel == "torch"  # replaced in place


def test_extends_without_suffix_and_chain(tmp_path):
    write(tmp_path, "base.yaml", BASE)
    sub = tmp_path / "sub"
    sub.mkdir()
    write(sub, "mid.yaml", "name: mid\nextends: ../base\npatches:\n  - op: rope\n    kernel: torch\n")
    leaf = write(sub, "leaf.yaml", "name: leaf\nextends: mid\n")
    patchset = load_patchset(leaf)
    assert patchset.name == "leaf" and patchset.extends == "mid"
    assert len(patchset.patches) == 3 and patchset.patches[2].kernel == "torch"


def test_extends_bundled_name(tmp_path):
    if "qwen3" not in bundled_names():
        pytest.skip("no bundled qwen3 patchset")
    base = load_patchset("qwen3")
    child = write(tmp_path, "c.yaml", "name: mine\nextends: qwen3\non_unsupported: fallback\n")
    patchset = load_patchset(child)
    assert patchset.patches == base.patches
    assert patchset.on_unsupported == "fallback"


def test_extends_cycle(tmp_path):
    a = write(tmp_path, "a.yaml", "name: a\nmodel_types: [x]\nextends: b.yaml\n")
    b = write(tmp_path, "b.yaml", "name: b\nextends: a.yaml\n")
    err = error_of(a)
    assert str(err) == f"{b}:2: extends: extends cycle: {a} -> {b} -> {a}"
    selfish = write(tmp_path, "self.yaml", "name: s\nmodel_types: [x]\nextends: self\n")
    assert str(error_of(selfish)) == f"{selfish}:3: extends: extends cycle: {selfish} -> {selfish}"


def test_extends_missing_names_bundled(tmp_path):
    path = write(tmp_path, "x.yaml", VALID + "extends: nowhere\n")
    err = error_of(path)
    assert str(err).startswith(f"{path}:9: extends: no patchset 'nowhere'")
    assert "bundled patchsets: " in str(err) and f"{len(bundled_names())} in all, listed in docs/bundled_patchsets.md" in str(err)
    assert len(str(err)) < 250 + 3 * len(str(path))  # summarised: not every bundled name on one line (issue 48)
    near = error_of(write(tmp_path, "y.yaml", VALID + "extends: qwen33\n"))
    assert "nearest: qwen3," in str(near)


def test_error_in_base_reports_base_file(tmp_path):
    base = write(tmp_path, "base.yaml", BASE.replace("scale: weight", "scale: wieght"))
    child = write(tmp_path, "child.yaml", "name: child\nextends: base\npatches:\n  - target: X\n    op: swigl\n")
    err = error_of(child)
    assert str(err).splitlines() == [
        f"{child}:5: patches[3].op: op 'swigl' is not one of 'rms_norm', 'gated_rms_norm', 'swiglu', 'geglu', 'layer_norm', 'mlp', 'rope', 'linear_attention', 'fused_linear_cross_entropy', 'moe_experts'; did you mean 'swiglu'?",
        f"{base}:8: patches[0].scale: 'wieght' is not one of 'weight', 'one_plus_weight'",
    ]


def test_syntax_error_in_base_reports_base_file(tmp_path):
    base = write(tmp_path, "base.yaml", "name: [base\n")
    child = write(tmp_path, "child.yaml", "name: child\nextends: base\n")
    err = error_of(child)
    assert err.file == str(base) and str(err).startswith(f"{base}:2: YAML syntax error")


# --------------------------------------------------------------------------------------
# Hostile or broken files


def test_python_tags_are_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "pwned"
    path = write(tmp_path, "x.yaml", VALID + f'description: !!python/object/apply:os.system ["touch {marker}"]\n')
    err = error_of(path)
    assert str(err).startswith(f"{path}:9: description: YAML tag '!!python/object/apply:os.system' is not allowed")
    assert not marker.exists()
    for tag in ("!!python/name:os.system", "!!python/object:os.system", "!custom"):
        path = write(tmp_path, "y.yaml", f"name: {tag} x\n")
        assert "is not allowed" in str(error_of(path))


def test_non_utf8_bytes(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_bytes(b"name: demo\ndescription: caf\xe9\n")
    err = error_of(path)
    assert str(err) == f"{path}:2: not valid UTF-8 (byte 0xe9); save the file as UTF-8"


def test_empty_file(tmp_path):
    for text in ("", "\n# only a comment\n"):
        path = write(tmp_path, "x.yaml", text)
        err = error_of(path)
        assert err.file == str(path)
        assert "the file is empty" in str(err)


def test_top_level_must_be_a_mapping(tmp_path):
    path = write(tmp_path, "x.yaml", "- name: demo\n")
    assert str(error_of(path)) == (
        f"{path}:1: the top level must be a mapping (name: ..., model_types: [...], patches: [...]), not a list"
    )


def test_missing_file(tmp_path):
    err = error_of(tmp_path / "nope.yaml")
    assert str(err) == f"{tmp_path / 'nope.yaml'}: no such file"


def test_deep_nesting(tmp_path):
    depth = MAX_DEPTH + 10
    path = write(tmp_path, "x.yaml", "name: " + "[" * depth + "]" * depth + "\n")
    err = error_of(path)
    assert str(err) == f"{path}:1: nested more than {MAX_DEPTH} levels deep"
    very = write(tmp_path, "y.yaml", "a: " + "[" * 20000 + "]" * 20000 + "\n")
    assert "nested more than" in str(error_of(very))


def test_recursive_alias(tmp_path):
    path = write(tmp_path, "x.yaml", "name: &a [*a]\n")
    assert "nested more than" in str(error_of(path))


def test_billion_laughs_is_refused_quickly(tmp_path):
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, 10):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    path = write(tmp_path, "x.yaml", "\n".join(lines) + "\n")
    start = time.perf_counter()
    err = error_of(path)
    assert time.perf_counter() - start < 2
    assert "YAML nodes" in str(err) and err.file == str(path)


ALPHABET = st.sampled_from(list("ab :-[]{}&*!|>#'\",\n\t?%@`\\.0 \x00\x85\ufeff\u2028é"))


def check_loads_or_patchset_error(path: Path) -> None:
    try:
        load_patchset(path)
    except PatchsetError as err:
        assert err.file is not None
        assert str(err).startswith(err.file)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(ALPHABET, max_size=80) | st.text(max_size=80))
def test_random_text_only_raises_patchset_error(tmp_path, text):
    path = tmp_path / "fuzz.yaml"
    path.write_text(text, encoding="utf-8")
    check_loads_or_patchset_error(path)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    edits=st.lists(
        st.tuples(st.integers(0, len(BASE)), st.integers(0, 3), st.text(ALPHABET, max_size=4)),
        min_size=1,
        max_size=4,
    ),
    raw=st.binary(max_size=4),
)
def test_mutated_yaml_only_raises_patchset_error(tmp_path, edits, raw):
    text = BASE
    for position, deleted, inserted in edits:
        text = text[:position] + inserted + text[position + deleted :]
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(text.encode("utf-8") + raw)
    check_loads_or_patchset_error(path)


# --------------------------------------------------------------------------------------
# JSON Schema


def test_json_schema_is_stable():
    first = json.dumps(json_schema(), indent=2, sort_keys=True)
    assert first == json.dumps(json_schema(), indent=2, sort_keys=True)
    schema = json_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["title"]
    assert "patches" in schema["properties"]


def test_write_json_schema(tmp_path):
    target = tmp_path / "schema.json"
    write_json_schema(target)
    assert target.read_text(encoding="utf-8") == json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"


def test_committed_schema_is_current():
    committed = REPO / "schemas" / "patchset.schema.json"
    expected = json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"
    assert committed.is_file() and committed.read_text(encoding="utf-8") == expected, (
        "schemas/patchset.schema.json is stale; regenerate it with "
        "`patch-engine schema > schemas/patchset.schema.json` (or `python -c \"from engine.loader import "
        "write_json_schema; write_json_schema('schemas/patchset.schema.json')\"`)"
    )


def test_bundled_patchsets_match_the_json_schema():
    jsonschema = pytest.importorskip("jsonschema")
    import yaml

    validator = jsonschema.Draft202012Validator(json_schema())
    for name in bundled_names():
        data = yaml.safe_load((bundled_dir() / f"{name}.yaml").read_text(encoding="utf-8"))
        assert not list(validator.iter_errors(data)), name
    data = yaml.safe_load(VALID.replace("scale:", "scael:"))
    assert list(validator.iter_errors(data))
