"""SpecConfig / SpecPolicy: parsing, validation against an engine, compilation (no Ray, no vLLM)."""

from __future__ import annotations

import pytest

from adaspec.policy import OPEN_END, PolicyError, SpecConfig, SpecPolicy
from adaspec.telemetry import StepRecord, summarize_acceptance


@pytest.mark.parametrize("text,widths,nodes", [
    ("off", (), 0), ("chain1", (1,), 1), ("chain4", (1, 1, 1, 1), 4),
    ("tree4x2x2x1", (4, 2, 2, 1), 4 + 8 + 16 + 16), ("TREE2x2", (2, 2), 6),
])
def test_config_round_trip(text, widths, nodes):
    cfg = SpecConfig.parse(text)
    assert cfg.widths == widths and cfg.num_nodes == nodes
    assert SpecConfig.parse(str(cfg)) == cfg
    assert cfg.depth == len(widths)


def test_equal_configs_compare_and_hash_alike():
    """SpecConfig's own __eq__/__hash__ (fast, for the controller's lookups) against the fields."""
    made = [SpecConfig.off(), SpecConfig.chain(2), SpecConfig.tree((2, 1)), SpecConfig.budget(), SpecConfig.budget(8)]
    validated = [SpecConfig(widths=()), SpecConfig(widths=(1, 1)), SpecConfig(widths=(2, 1)),
                 SpecConfig(per_request=True), SpecConfig(per_request=True, max_nodes=8)]
    for a, b in zip(made, validated):
        assert a == b and hash(a) == hash(b) and a is not b
        assert SpecConfig.parse(str(a)) == a
    for i, a in enumerate(made):  # off and auto both have no widths; budget8 differs from auto only by nodes
        assert [a == b for b in validated] == [i == j for j in range(len(validated))]
    assert {c: i for i, c in enumerate(made)}[SpecConfig(widths=(1, 1))] == 1
    assert SpecConfig.chain(2) is SpecConfig.chain(2)  # shared, as parsed ones are
    assert SpecConfig.off() != "off" and SpecConfig.off() != ()


def test_chain_of_width_one_tree_is_a_chain():
    assert str(SpecConfig.parse("tree1x1x1")) == "chain3"
    assert SpecConfig.parse("chain0").is_off


def test_per_request_budgets_are_configs_of_their_own():
    auto, b16 = SpecConfig.parse("auto"), SpecConfig.parse("BUDGET16")
    assert (auto.per_request, auto.max_nodes, str(auto)) == (True, None, "auto")
    assert (b16.per_request, b16.max_nodes, str(b16)) == (True, 16, "budget16")
    for cfg in (auto, b16):  # neither off nor a chain: nothing may treat them as either
        assert not cfg.is_off and not cfg.is_chain and cfg.widths == ()
        assert SpecConfig.model_validate_json(cfg.model_dump_json()) == cfg
    policy = SpecPolicy.parse("1-2:chain4,3-8:budget16,9+:auto")
    assert [str(policy.config_for(b)) for b in (1, 3, 9)] == ["chain4", "budget16", "auto"]
    assert SpecPolicy.model_validate_json(policy.model_dump_json()) == policy
    with pytest.raises(ValueError, match="no fixed widths"):
        SpecConfig(widths=(1, 1), per_request=True)


def test_per_request_budgets_need_an_engine_that_runs_them():
    with pytest.raises(PolicyError, match="per-request budget.*engine: native"):
        SpecPolicy.parse("1-4:chain2,5+:auto").check_engine(64, 4, supports_trees=True)
    SpecPolicy.parse("1-4:chain2,5+:auto").check_engine(64, 4, supports_trees=True, supports_budgets=True)


@pytest.mark.parametrize("bad", ["", "chain", "chain-1", "tree", "tree2x0", "tree2x", "k4", "chain4 x",
                                 "budget", "budget0", "budget-2", "auto4", "autox"])
def test_bad_configs_are_rejected(bad):
    with pytest.raises(PolicyError):
        SpecConfig.parse(bad)


def test_policy_table_parse_and_lookup():
    policy = SpecPolicy.parse("1-2:chain4,3-8:chain2,9+:off", version=7)
    assert policy.version == 7
    assert [str(policy.config_for(b)) for b in (1, 2, 3, 8, 9, 500)] == \
        ["chain4", "chain4", "chain2", "chain2", "off", "off"]
    assert str(policy) == "1-2:chain4,3-8:chain2,9+:off"
    assert SpecPolicy.parse(str(policy), version=7) == policy
    table = policy.compile(10)
    assert [str(c) for c in table[1:]] == ["chain4"] * 2 + ["chain2"] * 6 + ["off"] * 2
    assert policy.to_vllm_table(32) == [[1, 2, 4], [3, 8, 2], [9, 32, 0]]


def test_bare_config_covers_every_batch_size():
    policy = SpecPolicy.parse("chain3")
    assert policy.rules[0].batch_lo == 1 and policy.rules[0].batch_hi == OPEN_END


@pytest.mark.parametrize("table,needle", [
    ("2-4:chain2,5+:off", "starting at 1"),   # gap at 1
    ("1-4:chain2,4+:off", "starting at 5"),   # overlap
    ("1-4:chain2,6+:off", "starting at 5"),   # gap
    ("4-1:chain2", "empty"),
    ("1-2:chain4;3+:off", "bad"),
    ("1-2:chainX", "chainX"),
])
def test_bad_tables_are_rejected_with_the_reason(table, needle):
    with pytest.raises(PolicyError, match=needle):
        SpecPolicy.parse(table)


def test_engine_check():
    SpecPolicy.parse("1-2:chain4,3+:off").check_engine(max_batch_size=64, max_k=4, supports_trees=False)
    with pytest.raises(PolicyError, match="k <= 4"):
        SpecPolicy.parse("chain5").check_engine(64, 4, False)
    with pytest.raises(PolicyError, match="tree"):
        SpecPolicy.parse("tree2x2").check_engine(64, 4, False)
    SpecPolicy.parse("tree2x2").check_engine(64, 4, True)
    with pytest.raises(PolicyError, match="covers batch sizes up to 8"):
        SpecPolicy.parse("1-8:chain2").check_engine(64, 4, False)


def _step(drafts, drafted, accepted):
    return StepRecord(time=0, duration_s=0.1, batch_size=1, num_decode_reqs=1, scheduled_tokens=5,
                      prefill_tokens=0, context_tokens=10, config=SpecConfig.chain(4), policy_version=0,
                      num_drafts=drafts, drafted_per_pos=drafted, accepted_per_pos=accepted)


def test_acceptance_summary():
    # Two steps: 4 sequences drafted 3 tokens; accepted 3, 2, 1 at positions 0, 1, 2.
    steps = [_step(2, [2, 2, 2], [2, 1, 1]), _step(2, [2, 2, 2], [1, 1, 0])]
    acc = summarize_acceptance(steps)
    assert acc.accepted_per_pos == [3, 2, 1]
    assert acc.conditional_rate_per_pos == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    assert acc.acceptance_rate == pytest.approx(6 / 12)
    assert acc.mean_accepted_length == pytest.approx(1 + 6 / 4)
    assert summarize_acceptance([]).mean_accepted_length == 1.0


def test_parse_keeps_the_replica_a_policy_is_for():
    """A policy for one replica (`adaspec policy set --replica`) stays so, bare config or table."""
    for table in ("off", "1-2:chain4,3+:off"):
        assert SpecPolicy.parse(table, version=3, replica_id="r1").replica_id == "r1"
        assert SpecPolicy.parse(table).replica_id is None
