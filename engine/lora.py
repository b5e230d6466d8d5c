"""LoRA adapters in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`), read and checked
against a model line's projections.

A dense model line's LoRA sites are its packed projections, by engine weight name: `layers.{i}.qkv_proj`
(slices q, k, v), `layers.{i}.o_proj`, `layers.{i}.gate_up_proj` (slices gate, up) and
`layers.{i}.down_proj`. A PEFT module's pair (`...layers.{i}.self_attn.q_proj.lora_A.weight` [r, K],
`...lora_B.weight` [N, r]) lands in its site's slice: the slice's output gains
scaling · (x · Aᵀ) · Bᵀ, scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). A module's r and
lora_alpha are `rank_pattern` / `alpha_pattern`'s where a key matches its name, as PEFT matches them
(engine/lora_patterns.py: an adapter's regular expressions never run unbounded here); modules of
a lower rank than the adapter's largest are zero-padded to it. Every refusal is a LoRAError whose message names
the adapter and the problem.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import numpy as np

from engine.lora_patterns import PatternError, first_match, pattern_matches
from engine.models.registry import model_types_where

# PEFT module -> (engine site suffix, slice of the packed projection)
MODULES = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
           "down_proj": ("down_proj", 0)}
SITE_SUFFIXES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
MAX_LORA_RANK = 256                                   # the GPU kernels' bound (lora_expand.cu's shared tile)
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))\.lora_([AB])"
                  r"(?:\.default)?\.weight$")
# adapter_config.json settings whose non-default value changes the math beyond plain LoRA
_REFUSED = {"use_dora": (None, False), "modules_to_save": (None, []), "bias": (None, "none"),
            "lora_bias": (None, False)}


class LoRAError(ValueError):
    """An adapter (or an adapter operation) refused; `status` is the HTTP status the server answers."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Site:
    """A packed projection: the output widths of its slices and its input width."""
    slices: tuple[int, ...]
    k: int

    @property
    def n(self) -> int:
        return sum(self.slices)


@dataclass
class SiteLoRA:
    """One adapter at one site: A of every slice [slices, r, K] (zero for a slice it leaves alone) and B
    [N, r] in the packed output's row order, scaling folded in; float32."""
    a: np.ndarray
    b: np.ndarray


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int                           # its modules' largest rank (the width of every SiteLoRA)
    alpha: float                        # the config's lora_alpha and the scaling it gives at the config's r
    scaling: float                      # (rank_pattern / alpha_pattern modules have their own, folded into B)
    modules: tuple[str, ...]            # the PEFT modules it adapts (q_proj, ...)
    sites: dict[str, SiteLoRA]


def lora_model_types() -> tuple[str, ...]:
    """The model types whose line has LoRA sites (the registry's lines declaring `lora`)."""
    return model_types_where(lambda line: line.lora)


def check_lora_model(model_type: str) -> None:
    if model_type not in lora_model_types():
        raise ValueError(f"--enable-lora: model type {model_type!r} has no LoRA support "
                         f"(supported: {', '.join(lora_model_types())})")


def lora_sites(model) -> dict[str, Site]:
    """The LoRA sites of a dense model line (a DecoderLM), from its weight declarations."""
    check_lora_model(model.config.model_type)
    return {spec.name: Site(tuple(shape[0] for _, shape in spec.parts), spec.parts[0][1][1])
            for spec in model.weight_specs()
            if not spec.experts and spec.name.startswith("layers.") and spec.name.split(".")[-1] in SITE_SUFFIXES}


def parse_lora_modules(items) -> tuple[tuple[str, str], ...]:
    """`--lora-modules` values, each `name=path` or vLLM's JSON form `{"name": ..., "path": ...}`."""
    out = []
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                d = json.loads(item)
                name, path = d["name"], d["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules {item!r}: want name=path or {{\"name\": ..., \"path\": ...}}") from None
        else:
            name, sep, path = item.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules {item!r}: want name=path")
        if not name or not path:
            raise ValueError(f"--lora-modules {item!r}: the name and the path must not be empty")
        out.append((str(name), str(path)))
    return tuple(out)


