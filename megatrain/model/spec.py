"""HF causal-LM families split into streamable units, built from configs without any hub access."""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import inspect
import pickle
import re
import threading
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megatrain.config.base import Where
from megatrain.config.model import FAMILIES as FAMILIES  # the model section, re-exported
from megatrain.config.model import ModelConfig as ModelConfig
from megatrain.errors import ConfigError
from megatrain.model.arch import hf_key_error, merged_fields
from megatrain.model.arch import pretrained_config as pretrained_config  # the model's config.json, re-exported
from megatrain.model.layout import StoreLayout, build_layout

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def _config_errors() -> tuple[type[Exception], ...]:
    """What a family's config class raises for a bad field (imported on use: huggingface_hub pulls in httpx)."""
    try:  # transformers 5 configs are strict dataclasses: a field of the wrong type raises this
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # older huggingface_hub: the configs raise TypeError / ValueError only
        return (TypeError, ValueError)
    return (TypeError, ValueError, StrictDataclassError)


# The attention function every model of ours runs (megatrain/layers/attention.py). Not named "...sdpa...": HF would
# then refuse the families it has no SDPA path for (GPT-OSS, whose sinks SDPA alone cannot take).
ATTENTION = "megatrain_attention"


def config_class(family: str) -> type:
    """A family's config class alone: reading and checking a config imports no modeling code (the launcher
    does it before starting anything; the modeling code comes with the first model built)."""
    import transformers

    return getattr(transformers, FAMILIES[family][0])


def family_classes(family: str) -> tuple[type, type]:
    """(config class, causal-LM class) of a family. Registers our attention function with HF under ATTENTION
    first: it is imported here, where a model may be built, and not by the processes that never build one
    (the packers, accumulators, writer and Adam updater), whose start it would slow by the transformers
    modeling code it pulls in."""
    import transformers

    from megatrain.layers.attention import attention

    transformers.AttentionInterface.register(ATTENTION, attention)
    conf, model = FAMILIES[family]
    return getattr(transformers, conf), getattr(transformers, model)


@dataclass(frozen=True)
class ModelSpec:
    """Everything a process needs to know about the model; small and picklable.

    It travels with its HF config pickled apart, unpickled on first use: the processes that only read the
    layout (packers, accumulators, checkpoint writer, Adam updater) never import transformers, which is
    about a third of their start-up imports (a second of CPU each, beside the executor's own imports)."""

    family: str
    hf_config: PretrainedConfig
    layout: StoreLayout

    def __reduce__(self) -> tuple:
        packed = self.__dict__.get("_hf_pickle")  # still packed: passed on without unpickling it
        return (_unpickled_spec, (self.family, packed or pickle.dumps(self.hf_config), self.layout))

    def __getattr__(self, name: str) -> Any:
        # Only for attributes not found: hf_config of a spec that came through pickle, on its first read. Once
        # unpickled, the object is what travels on (a change made to it is not lost), and one thread makes it.
        missing = AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        if name != "hf_config":
            raise missing
        with _UNPICKLING:
            if "hf_config" not in self.__dict__:  # another thread's unpickling may have come first
                if "_hf_pickle" not in self.__dict__:
                    raise missing
                try:
                    hf = pickle.loads(self.__dict__["_hf_pickle"])
                except AttributeError as exc:  # not to be taken for a missing attribute (hasattr would hide it)
                    raise RuntimeError(f"the model's HF config cannot be unpickled here: {exc}") from exc
                object.__setattr__(self, "hf_config", hf)
                self.__dict__.pop("_hf_pickle")
        return self.__dict__["hf_config"]


_UNPICKLING = threading.Lock()


def _unpickled_spec(family: str, hf_pickle: bytes, layout: StoreLayout) -> ModelSpec:
    spec = object.__new__(ModelSpec)
    object.__setattr__(spec, "family", family)
    object.__setattr__(spec, "layout", layout)
    object.__setattr__(spec, "_hf_pickle", hf_pickle)
    return spec


