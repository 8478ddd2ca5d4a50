"""Hugging Face interoperability: export checkpoints for `transformers`, load HF weights.

A dense raypar model is a `LlamaForCausalLM`; a model whose every layer is a mixture of
experts (model.moe_every == 1) is a `MixtralForCausalLM`. Weights are written in the
layout `save_pretrained` writes (one tensor per expert:
`block_sparse_moe.experts.<j>.w1/w2/w3`). transformers 5 keeps experts fused in memory
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) but still saves and loads the
per-expert layout, and transformers 4 only knows that one, so it is the portable
choice. `load_hf_weights` reads both layouts.

Only safetensors are read: `pytorch_model.bin` is a pickle, which can run code on load.

Public API:
    hf_config(cfg) -> dict                                 # config.json contents
    export_checkpoint_to_hf(ckpt_dir, out_dir, ...) -> Path
    load_hf_weights(hf_dir, cfg, names=None) -> {raypar name: tensor}
    model_config_from_hf(hf_dir) -> dict                   # ModelConfig fields
"""
from __future__ import annotations

import json
import re
import warnings
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from raypar.checkpoint import CheckpointError, export_hf, is_model_weight, read_manifest
from raypar.checkpoint import store
from raypar.config import ConfigError, ModelConfig, from_dict

__all__ = ["hf_config", "export_checkpoint_to_hf", "load_hf_weights", "model_config_from_hf"]

_LLAMA = "llama"
_MIXTRAL = "mixtral"
_ARCHITECTURES = {_LLAMA: "LlamaForCausalLM", _MIXTRAL: "MixtralForCausalLM"}
# transformers' defaults when config.json leaves rope_theta out.
_DEFAULT_THETA = {_LLAMA: 10000.0, _MIXTRAL: 1e6}
_CONFIG_NAME = "config.json"
_SINGLE_NAME = "model.safetensors"
_INDEX_NAME = "model.safetensors.index.json"
_PICKLE_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
# Buffers some older checkpoints carry; raypar derives them from the config.
_IGNORED_HF = re.compile(r"\.rotary_emb\.inv_freq$")


# ---------------------------------------------------------------------------------------
# Names


def _pattern(template: str) -> re.Pattern[str]:
    # "layers.{i}.attn.wq.weight" -> r"layers\.(?P<i>\d+)\.attn\.wq\.weight"
    rx = re.escape(template)
    for key in ("i", "j"):
        rx = rx.replace(re.escape("{" + key + "}"), f"(?P<{key}>\\d+)")
    return re.compile(rx)


class _NameMap:
    """Two-way mapping between raypar's global names and one HF class's names."""

    def __init__(self, pairs: Sequence[tuple[str, str]]) -> None:
        self._fwd = [(_pattern(r), h) for r, h in pairs]
        self._back = [(_pattern(h), r) for r, h in pairs]

    @staticmethod
    def _apply(table: list[tuple[re.Pattern[str], str]], name: str) -> str | None:
        for rx, template in table:
            m = rx.fullmatch(name)
            if m:
                return template.format(**m.groupdict())
        return None

    def to_hf(self, name: str) -> str | None:
        return self._apply(self._fwd, name)

    def to_raypar(self, name: str) -> str | None:
        return self._apply(self._back, name)


