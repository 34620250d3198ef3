"""tools/verify_checkpoint.py and tools/convert_checkpoint.py: header-only checks, Hub reads, conversion round trips."""

import json
import math
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel

import tools
from dspark.configuration_dspark import DSPARK_KEYS, DSparkConfig
from dspark.modeling_dspark import DSparkDraftModel
from test_config import tiny_kwargs
from tools import convert_checkpoint, verify_checkpoint
from tools.common import REMOTE_CODE_FILES
from tools.convert_checkpoint import convert_checkpoint as convert, write_hub_checkpoint
from tools.verify_checkpoint import verify_checkpoint as verify

KIMI_K3_PARAMETERS, KIMI_K3_TENSORS = 2_249_289_601, 62


def tiny_draft(seed: int = 0) -> DSparkDraftModel:
    torch.manual_seed(seed)
    model = DSparkDraftModel(DSparkConfig(**tiny_kwargs()))
    with torch.no_grad():  # non-trivial norms and heads, so every tensor shows in the outputs
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "head" in name:
                param.normal_(1.0 if "norm" in name else 0.0, 0.3)
    return model.eval()


def draft_outputs(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden rows and confidence logits of one block after a random context (fixed inputs)."""
    generator = torch.Generator().manual_seed(1)
    config = model.config
    features = torch.randn(2, 5, len(config.target_layer_ids) * config.hidden_size, generator=generator)
    embeds = torch.randn(2, config.block_size, config.hidden_size, generator=generator)
    prev_ids = torch.randint(0, config.vocab_size, (2, config.block_size), generator=generator)
    cache = model.new_context_cache()
    with torch.no_grad():
        model.append_context(cache, features.to(model.dtype), torch.arange(5).expand(2, -1))
        hidden = model(embeds.to(model.dtype), 5 + torch.arange(config.block_size).expand(2, -1), cache)
        return hidden, model.confidence_logits(hidden, prev_ids)


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A valid tiny Hub-layout checkpoint (bf16, one file)."""
    model = tiny_draft()
    write_hub_checkpoint(model.state_dict(), model.config, tmp_path / "draft")
    return tmp_path / "draft"


def failed_checks(report: dict) -> dict[str, list[str]]:
    return {check["name"]: check["errors"] for check in report["checks"] if check["status"] == "fail"}


def run_cli(module, argv, capsys) -> tuple[int, dict]:
    code = module.main([*map(str, argv), "--json"])
    return code, json.loads(capsys.readouterr().out)


# ---------------------------------------------------------------- verifier


def test_valid_checkpoint_passes_with_json_report(checkpoint, capsys):
    code, report = run_cli(verify_checkpoint, [checkpoint], capsys)
    assert code == 0 and report["ok"] and not failed_checks(report)
    assert report["num_tensors"] == len(tiny_draft().state_dict())
    assert report["parameters"] == report["expected_parameters"] == tiny_draft().num_parameters()
    assert report["files"] == ["model.safetensors"] and report["dtype"] == "bfloat16"


def rewrite_weights(checkpoint: Path, edit) -> None:
    state_dict = load_file(checkpoint / "model.safetensors")
    edit(state_dict)
    save_file(state_dict, checkpoint / "model.safetensors", metadata={"format": "pt"})


def rewrite_config(checkpoint: Path, edit) -> None:
    raw = json.loads((checkpoint / "config.json").read_text())
    edit(raw)
    (checkpoint / "config.json").write_text(json.dumps(raw))


def truncate(checkpoint: Path) -> None:
    path = checkpoint / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 2)


def write_raw_header(checkpoint: Path, header: bytes) -> None:
    """Replaces model.safetensors by a file whose header is `header` (no data)."""
    (checkpoint / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)


def shard_index_without_weight_map(checkpoint: Path) -> None:
    (checkpoint / "model.safetensors").rename(checkpoint / "model-00001-of-00001.safetensors")
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 1}}))


def poisoned(tensor: torch.Tensor, value: float) -> torch.Tensor:
    """A copy of `tensor` whose first element is `value`."""
    copy = tensor.clone()
    copy.view(-1)[0] = value
    return copy


def set_tensor(name: str, make):
    return lambda checkpoint: rewrite_weights(checkpoint, lambda sd: sd.update({name: make(sd)}))