# Accepted by every family's config without being one of its fields: read by PretrainedConfig itself or
# folded into rope_parameters (transformers 5) from the names older config.json files use.
_COMMON_KEYS = {
    "torch_dtype",
    "dtype",
    "model_type",
    "transformers_version",
    "architectures",
    "_name_or_path",
    "output_attentions",
    "use_cache",
    "rope_theta",
    "rope_scaling",
    "rope_type",
    "partial_rotary_factor",
}


def hf_config_fields(family: str, base: dict | None = None) -> set[str]:
    """Every key model.hf may set for this family: the config class's constructor arguments and fields
    (this transformers version's), the attributes its modeling code reads, the legacy RoPE names, and
    whatever the pretrained config.json holds."""
    return _declared_fields(config_class(family)) | modeling_reads(family) | _COMMON_KEYS | set(base or {})


@functools.cache
def _declared_fields(conf_cls: type) -> frozenset[str]:
    """A config class's own fields: its constructor arguments, what its to_dict writes, its aliases."""
    keys = set(inspect.signature(conf_cls.__init__).parameters) - {"self", "kwargs"}
    return frozenset(keys | set(conf_cls().to_dict()) | set(getattr(conf_cls, "attribute_map", {})))


# `config.NAME`, `self.config.NAME` and `getattr(config, "NAME"...)` in a modeling file's source
_CONFIG_READ = re.compile(r"\bconfig\.([A-Za-z]\w*)|getattr\(\s*(?:self\.)?config\s*,\s*[\"'](\w+)[\"']")


@functools.cache
def modeling_reads(family: str) -> frozenset[str]:
    """The config attributes the family's modeling code reads: its config class takes any keyword and keeps
    it, and some attributes the modeling reads are no declared field of the class (Qwen2, Qwen2-MoE,
    Qwen3-MoE and OLMoE read `head_dim`, with hidden_size / heads where it is absent). Read from the
    source of this transformers version's modeling file, which is not imported (it is slow to import, and
    the launcher checks a config before any process builds a model)."""
    module = config_class(family).__module__.replace(".configuration_", ".modeling_")
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return frozenset()
    source = Path(spec.origin).read_text(encoding="utf-8")
    return frozenset(a or b for a, b in _CONFIG_READ.findall(source))


def head_dim(hf: PretrainedConfig) -> int:
    """Each attention head's width, as HF's attention takes it: `head_dim` where the config has one (not
    always hidden_size / heads: Qwen3-30B-A3B's is 128 at 2048 / 32), else hidden_size / heads."""
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def attention_widths(hf: PretrainedConfig) -> tuple[int, int]:
    """(the queries' width, the keys' and the values' width each) of an attention layer, per token."""
    kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    return head_dim(hf) * hf.num_attention_heads, head_dim(hf) * kv_heads


def _float_fields(conf_cls: type) -> set[str]:
    """The config fields HF types as float and not int (a strict dataclass refuses an int there)."""
    if not dataclasses.is_dataclass(conf_cls):
        return set()
    fields = set()
    for f in dataclasses.fields(conf_cls):
        kinds = set(typing.get_args(f.type)) or {f.type}
        if float in kinds and int not in kinds:
            fields.add(f.name)
    return fields


def resolve_hf_config(cfg: ModelConfig, where: Where | None = None) -> tuple[str, PretrainedConfig]:
    """(family, the HF config) of model.pretrained's config.json with model.hf over it; `where`: where
    model.hf's keys were set, for the error naming a value HF refuses."""
    family, merged = merged_fields(cfg)
    conf_cls = config_class(family)
    # YAML and JSON write 0 for 0.0 (`router_aux_loss_coef: 0`): a whole number where HF wants a float is one
    floats = _float_fields(conf_cls)
    merged = {k: float(v) if k in floats and type(v) is int else v for k, v in merged.items()}
    # null for an attribute the class does not declare is its absence: the modeling code reads such an
    # attribute as getattr(config, name, default), which null would break (Qwen2's head_dim: None ** -0.5)
    declared = _declared_fields(conf_cls) | _COMMON_KEYS
    merged = {k: v for k, v in merged.items() if v is not None or k in declared}
    try:
        hf = conf_cls(**merged)
    except _config_errors() as exc:
        text = " ".join(str(exc).split())  # one line: HF's may be several
        named = [k for k in re.findall(r"'(\w+)'", text) if k in merged]
        if named:
            raise hf_key_error(cfg, where, named[0], text) from None
        raise ConfigError(f"model.hf: {text}") from None
    hf._attn_implementation = ATTENTION  # HF's SDPA with sliding windows honoured (megatrain/layers/attention.py)
    hf.use_cache = False
    return family, hf


