"""Machine descriptions: the JSON files (tpattn/model/machines/*.json or any path), read, merged
("base", "passes_from"), validated, and their calibration points turned into efficiency curves
(roofline / measured). Pure Python: no GPU needed."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from .errors import MachineError
from .steps import COLLECTIVE_NAMES, ELEM, Step, attention_backward_step, attention_steps, copy_step, gemm_step

MACHINE_DIR = Path(__file__).resolve().parent / "machines"


REQUIRED = {
    "name": str, "gpu": str, "gpus_per_node": int, "memory_GiB": (int, float),
    "peaks": dict, "sources": dict,
}
PEAKS = ("tensor_tflops", "fp32_tflops", "mem_GBps")
LINK_FIELDS = ("busbw_GBps", "step_us", "base_us")
WAKE_FIELDS = ("wake_us", "idle_ms")   # optional, both or neither: the link's wake-up after an idle time
PASS_KEYS = ("qkv_proj", "out_proj", "relayout", "epilogue", "naive.qk", "naive.softmax", "naive.pv",
             "tiled.qk", "tiled.softmax", "tiled.pv", "fused.fused", "fused.bwd", "fused.bwd_det")


@dataclass
class Machine:
    name: str
    data: dict                    # the merged JSON
    path: str
    curves: dict = field(default_factory=dict)  # key -> [(log roofline ms, efficiency)], computed at load

    @property
    def gpus_per_node(self) -> int:
        return int(self.data["gpus_per_node"])

    @property
    def max_nodes(self) -> int | None:
        v = self.data.get("max_nodes")
        return None if v is None else int(v)

    @property
    def memory_bytes(self) -> int:
        return int(self.data["memory_GiB"] * 2**30)

    def peak(self, name: str) -> float:
        return float(self.data["peaks"][name])

    def link(self, name: str) -> dict | None:
        return (self.data.get("links") or {}).get(name)

    def layer(self, field_name: str, kernel: str | None = None, default: float = 0.0) -> float:
        v = (self.data.get("layer") or {}).get(field_name, default)
        if isinstance(v, dict):
            return float(v.get(kernel, v.get("default", default)))
        return float(v)

    def host_ms(self, kernel: str, world: int, collectives: int) -> tuple[float, str]:
        """The host time of one call of `kernel`'s layer at `world` ranks, and where it comes from:
        the W-rank layer's as calibration measured it (layer.host_ms_by_world), else the 1-rank
        layer's (host_ms) + `collectives` x host_ms_per_collective (files without the former)."""
        by_w = self._by_world("host_ms_by_world", world)
        if kernel in by_w:
            return float(by_w[kernel]), f"calibrated at {world} rank(s)"
        return (self.layer("host_ms", kernel, 0.5) + collectives * self.layer("host_ms_per_collective", None, 0.1),
                "1-rank host_ms + host_ms_per_collective each")

    def stall_ms(self, kernel: str, world: int) -> float:
        """The stall of one eager call of `kernel`'s layer at `world` ranks: calibrated at that world
        size (layer.stall_ms_by_world), else at one rank (layer.stall_ms); 0 in files without them."""
        by_w = self._by_world("stall_ms_by_world", world)
        if kernel in by_w:
            return float(by_w[kernel])
        return self.layer("stall_ms", kernel, 0.0)

    def _by_world(self, field_name: str, world: int) -> dict:
        """layer.<field_name>[str(world)]: {kernel: ms} calibrated at that world size, or {}."""
        return ((self.data.get("layer") or {}).get(field_name) or {}).get(str(world)) or {}


def machine_names() -> list[str]:
    return sorted(p.stem for p in MACHINE_DIR.glob("*.json"))


def _resolve(name_or_path: str, relative_to: Path | None = None, named_by: str = "--machine") -> Path:
    """A machine file: a path (absolute, or relative to the cwd or to the file that names it), or the
    name of a shipped one (tpattn/model/machines/NAME.json). named_by: who named it, for the error
    (the flag, or a field of another machine file)."""
    p = Path(name_or_path)
    cands = []
    if p.suffix == ".json" or "/" in name_or_path:
        if relative_to is not None and not p.is_absolute():
            cands.append(relative_to / p)
        cands.append(p)
    cands.append(MACHINE_DIR / f"{name_or_path}.json")
    for c in cands:
        if c.is_file():
            return c
    shipped = machine_names()
    if not shipped:
        raise MachineError(f"{named_by} {name_or_path}: no such file, and no machine files were installed with tpattn "
                           f"({MACHINE_DIR}/*.json is missing); give the path of a machine file")
    raise MachineError(f"{named_by} {name_or_path}: no such file and no shipped machine of that name; "
                       f"give a JSON file or one of {', '.join(shipped)}")


