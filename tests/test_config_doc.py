"""docs/config.md is the schema rendered (vramfit/config/reference.py): it cannot fall behind the
keys, their defaults or their descriptions, and every key has a description to render."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from vramfit.config.reference import REGENERATE, SECTIONS, main, render
from vramfit.config.schema import RunConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def test_docs_config_md_is_the_rendered_schema():
    assert DOC.read_text(encoding="utf-8") == render(), (
        f"docs/config.md differs from the schema; regenerate it from the repository root: {REGENERATE}")


def test_every_section_and_key_is_described():
    assert set(SECTIONS) == set(RunConfig.model_fields), "reference.py SECTIONS: a line for every section"
    missing = [f"{section}.{key}" for section, info in RunConfig.model_fields.items()
               for key, field in info.annotation.model_fields.items()
               if not (field.description or "").strip()]
    assert missing == [], f"give these keys a description= in vramfit/config/schema.py: {missing}"
    text = render()
    for section, info in RunConfig.model_fields.items():
        assert f"## [{section}]" in text
        for key in info.annotation.model_fields:
            assert text.count(f"| `{section}.{key}` |") == 1


def test_rows_show_the_written_type_and_default():
    rows = {line.split(" | ")[0][3:-1]: line for line in render().splitlines() if line.startswith("| `")}
    # the schema's default, not what this machine resolves "auto" to
    assert '| boolean or `"auto"` | `"auto"` |' in rows["train.cuda_graphs"]
    assert '| list of 2: float (at least 0, below 1), float (at least 0, below 1) | `[0.9, 0.999]` |' \
        in rows["train.betas"]
    assert "| integer (1 to 1024) or `\"auto\"` |" in rows["train.cpu_threads"]
    assert "| string (not empty), or unset | unset |" in rows["data.instance_prompt"]
    assert '`["to_q", "to_k", "to_v", "to_out.0"]`' in rows["lora.targets"]
    # "<name>" outside code would open an HTML tag and vanish from the rendered page
    assert "\\<name>.safetensors" in rows["save.name"] and " <name>" not in rows["save.name"]


def test_write_from_the_repository_root_and_refused_elsewhere(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["--write"]) == 2
    assert "run this from the repository root" in capsys.readouterr().err
    assert main(["--frobnicate"]) == 2 and "usage:" in capsys.readouterr().err
    (tmp_path / "docs").mkdir()
    assert main(["--write"]) == 0
    assert (tmp_path / "docs" / "config.md").read_text(encoding="utf-8") == render()


def test_the_reference_does_not_import_torch():
    # config is the lowest layer: rendering the reference must not pull in torch (or the model libraries)
    code = ("import sys; from vramfit.config.reference import render; render(); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'diffusers', 'transformers'}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