def edit_config(edit):
    return lambda checkpoint: rewrite_config(checkpoint, edit)


def set_config_value(key: str, value):
    """Writes `value` wherever config.json holds `key` (the DSpark keys are also in `dflash_config`)."""
    def edit(raw):
        for keys in (raw, raw["dflash_config"]):
            if key in keys:
                keys[key] = value
    return edit_config(edit)


# failure: (how to corrupt a valid checkpoint, the check that must fail, a phrase of its error)
FAILURES = {
    "wrong shape": (set_tensor("fc.weight", lambda sd: sd["fc.weight"][:, 1:].clone()),
                    "tensors: shapes", "fc.weight: [32, 63], expected [32, 64]"),
    "missing tensor": (lambda c: rewrite_weights(c, lambda sd: sd.pop("norm.weight")),
                       "tensors: names", "1 missing: norm.weight"),
    "wrong dtype": (set_tensor("norm.weight", lambda sd: sd["norm.weight"].float()),
                    "tensors: dtypes", "norm.weight: F32, expected BF16"),
    "extra tensor changes the parameter count": (
        set_tensor("lm_head.weight", lambda sd: torch.zeros(64, 32, dtype=torch.bfloat16)),
        "tensors: parameter count", "parameters, the config's draft has"),
    "truncated file": (truncate, "files: safetensors headers and layout", "truncated or padded file"),
    "missing top-level key": (edit_config(lambda raw: raw.pop("markov_rank")),
                              "config: top-level keys (SGLang)", "missing ['markov_rank']"),
    "nested and top-level disagree": (edit_config(lambda raw: raw["dflash_config"].update(block_size=5)),
                                      "config: dflash_config (SpecForge)", "`block_size` is 5 here but 4 at the top"),
    "missing dflash_config": (edit_config(lambda raw: raw.pop("dflash_config")),
                              "config: dflash_config (SpecForge)", "missing"),
    "is_causal": (edit_config(lambda raw: raw.update(is_causal=False)),
                  "config: top-level keys (SGLang)", "`is_causal` present"),
    "architectures": (edit_config(lambda raw: raw.update(architectures=["Qwen3ForCausalLM"])),
                      "config: architectures", "need ['DSparkDraftModel']"),
    "remote code missing": (lambda c: (c / "modeling_dspark.py").unlink(),
                            "config: auto_map and remote-code files", "whose file is missing"),
    "block_size a string": (set_config_value("block_size", "4"),
                            "config: DSparkConfig accepts it", "`block_size` = '4': must be an integer, not str"),
    "float target layer ids": (set_config_value("target_layer_ids", [1.0, 3.0]), "config: DSparkConfig accepts it",
                               "`target_layer_ids` = [1.0, 3.0]: must be a list of integers, not a list of float"),
    "rms_norm_eps a string": (set_config_value("rms_norm_eps", "1e-5"), "config: DSparkConfig accepts it",
                              "`rms_norm_eps` = '1e-5': must be a finite number, not str"),
    "unknown hidden_act": (set_config_value("hidden_act", "bogus"), "config: DSparkConfig accepts it",
                           "`hidden_act` = 'bogus': unknown activation"),
    "header is a JSON list": (lambda c: write_raw_header(c, b"[1, 2]  "), "files: safetensors headers and layout",
                              "the header is a JSON list, not an object"),
    "header entry with a text shape": (
        lambda c: write_raw_header(c, b'{"fc.weight": {"dtype": "BF16", "shape": "32x64", "data_offsets": [0, 4]}}'),
        "files: safetensors headers and layout", "malformed header entry for fc.weight"),
    "index without weight_map": (shard_index_without_weight_map, "files: safetensors headers and layout",
                                 "model.safetensors.index.json: no `weight_map` object"),
    "dflash_config not an object": (edit_config(lambda raw: raw.update(dflash_config=7)),
                                    "config: dflash_config (SpecForge)", "missing or not an object"),
    "dtype a list": (set_config_value("dtype", ["bfloat16"]), "config: DSparkConfig accepts it",
                     "`dtype` = ['bfloat16']: must be a torch dtype name"),
    "auto_map not an object": (edit_config(lambda raw: raw.update(auto_map=["x"])),
                               "config: auto_map and remote-code files", "auto_map has no AutoConfig"),
}