def with_experts(hf: PretrainedConfig, experts: str) -> PretrainedConfig:
    """`hf` running its experts on the path engine.moe_experts names, as `_attn_implementation` names the
    attention: "hf" leaves HF's choice; "megatrain" registers megatrain/layers/experts.py with HF and names it on a
    copy (the spec's config is shared by whatever else the process builds)."""
    if experts == "hf":
        return hf
    from megatrain.layers.experts import EXPERTS  # registers the path with HF's ExpertsInterface

    out = copy.deepcopy(hf)
    out._experts_implementation = EXPERTS
    return out


def meta_model(family: str, hf: PretrainedConfig) -> torch.nn.Module:
    """The model's structure with no storage: templates and shapes come from here."""
    with torch.device("meta"):
        return family_classes(family)[1](hf)


def check_on_meta(cfg: ModelConfig, experts: str = "hf", where: Where | None = None) -> None:
    """The checks that run the model's structure on the meta device (shapes only, no storage, no compute), built
    once, before any process starts: its attention runs the config's shapes, and its experts run on the path
    engine.moe_experts (`experts`) names."""
    family, hf = resolve_hf_config(cfg, where)
    model = meta_model(family, hf)
    _check_attention(cfg, where, family, hf, model)
    _check_experts(family, hf, model, experts)


def _check_attention(
    cfg: ModelConfig, where: Where | None, family: str, hf: PretrainedConfig, model: torch.nn.Module
) -> None:
    """One layer's attention on the meta device. HF's OLMoE, for one, norms q and k over hidden_size, so it
    runs only where head_dim is hidden_size / heads: otherwise its first step fails."""
    attention = getattr(model.model.layers[0], "self_attn", None) if hf.num_hidden_layers else None
    if attention is None:
        return
    with torch.device("meta"):
        x = torch.empty(1, 2, hf.hidden_size)
        try:
            attention(x, position_embeddings=model.model.rotary_emb(x, torch.arange(2)[None]), attention_mask=None)
        except RuntimeError as exc:
            problem = " ".join(str(exc).split())
            plain = hf.hidden_size // hf.num_attention_heads
            if head_dim(hf) != plain:
                msg = f"{head_dim(hf)}: HF's {family} attention takes only hidden_size / num_attention_heads"
                msg += f" ({plain}) here ({problem}); leave head_dim out or set it to {plain}"
                raise hf_key_error(cfg, where, "head_dim", msg) from None
            raise ConfigError(f"model.hf: HF's {family} attention cannot run this config: {problem}") from None


def _check_experts(family: str, hf: PretrainedConfig, model: torch.nn.Module, experts: str) -> None:
    """engine.moe_experts=megatrain runs the experts' activations it knows (megatrain/layers/experts.py runs): any other
    stops here, not in the first step."""
    if experts == "hf":
        return
    from megatrain.layers.experts import runs

    for module in model.modules():
        if hasattr(module, "gate_up_proj") and hasattr(module, "down_proj") and not runs(module):
            act = getattr(hf, "hidden_act", "?")
            raise ConfigError(
                f"engine.moe_experts: megatrain runs SwiGLU experts (and GPT-OSS's clamped GLU), not {family}'s "
                f"experts with hidden_act {act!r}; set engine.moe_experts=hf (transformers' experts)"
            )


def _unit_modules(model: torch.nn.Module) -> list[tuple[str, str, dict[str, torch.nn.Module | torch.Tensor]]]:
    inner = model.model
    units: list[tuple[str, str, dict]] = [("embed", "model.embed_tokens.", {"": inner.embed_tokens})]
    for i, layer in enumerate(inner.layers):
        units.append(("layer", f"model.layers.{i}.", {"": layer}))
    head: dict[str, Any] = {"norm.": inner.norm}
    if not model.config.tie_word_embeddings:
        head["lm_head."] = model.lm_head
    units.append(("head", "model.", head))
    return units


