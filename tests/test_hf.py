"""Hugging Face interop: raypar checkpoints load in transformers, HF weights load in raypar."""
from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from raypar.checkpoint import CheckpointError, Manifest, commit, merge_entries, write_shard  # noqa: E402
from raypar.config import Config, ConfigError, ModelConfig, from_dict  # noqa: E402
from raypar.hf import export_checkpoint_to_hf, hf_config, load_hf_weights, model_config_from_hf  # noqa: E402
from raypar.model import build_stage, load_unstacked, unstacked  # noqa: E402

DENSE = ModelConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=40, max_seq_len=16,
                    rope_theta=5000.0, norm_eps=1e-6)
MOE = dataclasses.replace(DENSE, n_experts=4, moe_top_k=2, moe_every=1, moe_ffn_dim=24)
CONFIGS = pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])


def _model(cfg: ModelConfig, seed: int = 0) -> torch.nn.Module:
    model = build_stage(cfg, 0, 1, seed=seed)
    # Norms start at 1.0; perturbing every tensor makes a swapped name show in the logits.
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


def _save_checkpoint(ckpt: pathlib.Path, cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> pathlib.Path:
    pieces = [(n, t, (0,) * t.ndim, tuple(t.shape)) for n, t in tensors.items()]
    results = write_shard(ckpt, "shard-00000.safetensors", pieces)
    manifest = Manifest(step=1, config=Config(model=cfg).to_dict(),
                        tensors=merge_entries(results, {n: t.shape for n, t in tensors.items()}))
    commit(ckpt, manifest)
    return ckpt


def _tokens(cfg: ModelConfig) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (3, cfg.max_seq_len), generator=torch.Generator().manual_seed(7))


def _hf_logits(out_dir: pathlib.Path, tokens: torch.Tensor) -> torch.Tensor:
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        out_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    # A weight the loader did not recognise would be left randomly initialised.
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        return hf.eval()(tokens).logits


@CONFIGS
def test_export_matches_transformers(tmp_path: pathlib.Path, cfg: ModelConfig) -> None:
    model = _model(cfg)
    ckpt = _save_checkpoint(tmp_path / "step-000000001", cfg, dict(unstacked(model)))
    out = export_checkpoint_to_hf(ckpt, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM" if cfg.n_experts else "LlamaForCausalLM"]
    tokens = _tokens(cfg)
    with torch.no_grad():
        ours = model(tokens)
    torch.testing.assert_close(_hf_logits(out, tokens), ours, rtol=1e-4, atol=1e-5)
    # The config round-trips to the same model shape.
    back = from_dict(ModelConfig, model_config_from_hf(out))
    for f in ("vocab_size", "dim", "n_layers", "n_heads", "kv_heads", "max_seq_len", "rope_theta", "norm_eps",
              "n_experts"):
        assert getattr(back, f) == getattr(cfg, f), f


@CONFIGS
def test_transformers_weights_load_into_raypar(tmp_path: pathlib.Path, cfg: ModelConfig) -> None:
    hf_cls = transformers.MixtralForCausalLM if cfg.n_experts else transformers.LlamaForCausalLM
    config_cls = transformers.MixtralConfig if cfg.n_experts else transformers.LlamaConfig
    torch.manual_seed(3)
    hf = hf_cls(config_cls(**hf_config(cfg))).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)

    model = build_stage(cfg, 0, 1, seed=99).eval()
    load_unstacked(model, load_hf_weights(tmp_path / "hf", cfg))
    tokens = _tokens(cfg)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, rtol=1e-4, atol=1e-5)


def test_fused_experts_on_disk(tmp_path: pathlib.Path) -> None:
    # transformers 5 can save its in-memory layout (experts fused into 3-D tensors).
    hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(**hf_config(MOE)))
    try:
        hf.save_pretrained(tmp_path / "fused", safe_serialization=True, save_original_format=False)
    except TypeError:
        pytest.skip("this transformers saves only the per-expert layout")
    hf.save_pretrained(tmp_path / "plain", safe_serialization=True)
    fused = load_hf_weights(tmp_path / "fused", MOE)
    plain = load_hf_weights(tmp_path / "plain", MOE)
    assert fused.keys() == plain.keys()
    for name in plain:
        torch.testing.assert_close(fused[name], plain[name], rtol=0, atol=0)


def test_sharded_export_and_stage_subset(tmp_path: pathlib.Path) -> None:
    model = _model(MOE)
    ckpt = _save_checkpoint(tmp_path / "ckpt", MOE, dict(unstacked(model)))
    out = export_checkpoint_to_hf(ckpt, tmp_path / "hf", max_shard_bytes=8_000)
    assert len(list(out.glob("model-*.safetensors"))) > 1
    want = ["layers.1.mlp.experts.2.w3.weight", "head.weight"]
    got = load_hf_weights(out, MOE, names=want)
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], dict(unstacked(model))[name], rtol=0, atol=0)


def test_export_ema(tmp_path: pathlib.Path) -> None:
    model, ema_model = _model(DENSE, seed=0), _model(DENSE, seed=5)
    tensors = dict(unstacked(model)) | {f"ema.{n}": t for n, t in unstacked(ema_model)}
    ckpt = _save_checkpoint(tmp_path / "ckpt", DENSE, tensors)
    out = export_checkpoint_to_hf(ckpt, tmp_path / "hf", ema=True)
    loaded = load_hf_weights(out, DENSE)
    for name, t in unstacked(ema_model):
        torch.testing.assert_close(loaded[name], t, rtol=0, atol=0)

    plain = _save_checkpoint(tmp_path / "plain", DENSE, dict(unstacked(model)))
    with pytest.raises(CheckpointError, match="no EMA weights"):
        export_checkpoint_to_hf(plain, tmp_path / "hf2", ema=True)