def load_adapter(name: str, path: str, sites: dict[str, Site], num_layers: int, max_rank: int) -> LoRAAdapter:
    """Read and check a PEFT LoRA folder against a model's sites; raises LoRAError naming the problem."""
    where = f"LoRA adapter {name!r}"
    path = os.path.expanduser(str(path))
    if not os.path.isdir(path):
        raise LoRAError(f"{where}: {path} is not a folder")
    cfg = _read_config(where, path)
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    _check_rank(where, "r", rank, max_rank)
    _check_alpha(where, "'lora_alpha'", alpha)
    for key, fine in _REFUSED.items():
        if cfg.get(key) not in fine:
            raise LoRAError(f"{where}: {key}={cfg[key]!r} is not supported (plain LoRA only)")
    ranks, alphas = _pattern(where, cfg, "rank_pattern"), _pattern(where, cfg, "alpha_pattern")
    for key, r in ranks.items():
        _check_rank(where, f"rank_pattern[{key!r}]", r, max_rank)
    for key, a in alphas.items():
        _check_alpha(where, f"alpha_pattern[{key!r}]", a)
    _check_targets(where, cfg.get("target_modules"))
    pairs = _read_pairs(where, path, num_layers)
    matches = _match_patterns(where, ranks, alphas, sorted({p for p, _, _ in pairs.values()}))
    module_rank = {k: first_match(ranks, module_path, matches, rank) for k, (module_path, _, _) in pairs.items()}
    width = max(module_rank.values())             # the adapter's rank: its modules' largest
    out: dict[str, SiteLoRA] = {}
    for (layer, module), (module_path, a, b) in sorted(pairs.items()):
        r, al = module_rank[layer, module], first_match(alphas, module_path, matches, alpha)
        scaling = _scaling(cfg, al, r)
        suffix, j = MODULES[module]
        site_name = f"layers.{layer}.{suffix}"
        site = sites[site_name]
        k, n = site.k, site.slices[j]
        for key, t, want in ((f"{module}.lora_A", a, (r, k)), (f"{module}.lora_B", b, (n, r))):
            if tuple(t.shape) != want:
                raise LoRAError(f"{where}: shape mismatch: layer {layer} {key} has shape {tuple(t.shape)}, "
                                f"expected {want} (rank {r}, the model's {module} is {n} x {k})")
        w = out.get(site_name)
        if w is None:
            w = out[site_name] = SiteLoRA(np.zeros((len(site.slices), width, k), np.float32),
                                          np.zeros((site.n, width), np.float32))
        w.a[j, :r] = np.asarray(a, np.float32)
        row = sum(site.slices[:j])
        w.b[row:row + n, :r] = np.asarray(b, np.float32) * np.float32(scaling)
    return LoRAAdapter(name=name, path=path, rank=width, alpha=float(alpha), scaling=float(_scaling(cfg, alpha, rank)),
                       modules=tuple(sorted({m for _, m in pairs})), sites=out)


def _scaling(cfg: dict, alpha: float, rank: int) -> float:
    return alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank


def _check_rank(where: str, what: str, rank, max_rank: int) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAError(f"{where}: adapter_config.json has no valid rank {what!r} (got {rank!r})"
                        if what == "r" else f"{where}: {what} must be a positive integer rank (got {rank!r})")
    if rank > max_rank:
        raise LoRAError(f"{where}: rank {rank}{'' if what == 'r' else f' ({what})'} is over --max-lora-rank {max_rank}")


def _check_alpha(where: str, what: str, alpha) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoRAError(f"{where}: {what} must be a number (got {alpha!r})")