def build_spec(cfg: ModelConfig, no_decay_1d: bool = True) -> ModelSpec:
    family, hf = resolve_hf_config(cfg)
    model = meta_model(family, hf)
    for name, _ in model.named_buffers():
        if "rotary_emb" not in name:
            raise ConfigError(f"model: buffer '{name}' outside the rotary embedding is not supported")
    tied = bool(hf.tie_word_embeddings)
    unit_tensors, hf_names = [], {}
    for index, (kind, prefix, mods) in enumerate(_unit_modules(model)):
        tensors = []
        for sub, mod in mods.items():
            for pname, p in mod.named_parameters():
                name = sub + pname
                tensors.append((name, tuple(p.shape), not (no_decay_1d and p.dim() < 2)))
                if kind == "head" and sub == "lm_head.":
                    hf_names[f"{index}:{name}"] = name  # lm_head.weight lives outside model.
        unit_tensors.append((kind, prefix, tensors))
    return ModelSpec(family, hf, build_layout(unit_tensors, tied, hf_names))


# Random draws that take a `generator`: the Tensor methods HF's init reaches through torch.nn.init.
_RANDOM_METHODS = {
    torch.Tensor.normal_,
    torch.Tensor.uniform_,
    torch.Tensor.random_,
    torch.Tensor.bernoulli_,
    torch.Tensor.exponential_,
    torch.Tensor.cauchy_,
    torch.Tensor.log_normal_,
    torch.Tensor.geometric_,
    torch.normal,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
}


class UnitRng(torch.overrides.TorchFunctionMode):
    """Sends every random draw made in this thread to one generator (torch function modes are per
    thread), so units can be drawn in parallel threads and each still gets exactly the numbers the
    global generator seeded with its seed would give (the same CPU generator, the same sequence)."""

    def __init__(self, seed: int):
        super().__init__()
        self.gen = torch.Generator().manual_seed(seed)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if kwargs.get("generator", 0) is None or ("generator" not in kwargs and func in _RANDOM_METHODS):
            kwargs["generator"] = self.gen  # torch.nn.init.* pass generator=None down explicitly
        return func(*args, **kwargs)


def unit_seed(seed: int, unit: int) -> int:
    return seed * 1_000_003 + unit


def init_unit(
    spec: ModelSpec, model: torch.nn.Module, unit: int, seed: int, into: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Fresh HF-style init of one unit (the family's `_init_weights`), on the CPU, from the unit's own seed,
    so a 9B model never has to exist whole in one process and units may be drawn in parallel threads.

    `into`: fp32 views (keyed by slot name, e.g. slices of the unit's tile in shared memory) that the
    parameters are bound to, so the draws land there with no copy; returned as given."""
    _, _, mods = _unit_modules(model)[unit]
    out: dict[str, torch.Tensor] = {}
    with UnitRng(unit_seed(seed, unit)):
        for sub, mod in mods.items():
            real = _materialize(copy.deepcopy(mod), sub, into or {})  # the meta model stays storage-free
            for m in real.modules():
                model._init_weights(m)
            for pname, p in real.named_parameters():
                if into is not None and sub + pname in into and p.data_ptr() == into[sub + pname].data_ptr():
                    out[sub + pname] = into[sub + pname]
                else:
                    out[sub + pname] = p.detach().float()
    return out


def _materialize(mod: torch.nn.Module, sub: str, views: dict[str, torch.Tensor]) -> torch.nn.Module:
    """Give a meta module CPU storage: a parameter with an fp32 view of its shape in `views` is bound to
    it, everything else is allocated empty."""
    for name, p in list(mod.named_parameters()):
        view = views.get(sub + name)
        owner, _, leaf = name.rpartition(".")
        target = mod.get_submodule(owner)
        if view is not None and p.dtype == view.dtype and tuple(p.shape) == tuple(view.shape):
            setattr(target, leaf, torch.nn.Parameter(view, requires_grad=p.requires_grad))
        else:
            setattr(target, leaf, torch.nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad))
    for m in mod.modules():
        for bname, b in m._buffers.items():
            if b is not None and b.is_meta:
                m._buffers[bname] = torch.empty_like(b, device="cpu")
    return mod
