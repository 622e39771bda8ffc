"""A run's requests: the edge grid (every key and field with each edge value, the same every run),
each category's share and the seeded Hypothesis rounds that draw it (`generate`).

It sends nothing and checks nothing (`checks`, `cli`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from specserve_client.fuzz.blocks import FAMILIES, forged_payload, request_of, shape_for, tensor
from specserve_client.fuzz.categories import CATEGORIES
from specserve_client.fuzz.contract import (
    CONTRACT_INPUTS,
    DEFAULT_ONLY_KEYS,
    INT32_MAX,
    INT32_MIN,
    PARAMS_BASE,
    SAMPLING_KEYS,
    FuzzRequest,
    TensorSpec,
)
from specserve_client.fuzz.edge_values import ID_EDGES, Huge, json_pieces

# ---- the edge grid: every key and field with each edge value, once ---------------------------

JSON_GRID = [math.nan, math.inf, -math.inf, -1, 0, 1e-40, 2**64, 5.5, True, [1, 2], None, Huge(1_000_000)]
SCALAR_GRID = {"INT32": [INT32_MIN, -1, 0, INT32_MAX],
               "FP32": [math.nan, math.inf, -math.inf, -1.0, 0.0, 1e-40, 3.4e38],
               "UINT64": [0, 2**63, 2**64 - 1]}
FORGED_GRID = [5.5, 1.5, -1, None, "5", True, [], {}, math.nan, 2**64]
GRID_IDS = (19556, 30, 2)  # a short prompt in the vocabulary


def grid_base(family: str) -> dict[str, TensorSpec]:
    return {"text_input": tensor("text_input", "Hi", family), "max_tokens": tensor("max_tokens", 4, family)}


def json_grid() -> list[tuple[str, dict[str, TensorSpec]]]:
    """(family, inputs): each sampling_parameters key with each JSON_GRID value (max_tokens 4 beside it,
    as a scalar tensor, which overrides the key)."""
    cells = []
    for key in SAMPLING_KEYS + DEFAULT_ONLY_KEYS:
        for value in JSON_GRID:
            family = FAMILIES[len(cells) % 2]
            value_json = (json_pieces({key: value}),)
            shape = shape_for("sampling_parameters", family)
            cells.append((family, grid_base(family) | {
                "sampling_parameters": TensorSpec("sampling_parameters", "BYTES", shape, value_json)}))
    return cells


def scalar_grid() -> list[tuple[str, dict[str, TensorSpec]]]:
    """(family, inputs): each INT32 / FP32 / UINT64 scalar input with each SCALAR_GRID value of its type."""
    cells = []
    for name, datatype in CONTRACT_INPUTS.items():
        for value in SCALAR_GRID.get(datatype, []):
            family = FAMILIES[len(cells) % 2]
            cells.append((family, grid_base(family) | {name: tensor(name, value, family)}))
    return cells


def forged_grid() -> list[dict[str, TensorSpec]]:
    """Inputs for llm_<variant>: each request_config params field with each FORGED_GRID value, then
    each odd prompt id."""
    configs = [json.dumps(forged_payload({"max_tokens": 4, name: value})).encode()
               for name in PARAMS_BASE for value in FORGED_GRID]
    valid = json.dumps(forged_payload({"max_tokens": 4})).encode()
    cells = [(GRID_IDS, config) for config in configs] + [((i,), valid) for i in ID_EDGES]
    return [{"input_ids": TensorSpec("input_ids", "INT32", (len(ids),), tuple(ids)),
             "request_config": TensorSpec("request_config", "BYTES", (1,), (config,))}
            for ids, config in cells]


def edge_grid(variants: tuple[str, ...]) -> list[FuzzRequest]:
    """Every cell of the three grids once, over the variants in turn (not drawn: the same every run)."""
    cells = json_grid() + scalar_grid() + [("llm", inputs) for inputs in forged_grid()]
    return [request_of("edges", f"{family}_{variants[i % len(variants)]}", inputs)
            for i, (family, inputs) in enumerate(cells)]


def spread(items: list[FuzzRequest], count: int) -> list[FuzzRequest]:
    """`count` of the items, evenly spaced (all of them when count allows)."""
    if count >= len(items):
        return items
    return [items[i * len(items) // count] for i in range(count)]


GRID = "edges"
KINDS = (*CATEGORIES, GRID)
WEIGHTS = {GRID: 7, "sampling_json": 5, "forged": 3, "scalars": 2, "nested_json": 2}  # the others: 1


def shares(count: int, kinds: tuple[str, ...]) -> dict[str, int]:
    """How many of `count` requests each category draws: by WEIGHTS, at least one each where the
    count allows."""
    total = sum(WEIGHTS.get(k, 1) for k in kinds)
    share = {k: max(1, count * WEIGHTS.get(k, 1) // total) for k in kinds}
    for k in (kinds * count)[: max(0, count - sum(share.values()))]:
        share[k] += 1
    return share


def draw_round(strategy: st.SearchStrategy[FuzzRequest], count: int, seed: int) -> list[FuzzRequest]:
    """Up to `count` examples of `strategy`, as Hypothesis draws them for `seed` (no shrinking)."""
    drawn: list[FuzzRequest] = []

    @hypothesis_seed(seed)
    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def keep(request: FuzzRequest) -> None:
        drawn.append(request)

    keep()
    return drawn


def draw_category(kind: str, count: int, seed: int, variants: tuple[str, ...]) -> list[FuzzRequest]:
    """`count` requests of one category (Hypothesis may stop a round short: more rounds follow)."""
    drawn: list[FuzzRequest] = []
    for round_seed in range(seed, seed + 100):
        more = draw_round(CATEGORIES[kind](variants), count - len(drawn), round_seed)
        drawn += more
        if len(drawn) >= count or not more:
            break
    return drawn[:count]


def generate(count: int, seed: int, variants: tuple[str, ...],
             kinds: Iterable[str] = KINDS) -> list[FuzzRequest]:
    """`count` requests: the edge grid's share of cells (evenly spaced), then each drawn category's
    `shares` of the rest, all interleaved evenly; the same for the same seed (and Hypothesis
    version). Each category draws from a seed of its own, so `--kinds` alone draws its requests
    as the whole run does (for the same share)."""
    kinds = tuple(kinds)
    grid = spread(edge_grid(variants), shares(count, kinds)[GRID]) if GRID in kinds else []
    drawn_kinds = tuple(k for k in kinds if k != GRID)
    batches = [grid] + [draw_category(kind, share, seed * 1000 + KINDS.index(kind), variants)
                        for kind, share in shares(count - len(grid), drawn_kinds).items()]
    keyed = [((j + 0.5) / len(batch), n, r) for n, batch in enumerate(batches) for j, r in enumerate(batch)]
    return [r for _, _, r in sorted(keyed, key=lambda k: k[:2])][:count]
