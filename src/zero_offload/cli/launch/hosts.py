"""Which nodes and slots a multi-node launch uses, as DeepSpeed's launcher reads them.

* A hostfile (``-H/--hostfile``): one ``HOST slots=N`` line per node, ``#`` comments and blank
  lines ignored; the order of the lines is the order of the node ranks. A line that does not
  parse, a host given twice, or a file without hosts is an error naming the file and line.
* ``-i/--include`` / ``-e/--exclude``: ``NODE_SPEC[@NODE_SPEC ...]`` with ``NODE_SPEC =
  HOST[:SLOT[,SLOT ...]]`` (``worker-0@worker-1:0,2``): the only hosts/slots used, or those left
  out. Every host and slot named must be in the hostfile.
* ``--num_nodes N``: the first N hosts; ``--num_gpus K``: slots 0..K-1 of each.
* SLURM's compact node lists (``node[01-03,7],gpu5``), expanded in order.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from pathlib import Path

_LINE = re.compile(r"^(\S+)\s+slots=(\d+)\s*$")


class HostError(ValueError):
    """A hostfile, include/exclude string or node list that cannot be used; names it."""


def parse_hostfile(path: str | Path) -> OrderedDict[str, int]:
    """``{host: slots}`` in file order. Raises HostError naming the file and the bad line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise HostError(f"hostfile {path}: cannot read it ({e.strerror or e})") from None
    pool: OrderedDict[str, int] = OrderedDict()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            raise HostError(
                f"hostfile {path}, line {number}: {raw!r} does not parse; expected "
                "'HOST slots=N' (e.g. 'worker-0 slots=8')"
            )
        host, slots = m.group(1), int(m.group(2))
        if host in pool:
            raise HostError(f"hostfile {path}, line {number}: host {host!r} is listed twice")
        if slots < 1:
            raise HostError(f"hostfile {path}, line {number}: {host!r} has slots=0")
        pool[host] = slots
    if not pool:
        raise HostError(f"hostfile {path}: no 'HOST slots=N' line")
    return pool


def _node_specs(text: str, flag: str) -> OrderedDict[str, list[int]]:
    """``worker-0@worker-1:0,2`` -> ``{worker-0: [], worker-1: [0, 2]}`` (empty: every slot)."""
    out: OrderedDict[str, list[int]] = OrderedDict()
    for spec in text.split("@"):
        host, _, slots = spec.partition(":")
        if not host:
            raise HostError(f"{flag} {text!r}: an empty host in {spec!r}")
        try:
            out[host] = [int(s) for s in slots.split(",")] if slots else []
        except ValueError:
            raise HostError(f"{flag} {text!r}: slots of {host!r} must be integers") from None
    return out


def select_hosts(
    pool: OrderedDict[str, int],
    include: str = "",
    exclude: str = "",
    num_nodes: int | None = None,
    num_gpus: int | None = None,
) -> OrderedDict[str, list[int]]:
    """The hosts and slots a launch uses, in hostfile order (DeepSpeed's rules; see above)."""
    if include and exclude:
        raise HostError("--include and --exclude cannot be used together")
    if (include or exclude) and (num_nodes is not None or num_gpus is not None):
        raise HostError("--num_nodes/--num_gpus cannot be used with --include/--exclude")
    active = OrderedDict((h, list(range(n))) for h, n in pool.items())
    flag, text = ("--include", include) if include else ("--exclude", exclude)
    if text:
        specs = _node_specs(text, flag)
        for host, slots in specs.items():
            if host not in active:
                raise HostError(f"{flag}: host {host!r} is not in the hostfile")
            bad = [s for s in slots if s not in active[host]]
            if bad:
                raise HostError(f"{flag}: host {host!r} has no slot {bad[0]}")
        if include:
            active = OrderedDict(
                (h, sorted(set(specs[h])) if specs[h] else s)
                for h, s in active.items()
                if h in specs
            )
        else:
            for host, slots in specs.items():
                active[host] = [s for s in active[host] if slots and s not in slots]
            active = OrderedDict((h, s) for h, s in active.items() if s)
    if num_nodes is not None:
        if num_nodes > len(active):
            raise HostError(f"--num_nodes {num_nodes}: the hostfile lists {len(active)} host(s)")
        active = OrderedDict(list(active.items())[:num_nodes])
    if num_gpus is not None:
        active = OrderedDict((h, list(range(num_gpus))) for h in active)
    if not active:
        raise HostError(f"{flag} {text!r} leaves no host to launch on")
    return active


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_nodelist(text: str) -> list[str]:
    """SLURM's compact host list (``node[01-03,7],gpu5``) as host names, in order (one bracket
    group per name, as SLURM writes them for names that differ in one number)."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", text):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for item in ranges.split(","):
            r = _RANGE.match(item)
            if not r:
                raise HostError(f"SLURM node list {text!r}: cannot read {item!r}")
            lo, hi = r.group(1), r.group(2) or r.group(1)
            hosts.extend(f"{prefix}{n:0{len(lo)}d}{suffix}" for n in range(int(lo), int(hi) + 1))
    return hosts


def visible_devices(slots: list[int]) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` for a node that uses ``slots``: none when they are the first N
    devices (torchrun's LOCAL_RANK picks those)."""
    if slots == list(range(len(slots))):
        return {}
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(s) for s in slots)}
