"""deltaserve/model_configs: the shipped published configs, the hub ids naming them, and how a MODEL argument
resolves (a local path, then the Hugging Face cache, then a shipped config where no weights are needed)."""

import json
import shutil
from pathlib import Path

import pytest

from deltaserve import LLM, SamplingParams, cli, model_configs
from deltaserve.cache import plan_cli
from deltaserve.config import ConfigError, ModelConfig
from deltaserve.model_configs import CONFIGS_DIR, KNOWN_MODELS, KnownModel, resolve_model

PUBLISHED = Path(__file__).resolve().parents[1] / ".." / "shared" / "configs"  # beside the main checkout only
QUANT_METHODS = {"fp8": "fp8", "awq": "compressed-tensors", "nvfp4": "modelopt"}  # folder suffix -> quant_method


@pytest.mark.parametrize("known", KNOWN_MODELS, ids=lambda m: m.hub_id)
def test_every_known_hub_id_resolves_offline_to_its_config(known):
    folder = resolve_model(known.hub_id, need_weights=False)
    assert folder == CONFIGS_DIR / known.folder
    assert resolve_model(known.hub_id.lower(), need_weights=False) == folder  # the Hub ignores case
    ModelConfig.from_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())
    suffix = known.folder.rsplit("-", 1)[-1]
    method = (raw.get("quantization_config") or {}).get("quant_method")
    assert method == QUANT_METHODS.get(suffix), f"{known.folder}: quant_method {method!r}"
    assert (folder / "hf_quant_config.json").is_file() == (suffix == "nvfp4")


def test_every_shipped_folder_has_a_hub_id():
    on_disk = {p.parent.name for p in CONFIGS_DIR.glob("*/config.json")}
    assert on_disk == {m.folder for m in KNOWN_MODELS}


def test_shipped_configs_are_the_published_files():
    if not PUBLISHED.is_dir():
        pytest.skip(f"{PUBLISHED} is absent: the published originals live beside the main checkout, not in a clone")
    published = sorted(p.relative_to(PUBLISHED) for p in PUBLISHED.glob("*/*.json"))
    assert published == sorted(p.relative_to(CONFIGS_DIR) for p in CONFIGS_DIR.glob("*/*.json"))
    for name in published:
        assert (CONFIGS_DIR / name).read_bytes() == (PUBLISHED / name).read_bytes(), name


def test_a_local_path_comes_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = Path("Qwen/Qwen3.5-27B")  # a folder that happens to be spelled like the hub id
    local.mkdir(parents=True)
    assert resolve_model("Qwen/Qwen3.5-27B", need_weights=True) == local
    config_file = CONFIGS_DIR / "qwen3.5-4b" / "config.json"
    assert resolve_model(str(config_file), need_weights=True) == config_file  # `plan` takes a config.json


def fake_hf_cache(cache: Path, hub_id: str, checkpoint: Path) -> Path:
    """The Hugging Face cache layout for one repository at revision main, holding `checkpoint`'s files."""
    repo = cache / ("models--" + hub_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    shutil.copytree(checkpoint, snapshot)
    return snapshot


def test_the_hugging_face_cache_comes_before_the_shipped_config(tmp_path, monkeypatch, ckpt_qwen3_5):
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    snapshot = fake_hf_cache(tmp_path, "Qwen/Qwen3.5-27B", ckpt_qwen3_5)
    assert resolve_model("Qwen/Qwen3.5-27B", need_weights=True).resolve() == snapshot.resolve()
    assert resolve_model("Qwen/Qwen3.5-27B", need_weights=False).resolve() == snapshot.resolve()
    assert resolve_model("Qwen/Qwen3.5-4B", need_weights=False) == CONFIGS_DIR / "qwen3.5-4b"  # not cached
    llm = LLM("Qwen/Qwen3.5-27B", max_model_len=64)  # the cached checkpoint's real weights and tokenizer
    assert llm.engine.model_path.resolve() == snapshot.resolve()
    assert llm.engine.tokenizer.decode(llm.engine.tokenizer.encode("Hello")) == "Hello"


def test_weights_of_a_hub_id_without_a_local_copy_are_refused(tmp_path, monkeypatch):
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))  # an empty cache
    with pytest.raises(ConfigError) as error:
        resolve_model("Qwen/Qwen3.5-27B", need_weights=True)
    message = str(error.value)
    assert "MODEL 'Qwen/Qwen3.5-27B' is a hub id with no local copy" in message
    assert "downloads nothing" in message and "local checkpoint directory" in message
    assert "--load-format dummy" in message