_COMMON = [
    ("embed.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("head.weight", "lm_head.weight"),
    ("layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.mlp_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    *[(f"layers.{{i}}.attn.{r}.weight", f"model.layers.{{i}}.self_attn.{h}.weight")
      for r, h in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj"))],
]
_NAMES = {
    _LLAMA: _NameMap(_COMMON + [
        (f"layers.{{i}}.mlp.{r}.weight", f"model.layers.{{i}}.mlp.{h}.weight")
        for r, h in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
    ]),
    _MIXTRAL: _NameMap(_COMMON + [
        ("layers.{i}.mlp.router.weight", "model.layers.{i}.block_sparse_moe.gate.weight"),
        *[(f"layers.{{i}}.mlp.experts.{{j}}.{w}.weight", f"model.layers.{{i}}.block_sparse_moe.experts.{{j}}.{w}.weight")
          for w in ("w1", "w2", "w3")],
    ]),
}
# transformers 5's in-memory layout, found on disk after save_pretrained(save_original_format=False).
_FUSED = re.compile(r"model\.layers\.(?P<i>\d+)\.block_sparse_moe\.experts\.(?P<kind>gate_up_proj|down_proj)")


def _param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    from raypar.model.experts import unstacked
    from raypar.model.transformer import Transformer

    # On the meta device: shapes without allocating the model.
    with torch.device("meta"):
        model = Transformer(cfg)
    return {name: tuple(t.shape) for name, t in unstacked(model)}


# ---------------------------------------------------------------------------------------
# Config


def _arch_for(cfg: ModelConfig) -> str:
    """The HF class family that computes what `cfg` computes, or ConfigError."""
    if cfg.n_experts == 0:
        return _LLAMA
    if cfg.moe_every != 1:
        raise ConfigError(
            f"model.moe_every={cfg.moe_every}: only a model whose every layer is MoE (model.moe_every=1) maps "
            f"onto a standard Hugging Face class (MixtralForCausalLM); transformers has no class that "
            f"interleaves dense and MoE layers this way"
        )
    if cfg.moe_top_k == 1:
        raise ConfigError(
            "model.moe_top_k=1: raypar weights a top-1 expert's output by its router probability (Switch), "
            "while MixtralForCausalLM renormalises the chosen weights to sum to one (weight 1.0), so the "
            "exported model would compute something else; only moe_top_k >= 2 maps onto Mixtral"
        )
    return _MIXTRAL


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The `config.json` of the transformers class equivalent to `cfg`.

    Raises ConfigError for models no standard class computes (MoE with moe_every > 1,
    top-1 MoE). Warns when the model drops tokens over expert capacity: Mixtral is dropless.
    """
    arch = _arch_for(cfg)
    out: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.dim // cfg.n_heads,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        # rope_theta for transformers 4, rope_parameters for 5; both say plain RoPE.
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": False,
        "torch_dtype": cfg.dtype,
        "dtype": cfg.dtype,
        "use_cache": True,
        # The class defaults (1, 2) would be ordinary tokens of a raypar vocabulary.
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    if arch == _LLAMA:
        out["mlp_bias"] = False
        out["pretraining_tp"] = 1
    else:
        if cfg.moe_capacity_factor > 0:
            warnings.warn(
                f"model.moe_capacity_factor={cfg.moe_capacity_factor}: raypar drops tokens over an expert's "
                f"capacity, MixtralForCausalLM never does; outputs differ wherever raypar would drop",
                stacklevel=2,
            )
        if cfg.moe_bias_update_rate > 0:
            warnings.warn(
                f"model.moe_bias_update_rate={cfg.moe_bias_update_rate}: raypar chooses experts with per-expert "
                f"biases (the checkpoint's manifest, extra.expert_biases), MixtralForCausalLM has none; outputs "
                f"differ wherever a bias changes a choice",
                stacklevel=2,
            )
        out.update(
            intermediate_size=cfg.moe_ffn_dim or cfg.hidden_dim,
            num_local_experts=cfg.n_experts,
            num_experts_per_tok=cfg.moe_top_k,
            router_aux_loss_coef=cfg.moe_aux_loss_coef,
            output_router_logits=False,
            router_jitter_noise=0.0,
            sliding_window=None,
        )
    return out


def _read_hf_config(path: Path) -> tuple[dict[str, Any], Path]:
    path = Path(path)
    cfg_path = path / _CONFIG_NAME if path.is_dir() else path
    if not cfg_path.is_file():
        raise CheckpointError(f"{path}: no {_CONFIG_NAME} (a Hugging Face model directory needs one)")
    try:
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: cannot read it as JSON: {e}") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{cfg_path}: must hold a JSON object")
    return raw, cfg_path


def _hf_arch(hf: dict[str, Any], where: Path) -> str:
    kind = hf.get("model_type")
    if kind is None:  # very old configs name only the class
        kind = {v: k for k, v in _ARCHITECTURES.items()}.get((hf.get("architectures") or [None])[0])
    if kind not in _ARCHITECTURES:
        raise ConfigError(
            f"{where}: model_type={kind!r} is not supported; raypar reads llama (LlamaForCausalLM) "
            f"and mixtral (MixtralForCausalLM) models"
        )
    return kind


def _rope_theta(hf: dict[str, Any], arch: str) -> float:
    params = hf.get("rope_parameters") or {}
    if "rope_theta" in params:
        return float(params["rope_theta"])
    return float(hf.get("rope_theta", _DEFAULT_THETA[arch]))


def _unsupported(hf: dict[str, Any], arch: str) -> list[str]:
    """Features of an HF config that raypar's model does not compute."""
    problems = []
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            problems.append(f"{key}=true (raypar projections have no bias)")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (raypar's MLP is SwiGLU: silu)")
    hidden, heads = hf.get("hidden_size"), hf.get("num_attention_heads")
    if hf.get("head_dim") is not None and hidden and heads and hf["head_dim"] != hidden // heads:
        problems.append(f"head_dim={hf['head_dim']} (raypar uses hidden_size / num_attention_heads = {hidden // heads})")
    scaling = hf.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        problems.append(f"rope_scaling={scaling} (raypar implements plain RoPE)")
    params = hf.get("rope_parameters") or {}
    if any(isinstance(v, dict) for v in params.values()):
        problems.append(f"rope_parameters={params} (one RoPE per layer type is not supported)")
    elif params.get("rope_type", "default") != "default":
        problems.append(f"rope_parameters.rope_type={params['rope_type']!r} (raypar implements plain RoPE)")
    if hf.get("partial_rotary_factor", 1.0) not in (None, 1.0) or params.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append("partial_rotary_factor != 1 (raypar rotates whole heads)")
    if arch == _MIXTRAL and hf.get("num_experts_per_tok", 2) == 1:
        problems.append("num_experts_per_tok=1 (Mixtral gives the top expert weight 1.0, raypar its probability)")
    return problems


def model_config_from_hf(hf_dir: str | Path) -> dict[str, Any]:
    """`ModelConfig` fields (the `model:` section of a raypar config) from an HF config.json.

    `hf_dir` is the model directory or its config.json. Raises ConfigError for features
    raypar's model does not compute (biases, rope scaling, other activations, ...).
    """
    hf, where = _read_hf_config(Path(hf_dir))
    arch = _hf_arch(hf, where)
    problems = _unsupported(hf, arch)
    if problems:
        raise ConfigError(f"{where}: cannot be represented in raypar: " + "; ".join(problems))
    try:
        out: dict[str, Any] = {
            "vocab_size": int(hf["vocab_size"]),
            "dim": int(hf["hidden_size"]),
            "n_layers": int(hf["num_hidden_layers"]),
            "n_heads": int(hf["num_attention_heads"]),
            "n_kv_heads": int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
            "ffn_dim": int(hf["intermediate_size"]),
            "max_seq_len": int(hf.get("max_position_embeddings", 2048)),
            "rope_theta": _rope_theta(hf, arch),
            "norm_eps": float(hf.get("rms_norm_eps", 1e-6 if arch == _LLAMA else 1e-5)),
        }
    except KeyError as e:
        raise ConfigError(f"{where}: lacks {e.args[0]}") from None
    # A window at least as long as the sequence is plain causal attention.
    window = hf.get("sliding_window") if arch == _MIXTRAL else None
    if window:
        out["max_seq_len"] = min(out["max_seq_len"], int(window))
    if "initializer_range" in hf:
        out["init_std"] = float(hf["initializer_range"])
    dtype = hf.get("dtype") or hf.get("torch_dtype")
    if dtype in ("float32", "bfloat16"):
        out["dtype"] = dtype
    if arch == _MIXTRAL:
        out.update(
            n_experts=int(hf.get("num_local_experts", 8)),
            moe_top_k=int(hf.get("num_experts_per_tok", 2)),
            moe_every=1,
            moe_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
            moe_capacity_factor=0.0,  # Mixtral is dropless
        )
    return out


def _mismatches(hf: dict[str, Any], arch: str, cfg: ModelConfig, where: Path) -> list[str]:
    heads = hf.get("num_attention_heads")
    hf_experts = int(hf.get("num_local_experts", 8)) if arch == _MIXTRAL else 0
    if cfg.n_experts:
        ffn_key, ffn = ("model.moe_ffn_dim", cfg.moe_ffn_dim) if cfg.moe_ffn_dim else ("model.ffn_dim", cfg.hidden_dim)
    else:
        ffn_key, ffn = "model.ffn_dim", cfg.hidden_dim
    checks = [
        ("model.vocab_size", cfg.vocab_size, "vocab_size", hf.get("vocab_size")),
        ("model.dim", cfg.dim, "hidden_size", hf.get("hidden_size")),
        ("model.n_layers", cfg.n_layers, "num_hidden_layers", hf.get("num_hidden_layers")),
        ("model.n_heads", cfg.n_heads, "num_attention_heads", heads),
        ("model.n_kv_heads", cfg.kv_heads, "num_key_value_heads", hf.get("num_key_value_heads") or heads),
        (ffn_key, ffn, "intermediate_size", hf.get("intermediate_size")),
        ("model.n_experts", cfg.n_experts, "num_local_experts", hf_experts),
    ]
    if cfg.n_experts and arch == _MIXTRAL:
        checks.append(("model.moe_top_k", cfg.moe_top_k, "num_experts_per_tok", hf.get("num_experts_per_tok", 2)))
    out = [f"{key}={mine} but {hf_key}={theirs} in {where}" for key, mine, hf_key, theirs in checks if mine != theirs]
    if cfg.n_experts and cfg.moe_every != 1:
        out.append(f"model.moe_every={cfg.moe_every} but {where} describes MoE in every layer (moe_every=1)")
    window = hf.get("sliding_window") if arch == _MIXTRAL else None
    if window and cfg.max_seq_len > window:
        out.append(f"model.max_seq_len={cfg.max_seq_len} but sliding_window={window} in {where}: "
                   f"raypar attends to the whole sequence")
    return out


def _check_matches(hf: dict[str, Any], cfg: ModelConfig, where: Path) -> str:
    arch = _hf_arch(hf, where)
    problems = _unsupported(hf, arch)
    if problems:
        raise ConfigError(f"{where}: cannot be represented in raypar: " + "; ".join(problems))
    if cfg.n_experts and cfg.moe_top_k == 1:
        _arch_for(cfg)  # raises the top-1 explanation
    bad = _mismatches(hf, arch, cfg, where)
    if bad:
        raise ConfigError("Hugging Face config does not match the model config: " + "; ".join(bad))
    for key, mine, theirs in (("model.rope_theta", cfg.rope_theta, _rope_theta(hf, arch)),
                              ("model.norm_eps", cfg.norm_eps, hf.get("rms_norm_eps"))):
        if theirs is not None and float(theirs) != mine:
            warnings.warn(f"{key}={mine} but {where} says {theirs}; the weights were trained with the latter",
                          stacklevel=3)
    return arch


# ---------------------------------------------------------------------------------------
# Export


def export_checkpoint_to_hf(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    ema: bool = False,
    drop: Sequence[str] = (),
    max_shard_bytes: int | None = None,
) -> Path:
    """Write a committed checkpoint as a Hugging Face model directory; returns `out_dir`.

    Writes `config.json` (from the manifest's `model` config, see `hf_config`) and the
    weights under HF names (`model.safetensors`, or shards of at most `max_shard_bytes`,
    plus `model.safetensors.index.json`). `ema=True` exports the `ema.<name>` tensors
    instead of the weights. `drop` holds regular expressions searched in raypar names
    (without the `ema.` prefix); matching weights are left out.
    """
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    manifest = read_manifest(ckpt_dir)
    model_raw = manifest.config.get("model")
    if not isinstance(model_raw, dict):
        raise CheckpointError(f"checkpoint {ckpt_dir}: the manifest's config has no `model` section to export from")
    cfg = from_dict(ModelConfig, model_raw, "model")
    config = hf_config(cfg)
    names = _NAMES[config["model_type"]]

    prefix = "ema." if ema else ""
    saved = set(manifest.tensors)
    if ema and not any(n.startswith(prefix) for n in saved):
        raise CheckpointError(f"checkpoint {ckpt_dir}: has no EMA weights (no `ema.<name>` tensors); export without ema")
    drops = [re.compile(d) for d in drop]
    params = set(_param_shapes(cfg))
    wanted = sorted(n for n in params if not any(d.search(n) for d in drops))
    missing = [n for n in wanted if prefix + n not in saved]
    if missing:
        raise CheckpointError(
            f"checkpoint {ckpt_dir}: lacks {len(missing)} {'EMA ' if ema else ''}weights of the model, e.g. "
            f"{', '.join(prefix + n for n in missing[:5])}"
        )
    if not ema:
        # A weight the config does not explain means the config and the weights disagree.
        extra = sorted(n for n in saved if is_model_weight(n) and n not in params)
        if extra:
            raise CheckpointError(
                f"checkpoint {ckpt_dir}: holds weights its model config does not have: {', '.join(extra[:5])}"
            )
    selected = {prefix + n for n in wanted}
    export_hf(
        ckpt_dir,
        out_dir,
        include=selected.__contains__,
        rename=lambda n: names.to_hf(n[len(prefix):]),
        max_shard_bytes=max_shard_bytes,
    )
    text = json.dumps(config, indent=2) + "\n"
    store.atomic_write(out_dir / _CONFIG_NAME, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return out_dir


# ---------------------------------------------------------------------------------------
# Import


def _weight_files(hf_dir: Path) -> list[Path]:
    index = hf_dir / _INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index with a weight_map: {e}") from e
        files = []
        for name in sorted(set(weight_map.values())):
            path = hf_dir / name
            # The index is input: a file name must not lead out of the model directory.
            if Path(name).is_absolute() or not path.resolve().is_relative_to(hf_dir.resolve()):
                raise CheckpointError(f"{index}: names a file outside {hf_dir}: {name!r}")
            if not path.is_file():
                raise CheckpointError(f"{index}: names {name}, which is missing")
            files.append(path)
        return files
    if (hf_dir / _SINGLE_NAME).is_file():
        return [hf_dir / _SINGLE_NAME]
    if any((hf_dir / n).exists() for n in _PICKLE_NAMES) or any(hf_dir.glob("pytorch_model*.bin")):
        raise CheckpointError(
            f"{hf_dir}: holds only pytorch_model.bin weights; raypar reads safetensors only, because "
            f"loading a pickle can run arbitrary code. Convert them where you trust the file, e.g. "
            f"model.save_pretrained(dir, safe_serialization=True)"
        )
    raise CheckpointError(f"{hf_dir}: no {_SINGLE_NAME} or {_INDEX_NAME}")


def _hf_tensors(files: list[Path], arch: str) -> Iterator[tuple[str, str, Any]]:
    """(HF name normalised to the on-disk Mixtral layout, file, open handle) of every tensor."""
    for path in files:
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as e:  # safetensors raises its own untyped errors
            raise CheckpointError(f"{path}: not a readable safetensors file: {e}") from e
        for key in handle.keys():
            name = key
            if arch == _MIXTRAL:
                # transformers 5 renames block_sparse_moe to mlp; Mixtral has no dense mlp.
                name = name.replace(".mlp.", ".block_sparse_moe.")
            yield name, key, handle


def _split_fused(kind: str, layer: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    prefix = f"layers.{layer}.mlp.experts"
    if kind == "down_proj":  # [E, dim, hidden]
        return {f"{prefix}.{j}.w2.weight": t[j] for j in range(t.shape[0])}
    hidden = t.shape[1] // 2  # gate_up_proj [E, 2 * hidden, dim]: gate rows, then up rows
    out = {}
    for j in range(t.shape[0]):
        out[f"{prefix}.{j}.w1.weight"] = t[j, :hidden]
        out[f"{prefix}.{j}.w3.weight"] = t[j, hidden:]
    return out


def load_hf_weights(
    hf_dir: str | Path, cfg: ModelConfig, names: Collection[str] | None = None
) -> dict[str, torch.Tensor]:
    """Weights of a Hugging Face Llama/Mixtral directory under raypar names.

    Reads `config.json` and safetensors (`model.safetensors` or the sharded index), checks
    the HF config against `cfg` (ConfigError naming every mismatching field) and returns
    tensors in their stored dtype (`load_state_dict` casts). `names` restricts the result
    to those raypar names, e.g. `stage_param_names(cfg, stage, n_stages)` for one stage.
    """
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise CheckpointError(f"Hugging Face model directory {hf_dir} does not exist")
    hf, where = _read_hf_config(hf_dir)
    arch = _check_matches(hf, cfg, where)
    shapes = _param_shapes(cfg)
    wanted = set(shapes) if names is None else set(names)
    unknown_wanted = sorted(wanted - set(shapes))
    if unknown_wanted:
        raise ConfigError(f"load_hf_weights: {', '.join(unknown_wanted[:5])} are not parameters of this model")

    mapping = _NAMES[arch]
    out: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    for name, key, handle in _hf_tensors(_weight_files(hf_dir), arch):
        fused = _FUSED.fullmatch(name) if arch == _MIXTRAL else None
        if fused:
            pieces = _split_fused(fused["kind"], fused["i"], handle.get_tensor(key))
            out.update({n: t.contiguous() for n, t in pieces.items() if n in wanted})
            continue
        ours = mapping.to_raypar(name)
        if ours is None:
            if not _IGNORED_HF.search(name):
                unknown.append(key)
        elif ours in wanted:
            out[ours] = handle.get_tensor(key)
    if unknown:
        raise CheckpointError(f"{hf_dir}: tensors raypar has no place for: {', '.join(unknown[:5])}")
    if hf.get("tie_word_embeddings") and "head.weight" in wanted and "head.weight" not in out:
        # raypar keeps the head untied (embedding and head live on different stages).
        embed = out.get("embed.weight")
        if embed is None:
            embed = load_hf_weights(hf_dir, cfg, ["embed.weight"])["embed.weight"]
        out["head.weight"] = embed.clone()
    missing = sorted(wanted - set(out))
    if missing:
        raise CheckpointError(f"{hf_dir}: lacks {len(missing)} weights, e.g. {', '.join(missing[:5])}")
    wrong = [f"{n}: {tuple(t.shape)} but the model needs {shapes[n]}" for n, t in out.items()
             if tuple(t.shape) != shapes[n]]
    if wrong:
        raise CheckpointError(f"{hf_dir}: tensors of the wrong shape: " + "; ".join(wrong[:5]))
    return out
