"""The draft plan: a SpecConfig's shape, menu and scratch, worked out once."""

from __future__ import annotations

from specserve.config import SpecConfig
from specserve.draft_plan import DraftPlan, shape_menu
from specserve.tree import DraftShape
from specserve_kernels import MAX_NODES


def test_an_unset_shape_is_adaptive_over_the_menu():
    plan = DraftPlan.of(SpecConfig(algorithm="eagle"))
    assert plan.spec == SpecConfig(algorithm="eagle").resolved()
    assert plan.shape == DraftShape(8, 5, 4) and not plan.pinned
    assert plan.menu == shape_menu(5, 4, 8) and plan.menu[-1] == plan.shape
    assert plan.scratch == (5 - 1) * 4 == plan.shape.scratch
    assert plan.tree_sizes == (1, 2, 3, 4, 6, 8)
    assert plan.max_nodes == MAX_NODES


def test_a_set_knob_or_adaptive_off_pins_the_configured_shape():
    for spec in (SpecConfig(algorithm="eagle", topk=2), SpecConfig(algorithm="ngram", adaptive=False)):
        plan = DraftPlan.of(spec)
        assert plan.pinned and plan.menu == (plan.shape,)
    assert DraftPlan.of(SpecConfig(algorithm="ngram", num_draft_tokens=6)).shape == DraftShape(6, 5, 1)


def test_plain_decoding_is_the_root_alone():
    plan = DraftPlan.of(SpecConfig(algorithm="none"))
    assert plan.menu == (DraftShape(1, 0, 1),) and not plan.shape.drafts
    assert plan.scratch == 0 and plan.tree_sizes == (1,)