@pytest.mark.parametrize("failure", FAILURES)
def test_each_mismatch_fails_with_a_clear_message(failure, checkpoint, capsys):
    corrupt, check_name, message = FAILURES[failure]
    corrupt(checkpoint)
    code, report = run_cli(verify_checkpoint, [checkpoint], capsys)
    assert code == 1 and not report["ok"]
    assert any(message in error for error in failed_checks(report)[check_name]), failed_checks(report)


def test_invalid_config_skips_the_tensor_checks(checkpoint):
    rewrite_config(checkpoint, lambda raw: raw["dflash_config"].update(block_size=5))
    report = verify(str(checkpoint))
    assert "`block_size` is 4 at the top level but 5" in failed_checks(report)["config: DSparkConfig accepts it"][0]
    assert [c["name"] for c in report["checks"] if c["status"] == "skipped"] == ["tensors"]


def test_expected_parameter_count_option(checkpoint, capsys):
    code, report = run_cli(verify_checkpoint, [checkpoint, "--expected-parameters", KIMI_K3_PARAMETERS], capsys)
    assert code == 1
    assert "expected 2,249,289,601 (--expected-parameters)" in failed_checks(report)["tensors: parameter count"][-1]


@pytest.mark.parametrize(
    "config_text, message",
    [
        (None, "no config.json"),
        ("[1, 2]", "config.json holds a JSON list, not an object"),
        ("{", "cannot read config.json (ValueError: config.json: not valid JSON"),
        ('{"dtype": "int8"}', "unsupported dtype 'int8'"),
    ],
)
def test_unreadable_checkpoint_exits_2_with_one_error_line(tmp_path, capsys, config_text, message):
    if config_text is not None:
        (tmp_path / "config.json").write_text(config_text)
    assert verify_checkpoint.main([str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert out.startswith("error: ") and out.count("\n") == 1 and message in out
    code, failure = run_cli(verify_checkpoint, [tmp_path], capsys)
    assert code == 2 and not failure["ok"] and message in failure["error"]


def test_text_report(checkpoint, capsys):
    rewrite_weights(checkpoint, lambda sd: sd.pop("norm.weight"))
    assert verify_checkpoint.main([str(checkpoint)]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] tensors: names" in out and "- 1 missing: norm.weight" in out
    assert out.rstrip().endswith("FAILED: 2 check(s)")


def poison_tensor(name: str, value: float):
    return set_tensor(name, lambda sd: poisoned(sd[name], value))


VALUE_PROBLEMS = {  # (how to corrupt a valid checkpoint's weights, the finding of --values)
    "NaN": (poison_tensor("layers.0.mlp.up_proj.weight", math.nan),
            "model.safetensors: layers.0.mlp.up_proj.weight: 1 of 2,048 values are NaN or inf"),
    "inf": (poison_tensor("markov_head.markov_w1.weight", math.inf),
            "model.safetensors: markov_head.markov_w1.weight: 1 of 512 values are NaN or inf"),
    "integer tensor": (set_tensor("norm.weight", lambda sd: torch.ones(32, dtype=torch.int32)),
                       "model.safetensors: norm.weight: int32 values; draft weights are floating point"),
}


@pytest.mark.parametrize("problem", VALUE_PROBLEMS)
def test_values_option_reads_every_tensor_for_nonfinite_and_non_float_values(problem, checkpoint, capsys):
    code, report = run_cli(verify_checkpoint, [checkpoint, "--values"], capsys)
    values = next(check for check in report["checks"] if check["name"] == "tensors: values (finite, floating point)")
    assert code == 0 and values["detail"] == f"{len(tiny_draft().state_dict())} tensors read"
    corrupt, message = VALUE_PROBLEMS[problem]
    corrupt(checkpoint)
    code, report = run_cli(verify_checkpoint, [checkpoint, "--values"], capsys)
    assert code == 1 and failed_checks(report)["tensors: values (finite, floating point)"] == [message]


def test_values_option_needs_a_local_directory(capsys):
    code, failure = run_cli(verify_checkpoint, ["RadixArk/Kimi-K3-DSpark", "--values"], capsys)
    assert code == 2 and "--values reads every tensor, so it needs a local directory" in failure["error"]


# ---------------------------------------------------------------- header-only reads, sharding, the Hub


class CountingFile:
    def __init__(self, file, counter: dict, name: str):
        self.file, self.counter, self.name = file, counter, name

    def read(self, size: int = -1) -> bytes:
        data = self.file.read(size)
        self.counter[self.name] = self.counter.get(self.name, 0) + len(data)
        return data

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


class FakeHubFileSystem:
    """`HfFileSystem` stand-in: `owner/name[@revision]/file` maps to `repos[owner/name]/file`; counts bytes read."""

    def __init__(self, repos: dict[str, Path]):
        self.repos, self.bytes_read, self.revisions = repos, {}, set()

    def _local(self, path: str) -> Path:
        owner, name, filename = path.split("/", 2)
        name, _, revision = name.partition("@")
        self.revisions.add(revision)
        return self.repos[f"{owner}/{name}"] / filename

    def exists(self, path: str) -> bool:
        return self._local(path).exists()

    def size(self, path: str) -> int:
        return self._local(path).stat().st_size

    def open(self, path: str, mode: str = "rb", **kwargs):
        return CountingFile(open(self._local(path), mode), self.bytes_read, path.rsplit("/", 1)[-1])


def header_length(path: Path) -> int:
    with open(path, "rb") as f:
        return struct.unpack("<Q", f.read(8))[0]


def test_hub_repository_id_reads_only_headers(checkpoint, monkeypatch, capsys):
    filesystem = FakeHubFileSystem({"RadixArk/Kimi-K3-DSpark": checkpoint})
    monkeypatch.setattr(verify_checkpoint, "HfFileSystem", lambda: filesystem)
    code, report = run_cli(verify_checkpoint, ["RadixArk/Kimi-K3-DSpark", "--revision", "refs/pr/1"], capsys)
    assert code == 0 and report["ok"] and report["source"] == "hub"
    assert filesystem.revisions == {"refs%2Fpr%2F1"}
    assert filesystem.bytes_read["model.safetensors"] == 8 + header_length(checkpoint / "model.safetensors")


def test_sharded_checkpoint_and_index_consistency(tmp_path):
    model = tiny_draft()
    files = write_hub_checkpoint(model.state_dict(), model.config, tmp_path, max_shard_size=40_000)
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    report = verify(str(tmp_path))
    assert report["ok"] and report["files"] == files and report["parameters"] == model.num_parameters()

    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["norm.weight"] = next(f for f in files if f != index["weight_map"]["norm.weight"])
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    errors = failed_checks(verify(str(tmp_path)))["files: safetensors headers and layout"]
    assert any("holds norm.weight, which model.safetensors.index.json maps to" in e for e in errors)


def kimi_k3_tensor_table() -> dict[str, list[int]]:
    """The published checkpoint's tensors, written out from its specification (DSPARK.md section 1)."""
    H, r, V = 7168, 256, 163840
    table = {"fc.weight": [H, 5 * H], "hidden_norm.weight": [H], "norm.weight": [H],
             "markov_head.markov_w1.weight": [V, r], "markov_head.markov_w2.weight": [V, r],
             "confidence_head.proj.weight": [1, H + r], "confidence_head.proj.bias": [1]}  # fmt: skip
    for n in range(5):
        layer = f"layers.{n}."
        table |= {layer + "input_layernorm.weight": [H], layer + "post_attention_layernorm.weight": [H],
                  layer + "self_attn.q_proj.weight": [4096, H], layer + "self_attn.k_proj.weight": [1024, H],
                  layer + "self_attn.v_proj.weight": [1024, H], layer + "self_attn.o_proj.weight": [H, 4096],
                  layer + "self_attn.q_norm.weight": [64], layer + "self_attn.k_norm.weight": [64],
                  layer + "mlp.gate_proj.weight": [14336, H], layer + "mlp.up_proj.weight": [14336, H],
                  layer + "mlp.down_proj.weight": [H, 14336]}  # fmt: skip
    return table


def write_header_only_safetensors(path: Path, shapes: dict[str, list[int]]) -> int:
    """A BF16 safetensors file with a real header and a sparse (unallocated) data section; returns the data size."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        size = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return offset


def test_shipped_config_matches_the_published_checkpoint(tmp_path):
    assert verify(str(tools.REPO_ROOT), config_only=True)["ok"]

    shutil.copy(tools.REPO_ROOT / "config.json", tmp_path / "config.json")
    convert_checkpoint.copy_remote_code(tmp_path)
    data_size = write_header_only_safetensors(tmp_path / "model.safetensors", kimi_k3_tensor_table())
    assert data_size == 2 * KIMI_K3_PARAMETERS  # 4.5 GB, none of it allocated or read

    report = verify(str(tmp_path), expected_parameters=KIMI_K3_PARAMETERS)
    assert report["ok"], failed_checks(report)
    assert (report["num_tensors"], report["parameters"]) == (KIMI_K3_TENSORS, KIMI_K3_PARAMETERS)


# ---------------------------------------------------------------- converter


def specforge_names(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """SpecForge's names: `model.` before the backbone, the heads in the legacy `logit_head.` container."""
    renamed = {}
    for name, tensor in state_dict.items():
        if name.startswith(("markov_head.", "confidence_head.")):
            renamed["logit_head." + name.split(".", 1)[1]] = tensor
        else:
            renamed["model." + name] = tensor
    return renamed


def load_remote_code(directory: Path):
    return AutoModel.from_pretrained(directory, trust_remote_code=True).eval()


def test_specforge_sharded_safetensors_round_trip(tmp_path):
    model = tiny_draft()
    source = tmp_path / "specforge"
    source.mkdir()
    tensors = specforge_names(model.state_dict()) | {"model.embed_tokens.weight": torch.zeros(64, 32)}
    names = sorted(tensors)
    weight_map = {name: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, name in enumerate(names)}
    for shard in set(weight_map.values()):
        save_file({n: tensors[n] for n in names if weight_map[n] == shard}, source / shard)
    (source / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    raw = model.config.to_dict()  # SpecForge style: DSpark keys nested only, plus a stray is_causal
    raw = {k: v for k, v in raw.items() if k not in DSPARK_KEYS} | {"is_causal": True, "architectures": ["X"]}
    (source / "config.json").write_text(json.dumps(raw))

    report = convert(source, tmp_path / "hub_sharded", max_shard_size="40KB")
    assert report["ok"] and len(report["files"]) > 1, failed_checks(report["verification"])
    written = json.loads((tmp_path / "hub_sharded" / "config.json").read_text())
    assert "is_causal" not in written and written["architectures"] == ["DSparkDraftModel"]
    assert all(written[key] == written["dflash_config"][key] == model.config.dflash_config[key] for key in DSPARK_KEYS)

    loaded = load_remote_code(tmp_path / "hub_sharded")
    assert loaded.dtype == torch.bfloat16
    for expected, actual in zip(draft_outputs(model.to(torch.bfloat16)), draft_outputs(loaded)):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_wrapped_torch_state_dict_round_trip_in_float32(tmp_path, capsys):
    model = tiny_draft()
    torch.save({"model": specforge_names(model.state_dict()), "step": 7}, tmp_path / "draft.pt")
    model.config.to_json_file(tmp_path / "draft_config.json")

    code, report = run_cli(convert_checkpoint, [tmp_path / "draft.pt", tmp_path / "hub_pt", "--config",
                                                tmp_path / "draft_config.json", "--dtype", "float32"], capsys)
    assert code == 0 and report["files"] == ["model.safetensors"] and report["verification"]["dtype"] == "float32"
    loaded = load_remote_code(tmp_path / "hub_pt")
    for expected, actual in zip(draft_outputs(model), draft_outputs(loaded)):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_converter_refuses_tensors_that_do_not_match_the_config(tmp_path, capsys):
    model = tiny_draft()
    save_file(model.state_dict(), tmp_path / "model.safetensors")
    DSparkConfig(**tiny_kwargs(num_hidden_layers=3)).to_json_file(tmp_path / "config.json")
    code, report = run_cli(convert_checkpoint, [tmp_path, tmp_path / "out"], capsys)
    assert code == 2 and "missing: layers.2." in report["error"] and not (tmp_path / "out").exists()


class RunsCodeWhenUnpickled:
    def __reduce__(self):
        return exec, ("raise SystemExit('unpickled')",)


def torch_file(content):
    return lambda source: torch.save(content, source / "draft.pt")


def truncated_torch_file(source: Path) -> None:
    torch.save(tiny_draft().state_dict(), source / "draft.pt")
    data = (source / "draft.pt").read_bytes()
    (source / "draft.pt").write_bytes(data[: len(data) // 2])


def truncated_safetensors(source: Path) -> None:
    save_file(tiny_draft().state_dict(), source / "model.safetensors")
    truncate(source)


def safetensors_source(edit):
    """Writes the tiny draft's weights into the source folder after `edit` (a state dict -> state dict)."""
    return lambda source: save_file(edit(dict(tiny_draft().state_dict())), source / "model.safetensors")


# source: (how to write the bad part of a checkpoint folder that has a valid config.json, a phrase of the error)
BAD_SOURCES = {
    ".pt holding a list": (torch_file([1, 2]), "draft.pt: holds list data, not a state dict"),
    ".pt holding a tensor": (torch_file(torch.zeros(3)), "draft.pt: holds Tensor data, not a state dict"),
    ".pt holding an int": (torch_file(7), "draft.pt: holds int data, not a state dict"),
    ".pt holding code": (torch_file({"fc.weight": RunsCodeWhenUnpickled()}), "unpickling them could run code"),
    "truncated .pt": (truncated_torch_file, "draft.pt: not a readable .pt weight file: truncated or corrupt"),
    "truncated safetensors": (truncated_safetensors,
                              "model.safetensors: not a readable .safetensors weight file: truncated or corrupt"),
    "index without weight_map": (lambda source: (source / "model.safetensors.index.json").write_text("{}"),
                                 "model.safetensors.index.json: no `weight_map` object"),
    "index that is not JSON": (lambda source: (source / "model.safetensors.index.json").write_text("{"),
                               "model.safetensors.index.json: not valid JSON"),
    "config that is a list": (lambda source: (source / "config.json").write_text("[]"),
                              "config.json: holds a JSON list, not a config object"),
    "NaN weight": (safetensors_source(lambda sd: sd | {"fc.weight": poisoned(sd["fc.weight"], math.nan)}),
                   "fc.weight: 1 of 2,048 values are NaN or inf"),
    "integer weight": (safetensors_source(lambda sd: sd | {"norm.weight": torch.ones(32, dtype=torch.int64)}),
                       "norm.weight: int64 values; draft weights are floating point"),
    "one tensor under two names": (safetensors_source(lambda sd: sd | {"model.fc.weight": sd["fc.weight"].clone()}),
                                   "holds 'fc.weight' twice, as 'fc.weight' and as 'model.fc.weight'"),
}


@pytest.mark.parametrize("source_kind", BAD_SOURCES)
def test_converter_reports_a_bad_source_in_one_error_line(source_kind, tmp_path, capsys):
    write, message = BAD_SOURCES[source_kind]
    source = tmp_path / "source"
    source.mkdir()
    DSparkConfig(**tiny_kwargs()).to_json_file(source / "config.json")
    write(source)
    assert convert_checkpoint.main([str(source), str(tmp_path / "out")]) == 2
    out = capsys.readouterr().out
    assert out.startswith("error: ") and out.count("\n") == 1 and message in out, out
    code, failure = run_cli(convert_checkpoint, [source, tmp_path / "out"], capsys)
    assert code == 2 and not failure["ok"] and message in failure["error"]
    assert not (tmp_path / "out").exists()


def test_every_shipped_draft_folder_carries_the_repository_remote_code_unchanged():
    """The Hub layout needs the remote code beside each draft's weights: those copies are the top-level files."""
    draft_folders = sorted({path.parent for path in (tools.REPO_ROOT / "embedded").rglob("modeling_dspark.py")})
    assert len(draft_folders) >= 4  # the Kimi pair's drafts and SmolLM2's
    for folder in draft_folders:
        for name in REMOTE_CODE_FILES:
            assert (folder / name).read_bytes() == (tools.REPO_ROOT / name).read_bytes(), (
                f"{folder.relative_to(tools.REPO_ROOT)}/{name} differs from the top-level {name}: copy it over")