def _read(path: Path, what: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise MachineError(f"{what}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
                           "fix the file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise MachineError(f"{what}: cannot read it ({getattr(exc, 'strerror', None) or exc}); check the path") from None
    if not isinstance(data, dict):
        raise MachineError(f"{what}: the file must hold one JSON object (got {type(data).__name__})")
    return data


def _merge(base: dict, over: dict) -> dict:
    """base's fields overridden by over's: objects merged key by key, except "passes" and
    "sources" entries, which are replaced whole."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "passes":
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _read_merged(path: Path, seen: tuple) -> dict:
    """The file's fields over those of its "base" (recursively)."""
    what = f"machine file {path}"
    if str(path) in seen:
        raise MachineError(f"{what}: \"base\" or \"passes_from\" loops back to it; break the cycle")
    data = _read(path, what)
    if "base" in data:
        if not isinstance(data["base"], str):
            raise MachineError(f"{what}: \"base\" must be the name or path of another machine file")
        base = _read_merged(_resolve(data["base"], path.parent, f'{what}: "base"'), (*seen, str(path)))
        data = _merge(base, {k: v for k, v in data.items() if k != "base"})
    return data


def load_machine(name_or_path: str, _seen: tuple = ()) -> Machine:
    """Read, merge and validate a machine description; MachineError (one line naming the fix) when it
    cannot be used. "base": another machine whose fields this one overrides. "passes_from": another
    machine whose calibrated passes and layer overheads this one uses; their efficiencies are
    computed against that machine's own peaks, then applied to this one's."""
    path = _resolve(name_or_path)
    what = f"machine file {path}"
    data = _read_merged(path, _seen)
    validate_machine(data, what)
    m = Machine(name=data["name"], data=data, path=str(path))
    src = data.get("passes_from")
    if src:
        other = load_machine(str(_resolve(src, path.parent, f'{what}: "passes_from"')), (*_seen, str(path)))
        m.curves = dict(other.curves)
        if "layer" not in data and "layer" in other.data:
            data["layer"] = copy.deepcopy(other.data["layer"])
    m.curves.update(_curves(m, data.get("passes") or {}))
    return m


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def validate_machine(data: dict, what: str = "machine file") -> None:
    """Raise MachineError for the first problem, with the fix in the message."""
    for k, t in REQUIRED.items():
        if k not in data:
            raise MachineError(f"{what}: missing field \"{k}\"; add it (see docs/plan.md, machine files)")
        if not isinstance(data[k], t) or isinstance(data[k], bool):
            tn = t.__name__ if isinstance(t, type) else "number"
            raise MachineError(f"{what}: \"{k}\" must be a {tn} (got {json.dumps(data[k])[:40]})")
    if data["gpus_per_node"] < 1:
        raise MachineError(f"{what}: \"gpus_per_node\" must be at least 1 (got {data['gpus_per_node']})")
    if not _num(data["memory_GiB"]) or data["memory_GiB"] <= 0:
        raise MachineError(f"{what}: \"memory_GiB\" must be a positive number of GiB (got {data['memory_GiB']})")
    mn = data.get("max_nodes")
    if mn is not None and (not isinstance(mn, int) or isinstance(mn, bool) or mn < 1):
        raise MachineError(f"{what}: \"max_nodes\" must be a positive integer or null (got {json.dumps(mn)})")
    for p in PEAKS:
        v = data["peaks"].get(p)
        if not _num(v) or v <= 0:
            raise MachineError(f"{what}: \"peaks.{p}\" must be a positive number (got {json.dumps(v)}); "
                               "measure it with --calibrate or take it from the datasheet")
    links = data.get("links") or {}
    if not isinstance(links, dict):
        raise MachineError(f"{what}: \"links\" must be an object with \"nvlink\" and optionally \"network\"")
    for lname, link in links.items():
        if lname not in ("nvlink", "network"):
            raise MachineError(f"{what}: unknown link \"links.{lname}\"; use \"nvlink\" (inside a node) or "
                               "\"network\" (between nodes)")
        if not isinstance(link, dict):
            raise MachineError(f"{what}: \"links.{lname}\" must be an object with {', '.join(LINK_FIELDS)}")
        for f in LINK_FIELDS:
            v = link.get(f)
            if not _num(v) or v < 0 or (f == "busbw_GBps" and v <= 0):
                kind = "positive" if f == "busbw_GBps" else "non-negative"
                raise MachineError(f"{what}: \"links.{lname}.{f}\" must be a {kind} number (got {json.dumps(v)})")
        wake = [f for f in WAKE_FIELDS if link.get(f) is not None]
        if wake and len(wake) < len(WAKE_FIELDS):
            raise MachineError(f"{what}: \"links.{lname}\" has {wake[0]} without "
                               f"{next(f for f in WAKE_FIELDS if f not in wake)}; give both (the link's wake-up and "
                               "the idle time after which it is paid) or neither")
        for f in wake:
            v = link[f]
            if not _num(v) or v < 0 or (f == "idle_ms" and v <= 0):
                kind = "positive" if f == "idle_ms" else "non-negative"
                raise MachineError(f"{what}: \"links.{lname}.{f}\" must be a {kind} number (got {json.dumps(v)})")
        per = link.get("per_collective") or {}
        if not isinstance(per, dict):
            raise MachineError(f"{what}: \"links.{lname}.per_collective\" must map a collective to its numbers")
        for cname, c in per.items():
            if cname not in COLLECTIVE_NAMES:
                raise MachineError(f"{what}: \"links.{lname}.per_collective.{cname}\" is not a collective; use "
                                   f"{', '.join(COLLECTIVE_NAMES)}")
            if not isinstance(c, dict):
                raise MachineError(f"{what}: \"links.{lname}.per_collective.{cname}\" must be an object")
            for f in ("busbw_GBps", "base_us"):
                if f in c and (not _num(c[f]) or c[f] < 0 or (f == "busbw_GBps" and c[f] <= 0)):
                    raise MachineError(f"{what}: \"links.{lname}.per_collective.{cname}.{f}\" must be a positive "
                                       f"number (got {json.dumps(c[f])})")
            if "layer_extra_us" in c and not _num(c["layer_extra_us"]):
                raise MachineError(f"{what}: \"links.{lname}.per_collective.{cname}.layer_extra_us\" must be a "
                                   f"number of us (got {json.dumps(c['layer_extra_us'])})")
    if links and "nvlink" not in links and data["gpus_per_node"] > 1:
        raise MachineError(f"{what}: \"links\" has no \"nvlink\" for the {data['gpus_per_node']} GPUs of a node; add it")
    passes = data.get("passes") or {}
    if not isinstance(passes, dict):
        raise MachineError(f"{what}: \"passes\" must map a pass ({', '.join(PASS_KEYS)}) to a list of points")
    for key, pts in passes.items():
        if key.split(":")[0] not in PASS_KEYS or key.count(":") > 1 or (":" in key and not key.endswith(":causal")):
            raise MachineError(f"{what}: unknown pass \"passes.{key}\"; use one of {', '.join(PASS_KEYS)} "
                               "(an attention pass may end in :causal)")
        if not isinstance(pts, list) or not pts:
            raise MachineError(f"{what}: \"passes.{key}\" must be a non-empty list of measured points")
        for i, pt in enumerate(pts):
            if not isinstance(pt, dict) or not _num(pt.get("ms")) or pt["ms"] <= 0:
                raise MachineError(f"{what}: \"passes.{key}[{i}]\" needs a positive \"ms\" (the measured time)")
            try:
                _point_step(key, pt)
            except (KeyError, TypeError, ValueError, OverflowError, StopIteration) as exc:
                raise MachineError(f"{what}: \"passes.{key}[{i}]\" lacks a field or has a bad value ({exc}); "
                                   f"{_POINT_FIELDS[_family(key)]}") from None
    if data.get("passes_from") is not None and not isinstance(data["passes_from"], str):
        raise MachineError(f"{what}: \"passes_from\" must be the name or path of a calibrated machine file")
    if not passes and not data.get("passes_from"):
        raise MachineError(f"{what}: no \"passes\" (calibration points) and no \"passes_from\"; run --calibrate on "
                           "the machine or name a calibrated machine in \"passes_from\"")
    layer = data.get("layer", {})
    if not isinstance(layer, dict):
        raise MachineError(f"{what}: \"layer\" must be an object (overhead_ms, host_ms, host_ms_per_collective)")
    for k, v in layer.items():
        if k in ("host_ms_by_world", "stall_ms_by_world"):  # {"W": {kernel: ms}}
            ok = isinstance(v, dict) and all(
                str(w).isdigit() and int(w) >= 1 and isinstance(per, dict) and per
                and all(_num(x) and x >= 0 for x in per.values()) for w, per in v.items())
            if not ok:
                raise MachineError(f"{what}: \"layer.{k}\" must map a world size (\"2\") to "
                                   "{kernel: non-negative ms}")
            continue
        vals = v.values() if isinstance(v, dict) else [v]
        if not all(_num(x) and x >= 0 for x in vals):
            raise MachineError(f"{what}: \"layer.{k}\" must be a non-negative number (or one per kernel)")
    # every number that is not a calibration point must say where it comes from
    srcs = data["sources"]
    needed = [f"peaks.{p}" for p in PEAKS] + ["memory_GiB"] + [f"links.{n}" for n in links]
    for k in needed:
        if not isinstance(srcs.get(k), str) or not srcs[k].strip():
            raise MachineError(f"{what}: \"sources\" has no entry for \"{k}\"; say where the number comes from "
                               "(a measurement with its command, or a datasheet with its address)")


# calibration points: the fields each family needs to rebuild the step whose efficiency they measure
_POINT_FIELDS = {
    "gemm": "a GEMM point needs M, K, N, dtype, out and ms",
    "copy": "a copy point needs bytes (read + written) and ms",
    "attn": "an attention point needs B, h, N, d, dtype, causal and ms",
}


def _family(key: str) -> str:
    k = key.split(":")[0]
    return "gemm" if k in ("qkv_proj", "out_proj") else "copy" if k in ("relayout", "epilogue") else "attn"


def _point_step(key: str, pt: dict) -> Step:
    """The step a calibration point timed, rebuilt from its fields (so its FLOPs and bytes are
    counted exactly as a prediction counts them)."""
    fam, k = _family(key), key.split(":")[0]
    if fam == "gemm":
        for f in ("M", "K", "N"):
            if int(pt[f]) < 1:
                raise ValueError(f"{f} must be at least 1")
        if pt["dtype"] not in ELEM or pt["out"] not in ELEM:
            raise ValueError(f"dtype and out must be one of {', '.join(ELEM)}")
        return gemm_step(k, k, int(pt["M"]), int(pt["K"]), int(pt["N"]), pt["dtype"], pt["out"])
    if fam == "copy":
        if not _num(pt["bytes"]) or pt["bytes"] <= 0:
            raise ValueError("bytes must be positive")
        return copy_step(k, k, float(pt["bytes"]), "")
    kernel, _ = k.split(".")
    if pt["dtype"] not in ELEM:
        raise ValueError(f"dtype must be one of {', '.join(ELEM)}")
    for f in ("B", "h", "N", "d"):
        if int(pt[f]) < 1:
            raise ValueError(f"{f} must be at least 1")
    if key.endswith(":causal") != bool(pt["causal"]):
        raise ValueError("causal must be true exactly in the :causal passes")
    if k in ("fused.bwd", "fused.bwd_det"):
        return attention_backward_step(kernel, int(pt["B"]), int(pt["h"]), int(pt["N"]), int(pt["d"]), pt["dtype"],
                                       bool(pt["causal"]), deterministic=k == "fused.bwd_det")
    steps = attention_steps(kernel, int(pt["B"]), int(pt["h"]), int(pt["N"]), int(pt["d"]), pt["dtype"],
                            bool(pt["causal"]))
    return next(s for s in steps if s.key == k)


def roofline_ms(m: Machine, step: Step) -> tuple[float, str]:
    """(roofline time in ms, what bounds it: compute or memory)."""
    t_mem = step.bytes / (m.peak("mem_GBps") * 1e6)
    t_fl = 0.0
    if step.flops and step.unit:
        peak = m.peak("tensor_tflops" if step.unit == "tensor" else "fp32_tflops")
        t_fl = step.flops / (peak * 1e9)
    return (t_fl, "compute") if t_fl >= t_mem else (t_mem, "memory")


def _curves(m: Machine, passes: dict) -> dict:
    """The calibration points as efficiencies on machine m (roofline / measured). An attention
    pass: {batch x heads: [(log N, efficiency)]}, a grid over the parallelism and the row length
    (the two things its efficiency depends on); a GEMM or a copy: [(log roofline ms, efficiency)]."""
    curves = {}
    for key, pts in passes.items():
        if _family(key) == "attn":
            grid: dict[int, list] = {}
            for pt in pts:
                st = _point_step(key, pt)
                roof, _ = roofline_ms(m, st)
                grid.setdefault(st.bh, []).append((math.log(st.n), roof / pt["ms"]))
            curves[key] = {hb: sorted(v) for hb, v in grid.items()}
        else:
            xs = []
            for pt in pts:
                roof, _ = roofline_ms(m, _point_step(key, pt))
                xs.append((math.log(roof), roof / pt["ms"]))
            curves[key] = sorted(xs)
    return curves
