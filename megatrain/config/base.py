"""Machinery for the one config tree: documented fields, YAML + `key=value` loading, validation.

Each component owns its dataclass (ModelConfig in model.py, IpcConfig in ipc/protocol.py, ...);
launch/config/tree.py assembles the tree. YAML and command-line overrides only fill it: every key is
checked against the dataclasses, and a wrong one is reported with its file and line.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from megatrain.errors import ConfigError


def opt(default: Any, doc: str, **kw: Any) -> Any:
    """A config field with its documentation (shown by `megatrain-launch --config-reference`)."""
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"doc": doc}, **kw)
    return dataclasses.field(default=default, metadata={"doc": doc}, **kw)


def section(cls: type, doc: str) -> Any:
    return dataclasses.field(default_factory=cls, metadata={"doc": doc})


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads 1e-6 and 3e+4 as floats (YAML 1.1 insists on a dot)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


class Where:
    """Maps dotted key paths to 'file:line' using the YAML node tree."""

    def __init__(self, source: str, text: str | None, cli_keys: dict[str, str] | None = None):
        self.source, self.lines, self.cli_keys = source, {}, cli_keys or {}
        if text:
            self._walk(yaml.compose(text), "")

    def _walk(self, node: Any, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                path = f"{prefix}{key.value}"
                self.lines[path] = key.start_mark.line + 1
                self._walk(value, path + ".")

    def __call__(self, path: str) -> str:
        """Where `path` was set: the command line wins over the file, as it does for the value."""
        return self.set_at(path) or self.source

    def set_at(self, path: str) -> str | None:
        """Where the user set `path` (the command line's override, or file:line), or None: left at its default."""
        for k, item in self.cli_keys.items():
            inside = path == k or path.startswith(k + ".")  # the key, or within a mapping set on the CLI
            if inside or (k.startswith(path + ".") and path not in self.lines):  # a section only the CLI names
                return f"command line '{item}'"
        line = self.lines.get(path)
        return f"{self.source}:{line}" if line else None


def key_error(where: Where | None, path: str, msg: str) -> ConfigError:
    """A ConfigError naming the key and where it was set."""
    loc = where(path) if where else "config"
    return ConfigError(f"{loc}: config key '{path}': {msg}")


_KEYED = re.compile(r"(?P<key>[a-z_][a-z_0-9]*(?:\.[A-Za-z_0-9]+)+): ")


def locate(message: str, where: Where | None, cls: type) -> str:
    """`message` with where its config key was set in front, for a message that begins with the key of the
    `cls` tree it is about ('data.path: file ... does not exist'), raised where the key's origin is unknown
    (the data, the model's files). Unchanged when it begins with no key, or with one the user did not set."""
    m = _KEYED.match(message)
    loc = where.set_at(m["key"]) if m and where is not None and _is_key(cls, m["key"]) else None
    return f"{loc}: {message}" if loc else message


def _is_key(cls: type, path: str) -> bool:
    """`path` names a field of the dataclass tree `cls` (or a key within a mapping field, as model.hf.X)."""
    tp: Any = cls
    for part in path.split("."):
        if not dataclasses.is_dataclass(tp):
            return tp is dict or typing.get_origin(tp) is dict
        hints = typing.get_type_hints(tp)
        if part not in hints:
            return False
        tp = hints[part]
    return True


def _coerce(tp: Any, value: Any, path: str, where: Where | None) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for tp_i in inner[:-1]:  # in order: `int | str` takes 3 as an int and "auto" as a string
            try:
                return _coerce(tp_i, value, path, where)
            except ConfigError:
                pass
        return _coerce(inner[-1], value, path, where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise key_error(where, path, f"expected a mapping, got {value!r}")
        return build(tp, value, path + ".", where)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise key_error(where, path, f"expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise key_error(where, path, f"expected an integer, got {value!r}")
    if tp is float:
        try:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        except (TypeError, ValueError):
            raise key_error(where, path, f"expected a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise key_error(where, path, f"expected a string, got {value!r}")
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise key_error(where, path, f"expected a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis and len(args) != len(value):
            raise key_error(where, path, f"expected {len(args)} items, got {len(value)}")
        item_t = args[0] if args else Any
        return origin(_coerce(item_t, v, f"{path}[{i}]", where) for i, v in enumerate(value))
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise key_error(where, path, f"expected a mapping, got {value!r}")
        return dict(value)
    raise key_error(where, path, f"unsupported field type {tp}")


def build(cls: type, data: dict, prefix: str = "", where: Where | None = None) -> Any:
    """Instantiate dataclass `cls` from a nested dict, rejecting unknown keys with a suggestion."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in _moved(cls, data, prefix, where).items():
        path = f"{prefix}{key}"
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {', '.join(names)}"
            raise key_error(where, path, "unknown key" + hint)
        kwargs[key] = _coerce(hints[key], value, path, where)
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise _section_error(cls, where, prefix, kwargs, exc) from None
    return obj


def _moved(cls: type, data: dict, prefix: str, where: Where | None) -> dict:
    """`data` with the keys `cls.RENAMED` lists (old name -> new dotted path inside the section) moved to
    where they now live, so a config written before the rename (a run's saved config.yaml) still loads;
    each move is logged. Both names given with different values is an error naming both."""
    renamed: dict[str, str] = getattr(cls, "RENAMED", {})
    if not any(k in data for k in renamed):
        return data
    from megatrain import log

    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for old, new in renamed.items():
        if old not in data:
            continue
        value = data.pop(old)
        head, _, leaf = new.partition(".")
        target = data.setdefault(head, {})
        if not isinstance(target, dict) or target.get(leaf, value) != value:
            raise key_error(where, prefix + old, f"renamed to '{prefix}{new}', which is also given; keep one")
        target[leaf] = value
        log(f"config: '{prefix}{old}' is now '{prefix}{new}' (read as that)")
    return data


def _section_error(cls: type, where: Where | None, prefix: str, kwargs: dict, exc: Exception) -> ConfigError:
    """A section's own check failed: name the key it is about, where that key was set (file:line or the
    command line) and its value. A check may speak of several keys ('lr and eps must be > 0'): the key is
    the one whose value alone fails it, found by building the section again with that key left at its
    default; where no single key does, the first key the message names."""
    text = str(exc)
    named = [k for k in kwargs if re.search(rf"(?<![\w.])({re.escape(prefix + k)}|{re.escape(str(k))})\b", text)]
    key = _culprit(cls, kwargs, named) or (named[0] if named else None)
    if key is not None:
        return key_error(where, prefix + key, f"{kwargs[key]!r} is not allowed: {text}")
    loc = where(prefix[:-1]) if where else "config"
    return ConfigError(f"{loc}: section '{prefix[:-1]}': {text}")


def _culprit(cls: type, kwargs: dict, named: list[str]) -> str | None:
    """The key of `kwargs` without which `cls` builds (the keys the message names tried first), or None."""
    for key in named + [k for k in kwargs if k not in named]:
        try:
            cls(**{k: v for k, v in kwargs.items() if k != key})
        except (TypeError, ValueError):
            continue
        return key
    return None


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"command-line override '{item}' is not of the form dotted.key=value")
    key, raw = item.split("=", 1)
    try:
        value = _yaml(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def merge_overrides(data: dict, overrides: list[str]) -> dict:
    for item in overrides:
        keys, value = parse_override(item)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"command-line override '{item}': '{k}' is not a section")
        node[keys[-1]] = value
    return data


def load(cls: type, path: str | Path | None, overrides: list[str] | None = None) -> Any:
    """Load `cls` from a YAML file plus dotted overrides; every error names key and location."""
    return load_located(cls, path, overrides)[0]


def load_located(cls: type, path: str | Path | None, overrides: list[str] | None = None) -> tuple[Any, Where]:
    """load(), and where each key was set (for checks that span sections)."""
    text, source = None, "defaults"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{p}' does not exist")
        text, source = p.read_text(), str(p)
    try:
        data = _yaml(text) if text else {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f"{source}:{mark.line + 1}" if mark is not None else source
        what = " ".join(str(getattr(exc, "problem", None) or exc).split())
        raise ConfigError(f"{at}: not valid YAML: {what}") from None
    if path is not None and not data:
        raise ConfigError(
            f"{source}: the config file sets nothing; give at least the model and the data "
            "(see examples/default.yaml), or run without a file to use the built-in defaults"
        )
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections")
    cli_keys = {".".join(parse_override(item)[0]): item for item in overrides or []}
    data = merge_overrides(data, overrides or [])
    where = Where(source, text, cli_keys)
    return build(cls, data, "", where), where


def to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)


def dump_yaml(obj: Any) -> str:
    def plain(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x

    return yaml.safe_dump(plain(to_dict(obj)), sort_keys=False)


def reference_table(cls: type) -> str:
    """The config reference as a markdown table (README's section and `megatrain-launch --config-reference`)."""
    lines = ["| key | default | meaning |", "|---|---|---|"]
    for key, default, doc in reference(cls):
        lines.append(f"| `{key}` | `{default}` | {doc.replace('|', '&#124;')} |")
    return "\n".join(lines) + "\n"


def differences(obj: Any, default: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf of `obj` that differs from `default` (same dataclass type)."""
    out = []
    for f in dataclasses.fields(obj):
        mine, theirs = getattr(obj, f.name), getattr(default, f.name)
        if dataclasses.is_dataclass(mine):
            out += differences(mine, theirs, f"{prefix}{f.name}.")
        elif mine != theirs:
            out.append((prefix + f.name, mine))
    return out


def reference(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, doc) rows for every leaf field, for the README and --config-reference."""
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        doc = f.metadata.get("doc", "")
        if dataclasses.is_dataclass(hints[f.name]):
            rows += reference(hints[f.name], f"{prefix}{f.name}.")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        rows.append((prefix + f.name, repr(default), doc))
    return rows