def _pattern(where: str, cfg: dict, field: str) -> dict:
    """rank_pattern / alpha_pattern: {regex or module name: value}."""
    pattern = cfg.get(field) or {}
    if not isinstance(pattern, dict):
        raise LoRAError(f"{where}: {field} must be a JSON object (got {pattern!r})")
    return pattern


def _match_patterns(where: str, ranks: dict, alphas: dict, module_paths: list[str]) -> dict[str, set[str]]:
    """Every pattern key -> the module paths it matches (engine/lora_patterns.py: bounded); LoRAError naming a
    key that is no valid regular expression or whose matching runs out of time."""
    try:
        return pattern_matches([*ranks, *alphas], module_paths)
    except PatternError as e:
        field = "rank_pattern" if e.key in ranks else "alpha_pattern"
        key = e.key if len(e.key) <= 100 else e.key[:100] + "..."
        raise LoRAError(f"{where}: {field} key {key!r} {e}") from None


def _read_config(where: str, path: str) -> dict:
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise LoRAError(f"{where}: missing file {file}")
    if not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        bin_too = " (only safetensors adapters are read; found adapter_model.bin)" if os.path.isfile(
            os.path.join(path, "adapter_model.bin")) else ""
        raise LoRAError(f"{where}: missing file {os.path.join(path, WEIGHTS_FILE)}{bin_too}")
    try:
        with open(file, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise LoRAError(f"{where}: {file} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"{where}: {file} must hold a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{where}: peft_type {cfg['peft_type']!r} is not LORA")
    return cfg


def _check_targets(where: str, targets) -> None:
    """target_modules as a list: each one a module LoRA can adapt here (a string is PEFT's regex or
    "all-linear": the tensors then say what is adapted)."""
    if isinstance(targets, (list, tuple)):
        for t in targets:
            if str(t).split(".")[-1] not in MODULES:
                raise LoRAError(f"{where}: target module {t!r} is not one this model has LoRA support for "
                                f"({', '.join(MODULES)})")


def _read_pairs(where: str, path: str, num_layers: int) -> dict[tuple[int, str], tuple[str, np.ndarray, np.ndarray]]:
    """(layer, module) -> (module path as PEFT names it, A, B) of the safetensors file; every tensor must be
    such a pair's half."""
    from engine.loader.safetensors_io import DTYPES, read_header

    file = os.path.join(path, WEIGHTS_FILE)
    try:
        header, start = read_header(file)
    except (OSError, ValueError) as e:
        raise LoRAError(f"{where}: {file}: {e}") from None
    raw = np.memmap(file, dtype=np.uint8, mode="r") if header else None
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    paths: dict[tuple[int, str], str] = {}
    for key, entry in header.items():
        m = _KEY.match(key)
        module = m.group(3) if m else key.rsplit(".lora_", 1)[0].split(".")[-1]
        if m is None or module not in MODULES:
            raise LoRAError(f"{where}: tensor {key!r}: target {module!r} is not one this model has LoRA support "
                            f"for ({', '.join(MODULES)})")
        layer = int(m.group(2))
        if layer >= num_layers:
            raise LoRAError(f"{where}: tensor {key!r}: layer {layer} is beyond the model's {num_layers} layers")
        if entry.get("dtype") not in DTYPES:
            raise LoRAError(f"{where}: tensor {key!r}: unsupported dtype {entry.get('dtype')}")
        begin, end = entry["data_offsets"]
        t = raw[start + begin:start + end].view(DTYPES[entry["dtype"]]).reshape(entry["shape"])
        halves.setdefault((layer, module), {})[m.group(4)] = t
        paths[layer, module] = m.group(1)
    if not halves:
        raise LoRAError(f"{where}: {file} holds no LoRA tensors")
    for (layer, module), h in halves.items():
        if len(h) != 2:
            missing = "lora_B" if "A" in h else "lora_A"
            raise LoRAError(f"{where}: layer {layer} {module} has no {missing} tensor")
    return {k: (paths[k], h["A"], h["B"]) for k, h in halves.items()}