def test_export_drop_and_missing(tmp_path: pathlib.Path) -> None:
    state = dict(unstacked(_model(DENSE)))
    ckpt = _save_checkpoint(tmp_path / "ckpt", DENSE, state)
    out = export_checkpoint_to_hf(ckpt, tmp_path / "hf", drop=[r"^head\."])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"] and "model.norm.weight" in index["weight_map"]

    del state["layers.1.attn.wq.weight"]
    partial = _save_checkpoint(tmp_path / "partial", DENSE, state)
    with pytest.raises(CheckpointError, match=r"layers\.1\.attn\.wq\.weight"):
        export_checkpoint_to_hf(partial, tmp_path / "hf3")


def test_config_mismatch_names_each_field(tmp_path: pathlib.Path) -> None:
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(DENSE))).save_pretrained(tmp_path)
    other = dataclasses.replace(DENSE, dim=64, n_layers=3)
    with pytest.raises(ConfigError) as e:
        load_hf_weights(tmp_path, other)
    msg = str(e.value)
    assert f"model.dim=64 but hidden_size=32 in {tmp_path / 'config.json'}" in msg
    assert "model.n_layers=3 but num_hidden_layers=2" in msg
    with pytest.raises(ConfigError, match="model.n_experts=4 but num_local_experts=0"):
        load_hf_weights(tmp_path, MOE)


def test_pickle_weights_refused(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(hf_config(DENSE)))
    # Never unpickled: the content does not matter.
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle we would ever open")
    with pytest.raises(CheckpointError, match="safetensors only"):
        load_hf_weights(tmp_path, DENSE)


def test_unsupported_moe_layouts_refused(tmp_path: pathlib.Path) -> None:
    every_other = dataclasses.replace(MOE, moe_every=2)
    model = build_stage(every_other, 0, 1, seed=0)
    ckpt = _save_checkpoint(tmp_path / "ckpt", every_other, dict(unstacked(model)))
    with pytest.raises(ConfigError, match="model.moe_every=2"):
        export_checkpoint_to_hf(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    with pytest.raises(ConfigError, match="model.moe_top_k=1"):
        hf_config(dataclasses.replace(MOE, moe_top_k=1))


def test_unsupported_hf_features_refused(tmp_path: pathlib.Path) -> None:
    config = hf_config(DENSE) | {"attention_bias": True, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="attention_bias=true.*rope_scaling"):
        model_config_from_hf(tmp_path)


def test_tied_embeddings_untie(tmp_path: pathlib.Path) -> None:
    config = transformers.LlamaConfig(**(hf_config(DENSE) | {"tie_word_embeddings": True}))
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    weights = load_hf_weights(tmp_path, DENSE)
    torch.testing.assert_close(weights["head.weight"], weights["embed.weight"], rtol=0, atol=0)
    assert weights["head.weight"].data_ptr() != weights["embed.weight"].data_ptr()


@CONFIGS
def test_init_from_starts_every_stage_from_the_hf_weights(ray_session, tmp_path: pathlib.Path, cfg: ModelConfig) -> None:
    """`raypar train --init-from`: each stage worker (and expert-parallel rank) loads its share."""
    hf_cls = transformers.MixtralForCausalLM if cfg.n_experts else transformers.LlamaForCausalLM
    config_cls = transformers.MixtralConfig if cfg.n_experts else transformers.LlamaConfig
    torch.manual_seed(5)
    hf_cls(config_cls(**hf_config(cfg))).save_pretrained(tmp_path / "hf", safe_serialization=True)
    _assert_stages_start_from_the_hf_weights(tmp_path, cfg, {"pp": 2, "ep": 2 if cfg.n_experts else 1})


def test_init_from_splits_the_hf_weights_over_tensor_parallel_workers(ray_session, tmp_path: pathlib.Path) -> None:
    """With tp=2 each worker keeps its slices of the folder's whole tensors (read back whole)."""
    cfg = dataclasses.replace(DENSE, vocab_size=62)  # the vocabulary splits over tp
    torch.manual_seed(5)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(cfg))).save_pretrained(
        tmp_path / "hf", safe_serialization=True)
    _assert_stages_start_from_the_hf_weights(tmp_path, cfg, {"pp": 2, "tp": 2})


def _assert_stages_start_from_the_hf_weights(tmp_path: pathlib.Path, cfg: ModelConfig, parallel: dict) -> None:
    from helpers import start_group, synthetic_data, tiny_config

    model = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "dtype"}
    run = tiny_config(tmp_path, model={**model, "init_from": str(tmp_path / "hf")}, parallel=parallel)
    group = start_group(run, synthetic_data(tmp_path, run))
    try:
        loaded = group.parameters()
    finally:
        group.shutdown()
    want = load_hf_weights(tmp_path / "hf", cfg)
    assert loaded.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(loaded[name], t.float()), name


@pytest.mark.parametrize("setting, message", [
    ({"moe_capacity_factor": 1.0}, "raypar drops tokens over an expert's capacity"),
    ({"moe_bias_update_rate": 0.001}, "MixtralForCausalLM has none"),
])
def test_mixtral_config_warns_where_raypar_routes_otherwise(setting, message):
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16, n_experts=4, **setting)
    with pytest.warns(UserWarning, match=message):
        hf_config(cfg)
