"""List settings take the same forms from every source: a comma list (``fp32,int4``) and a JSON list
(``["fp32", "int4"]``) from a flag, an environment variable and the TOML file (where a TOML array
works too). Every list setting of both daemons is in the table (a test fails when one is not)."""

from __future__ import annotations

import json
import os
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from tandem.cloud.config import CloudConfig
from tandem.common.protocol.params import Codec, WireDtype
from tandem.common.runtime.cli import parse_command_line
from tandem.common.runtime.settings import UserError
from tandem.edge.config import EdgeConfig

K1, K2 = "key-one-" + "1" * 16, "key-two-" + "2" * 16

# (daemon, field, items as given, the setting's value)
LISTS: list[tuple[type[BaseModel], str, list[str], list[typing.Any]]] = [
    (CloudConfig, "extra_split_dirs", ["a", "b/c"], [Path("a"), Path("b/c")]),
    (CloudConfig, "fidelity_tables", ["a.json", "b/c.json"], [Path("a.json"), Path("b/c.json")]),
    (CloudConfig, "wire_dtypes", ["fp32", "int4"], [WireDtype.FP32, WireDtype.INT4]),
    (CloudConfig, "kv_wire_dtypes", ["FP16", "int8_hadamard"], [WireDtype.FP16, WireDtype.INT8_HADAMARD]),
    (CloudConfig, "codecs", ["zstd", "none"], [Codec.ZSTD, Codec.NONE]),
    (EdgeConfig, "extra_split_dirs", ["a", "b/c"], [Path("a"), Path("b/c")]),
    (EdgeConfig, "cloud_replicas", ["localhost:1", "localhost:2"], ["localhost:1", "localhost:2"]),
    (EdgeConfig, "wire_dtypes", ["fp32", "int4"], [WireDtype.FP32, WireDtype.INT4]),
    (EdgeConfig, "kv_wire_dtypes", ["bf16", "fp32"], [WireDtype.BF16, WireDtype.FP32]),
    (EdgeConfig, "api_keys", [K1, K2], [K1, K2]),
    (EdgeConfig, "http_api_keys", [K1, K2], [K1, K2]),
]
PROG = {CloudConfig: "tandem-cloud", EdgeConfig: "tandem-edge"}
PREFIX = {CloudConfig: "TANDEM_CLOUD_", EdgeConfig: "TANDEM_EDGE_"}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("TANDEM_CLOUD_", "TANDEM_EDGE_")):
            monkeypatch.delenv(k)


def forms(items: list[str]) -> dict[str, str]:
    return {"comma": ",".join(items), "comma and spaces": " , ".join(items), "json": json.dumps(items)}


def settings(model: type[BaseModel], argv: list[str]) -> typing.Any:
    return parse_command_line(model, PROG[model], argv).settings  # type: ignore[type-var]


ids = [f"{m.__name__}.{f}" for m, f, _, _ in LISTS]


@pytest.mark.parametrize(("model", "field", "items", "value"), LISTS, ids=ids)
def test_a_list_from_a_flag(model, field, items, value):
    flag = "--" + field.replace("_", "-")
    for form, text in forms(items).items():
        assert getattr(settings(model, [flag, text]), field) == value, form
    assert getattr(settings(model, [x for item in items for x in (flag, item)]), field) == value  # repeated


@pytest.mark.parametrize(("model", "field", "items", "value"), LISTS, ids=ids)
def test_a_list_from_the_environment(model, field, items, value, monkeypatch):
    """A list setting read from its environment variable as a comma list, with spaces, or JSON
    (``fp32,int4`` in ``TANDEM_CLOUD_WIRE_DTYPES``, as on the flag) has its items' value, as when built
    in code."""
    for form, text in forms(items).items():
        monkeypatch.setenv(PREFIX[model] + field.upper(), text)
        assert getattr(settings(model, []), field) == value, form
        assert getattr(model(), field) == value, form  # built in code, as the tests and benchmarks do


@pytest.mark.parametrize(("model", "field", "items", "value"), LISTS, ids=ids)
def test_a_list_from_the_config_file(model, field, items, value, tmp_path):
    texts = {form: json.dumps(text) for form, text in forms(items).items()} | {"array": json.dumps(items)}
    for form, text in texts.items():  # a JSON string is a TOML basic string
        f = tmp_path / f"{form}.toml"
        f.write_text(f"{field} = {text}\n")
        assert getattr(settings(model, ["--config", str(f)]), field) == value, form


@pytest.mark.parametrize("model", [CloudConfig, EdgeConfig])
def test_every_list_setting_is_in_the_table(model):
    lists = {n for n, info in model.model_fields.items() if typing.get_origin(info.annotation) is list}
    assert lists == {f for m, f, _, _ in LISTS if m is model}


def test_a_list_that_is_neither_form_is_one_line(monkeypatch):
    monkeypatch.setenv("TANDEM_CLOUD_WIRE_DTYPES", '["fp32", int4]')
    with pytest.raises(UserError, match="wire_dtypes: .*not a JSON list"):
        settings(CloudConfig, [])
    monkeypatch.setenv("TANDEM_CLOUD_WIRE_DTYPES", "fp32,int5")
    with pytest.raises(UserError, match="wire_dtypes.1"):
        settings(CloudConfig, [])
    monkeypatch.setenv("TANDEM_CLOUD_WIRE_DTYPES", "")
    with pytest.raises(UserError, match="wire_dtypes: List should have at least 1 item"):
        settings(CloudConfig, [])