def test_unknown_names_and_missing_paths_are_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the relative path below must name nothing, wherever the clone sits
    with pytest.raises(ConfigError, match=r"MODEL 'nobody/Nothing-1B' is neither a local directory.*"
                                          r"Qwen/Qwen3.5-27B.*; pass a local checkpoint directory"):
        resolve_model("nobody/Nothing-1B", need_weights=False)
    # the README's old ../shared path: no such directory, and the hub id its config ships under
    with pytest.raises(ConfigError, match=r"--tokenizer '../shared/configs/qwen3.5-27b-fp8': no such file or "
                                          r"directory; its published config ships with deltaserve as "
                                          r"'Qwen/Qwen3.5-27B-FP8'"):
        resolve_model("../shared/configs/qwen3.5-27b-fp8", need_weights=False, flag="--tokenizer")
    with pytest.raises(ConfigError, match=r"^MODEL '/no/such/dir': no such file or directory$"):
        resolve_model("/no/such/dir", need_weights=False)


@pytest.fixture
def tiny_hub_id(tmp_path, monkeypatch, ckpt_qwen3_5):
    """A hub id whose shipped config is the tiny demo model's config.json alone (no weights, no tokenizer)."""
    configs = tmp_path / "model_configs"
    (configs / "tiny").mkdir(parents=True)
    shutil.copy(ckpt_qwen3_5 / "config.json", configs / "tiny" / "config.json")
    monkeypatch.setattr(model_configs, "CONFIGS_DIR", configs)
    monkeypatch.setitem(model_configs._BY_ID, "test-org/tiny", KnownModel("test-org/Tiny", "tiny", False))
    return "test-org/Tiny"


def test_a_hub_id_serves_dummy_weights_with_a_synthetic_tokenizer(tiny_hub_id):
    llm = LLM(tiny_hub_id, load_format="dummy", max_model_len=64)
    vocab_size = llm.engine.model_config.vocab_size
    assert len(llm.engine.tokenizer) == vocab_size  # token i is the word t{i}, for every id of the vocabulary
    output = llm.generate(["t1 t2 t3"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                          use_tqdm=False)[0]
    assert output.prompt_token_ids == [1, 2, 3]
    assert output.outputs[0].text.split() == [f"t{i}" for i in output.outputs[0].token_ids]


def test_serve_takes_a_hub_id_with_dummy_weights_and_refuses_it_without(tiny_hub_id, tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    args = cli.build_parser().parse_args(["serve", tiny_hub_id, "--load-format", "dummy"])
    engine, settings = cli.configs_from_args(args)
    assert engine.model == str(model_configs.CONFIGS_DIR / "tiny")  # the server reads that folder
    assert settings.served_model_names == (tiny_hub_id,)  # the API answers to the name as given, as vLLM's
    assert cli.main(["serve", tiny_hub_id]) == 2  # weights wanted, none here: refused before loading anything
    err = capsys.readouterr().err
    assert f"deltaserve serve: error: MODEL '{tiny_hub_id}' is a hub id with no local copy" in err


@pytest.mark.parametrize("hub_id", sorted({m.hub_id for m in KNOWN_MODELS}))
def test_plan_takes_every_hub_id(hub_id, capsys):
    assert plan_cli.main([hub_id, "--gpu", "h200", "--max-model-len", "32768"]) in (0, 1)  # 1: it does not fit
    assert f"Memory plan for {hub_id.split('/')[-1]} on H200" in capsys.readouterr().out
