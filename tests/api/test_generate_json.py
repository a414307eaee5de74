"""`specdec generate --json-schema FILE` / `--json` on a tiny pair: the printed answer validates."""

import json

import jsonschema
import pytest

from specdec.api.cli import main
from specdec.testing import write_tiny_pair

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def flags(tmp_path_factory):
    target, draft = write_tiny_pair(tmp_path_factory.mktemp("pair"))
    return ["--target", str(target), "--draft", str(draft), "--dtype", "float32", "--kv-cache-memory", "0.05",
            "--max-tokens", "100", "--temperature", "0", "--no-warmup", "--quiet-stats", "--no-chat"]


def test_generate_json_schema_prints_a_valid_document(flags, tmp_path, capsys):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    assert main(["generate", "def fib(n):", "--json-schema", str(path), *flags]) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out.strip()), SCHEMA)


def test_generate_json_schema_refuses_a_bad_file(flags, tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    assert main(["generate", "x", "--json-schema", str(path), *flags]) == 2
    assert main(["generate", "x", "--json-schema", str(tmp_path / "missing.json"), *flags]) == 2
