"""The search: the fastest assignment of schemes to units within an accuracy budget and a weight cap.

Each unit u has options o with an accuracy cost kl[u][o] (measured KL, assumed additive over units),
a latency cost cost[u][o] (its share of the predicted step time, summed over the requested batch
sizes relative to BF16) and weight bytes[u][o]. Chosen algorithm: an exact dynamic programme over the
units that keeps, after each unit, the partial plans no other partial plan beats on all three of
(kl, bytes, cost), dropping those already over a budget (or unable to meet the weight cap with the
smallest options of the remaining units). A plan dropped as dominated cannot be part of an optimum,
since the units' costs add, so the plan returned is the optimum of the multiple-choice knapsack.
If a front grows past `max_states`, it is thinned to the cheapest plan per (log kl, log bytes) cell
and the result is then approximate (the Plan says so).

The same programme without budgets gives the whole front: every plan not beaten on (kl, cost, bytes).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Option:
    scheme: str
    kl: float
    cost: float
    bytes: int


@dataclass
class SearchUnit:
    key: str
    options: list[Option]


@dataclass(frozen=True)
class Plan:
    choice: tuple[int, ...]  # option index per unit
    kl: float
    cost: float
    bytes: int


@dataclass
class SearchResult:
    plans: list[Plan]  # the front that survived the budgets (all of it, without budgets)
    exact: bool = True
    notes: list[str] = field(default_factory=list)


def _pareto(plans: list[Plan]) -> list[Plan]:
    """Plans that no other plan beats or equals on all of kl, bytes, cost (first of equals kept)."""
    plans = sorted(plans, key=lambda p: (p.kl, p.bytes, p.cost))
    keep: list[Plan] = []
    stair_b: list[int] = []  # bytes, increasing, of the plans kept so far (each with a lower kl)
    stair_c: list[float] = []  # their cost, decreasing
    for p in plans:
        i = bisect.bisect_right(stair_b, p.bytes) - 1
        if i >= 0 and stair_c[i] <= p.cost:
            continue  # some plan with kl <= and bytes <= costs no more
        keep.append(p)
        j = bisect.bisect_left(stair_b, p.bytes)
        end = j
        while end < len(stair_b) and stair_c[end] >= p.cost:
            end += 1
        stair_b[j:end], stair_c[j:end] = [p.bytes], [p.cost]
    return keep


def _thin(plans: list[Plan], max_states: int) -> list[Plan]:
    cells: dict[tuple[int, int], Plan] = {}
    bins = max(4, int(math.sqrt(max_states)))
    kls = [math.log(p.kl + 1e-12) for p in plans]
    bys = [math.log(p.bytes + 1) for p in plans]
    lo_k, hi_k, lo_b, hi_b = min(kls), max(kls) + 1e-9, min(bys), max(bys) + 1e-9
    for p, k, b in zip(plans, kls, bys):
        cell = (int((k - lo_k) / (hi_k - lo_k) * bins), int((b - lo_b) / (hi_b - lo_b) * bins))
        if cell not in cells or p.cost < cells[cell].cost:
            cells[cell] = p
    return _pareto(list(cells.values()))


def search(units: list[SearchUnit], max_kl: float = math.inf, max_bytes: float = math.inf,
           fixed_bytes: int = 0, max_states: int = 20000) -> SearchResult:
    """The front of plans within max_kl and max_bytes (weights of all units + fixed_bytes)."""
    rest_min = [0] * (len(units) + 1)  # smallest bytes the units from i on can take
    for i in range(len(units) - 1, -1, -1):
        rest_min[i] = rest_min[i + 1] + min(o.bytes for o in units[i].options)
    plans = [Plan((), 0.0, 0.0, fixed_bytes)]
    exact = True
    for i, unit in enumerate(units):
        grown = []
        for p in plans:
            for j, o in enumerate(unit.options):
                kl, nbytes = p.kl + o.kl, p.bytes + o.bytes
                if kl > max_kl or nbytes + rest_min[i + 1] > max_bytes:
                    continue
                grown.append(Plan(p.choice + (j,), kl, p.cost + o.cost, nbytes))
        plans = _pareto(grown)
        if len(plans) > max_states:
            plans, exact = _thin(plans, max_states), False
        if not plans:
            break
    notes = [] if exact else [f"the front passed {max_states} plans and was thinned: the choice is near-optimal"]
    return SearchResult(plans, exact, notes)


def best(result: SearchResult) -> Plan | None:
    """The cheapest plan; ties go to fewer bytes, then to lower kl."""
    return min(result.plans, key=lambda p: (p.cost, p.bytes, p.kl), default=None)


def front_2d(plans: list[Plan]) -> list[Plan]:
    """The (kl, cost) front of plans, by increasing kl."""
    out, best_cost = [], math.inf
    for p in sorted(plans, key=lambda p: (p.kl, p.cost)):
        if p.cost < best_cost:
            out.append(p)
            best_cost = p.cost
    return out


def closest(plans: list[Plan], max_kl: float, max_bytes: float) -> Plan:
    """The plan nearest to meeting both budgets: least max(kl / max_kl, bytes / max_bytes)."""
    def excess(p: Plan) -> float:
        return max(p.kl / max_kl if max_kl < math.inf else 0.0,
                   p.bytes / max_bytes if max_bytes < math.inf else 0.0)
    return min(plans, key=lambda p: (excess(p), p.cost))
