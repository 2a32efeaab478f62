"""Schedules, validator, simulator and renderer: the explainer's tables, closed-form bubbles."""

import pytest

from par_pp import Action, Costs, chunk_ranks, ScheduleError, build_schedule, chunks_on_rank, parse_costs, render_timeline, simulate, split_layers, split_stages, stage_layer_counts, timeline_json, validate_schedule
from par_pp.ir import make_schedule

EXPLAINER_GPIPE_P4_M4 = """\
Time:   00 01 02 03 04 05 06 07 08 09 10 11 12 13
GPU 0:  F0 F1 F2 F3 .. .. .. .. .. .. B3 B2 B1 B0
GPU 1:  .. F0 F1 F2 F3 .. .. .. .. B3 B2 B1 B0 ..
GPU 2:  .. .. F0 F1 F2 F3 .. .. B3 B2 B1 B0 .. ..
GPU 3:  .. .. .. F0 F1 F2 F3 B3 B2 B1 B0 .. .. .."""

EXPLAINER_1F1B_P4_M1 = """\
Time:   00 01 02 03 04 05 06 07
GPU 0:  F0 .. .. .. .. .. .. B0
GPU 1:  .. F0 .. .. .. .. B0 ..
GPU 2:  .. .. F0 .. .. B0 .. ..
GPU 3:  .. .. .. F0 B0 .. .. .."""

EXPLAINER_1F1B_P4_M7 = """\
Time:   00 01 02 03 04 05 06 07 08 09 10 11 12 13 14 15 16 17 18 19
GPU 0:  F0 F1 F2 F3 .. .. .. B0 F4 B1 F5 B2 F6 B3 .. B4 .. B5 .. B6
GPU 1:  .. F0 F1 F2 .. .. B0 F3 B1 F4 B2 F5 B3 F6 B4 .. B5 .. B6 ..
GPU 2:  .. .. F0 F1 .. B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 .. B6 .. ..
GPU 3:  .. .. .. F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 .. .. .."""

ALL = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zb-h1", 1), ("zb-v", 2), ("dualpipev", 2)]
SPLIT_COSTS = Costs(f=1, b=1, w=1, full_backward=None)  # F = B = W, a full backward is B + W


@pytest.mark.parametrize(
    "name,pp,m,expected",
    [("gpipe", 4, 4, EXPLAINER_GPIPE_P4_M4), ("1f1b", 4, 1, EXPLAINER_1F1B_P4_M1), ("1f1b", 4, 7, EXPLAINER_1F1B_P4_M7)],
)
def test_explainer_tables_reproduced_character_for_character(name, pp, m, expected):
    assert render_timeline(simulate(build_schedule(name, pp, m))) == expected


@pytest.mark.parametrize("name,vpp", ALL)
def test_every_generated_schedule_validates(name, vpp):
    for pp in (1, 2, 3, 4, 8):
        for m in range(1, 3 * pp + 2):
            s = build_schedule(name, pp, m, vpp)  # build_schedule validates
            splits = sum(a.split for row in s.ranks for a in row)
            assert s.num_chunks == pp * s.vpp
            assert sum(map(len, s.ranks)) == 2 * m * s.num_chunks + splits
            assert s.has_split_backward == (name in ("zb-h1", "zb-v", "dualpipev") and (name != "dualpipev" or splits > 0))


def test_validator_rejects_backward_before_forward_and_deadlocks():
    ok = build_schedule("1f1b", 2, 2)
    swapped = [list(ok.ranks[0]), list(ok.ranks[1])]
    swapped[1][0], swapped[1][1] = swapped[1][1], swapped[1][0]  # B0 before F0 on the last rank
    with pytest.raises(ScheduleError, match="before"):
        validate_schedule(make_schedule("bad", 2, 2, ok.chunk_ranks, swapped))
    # Rank 0 wants B0 before sending F1, rank 1 wants F1 before sending B0: a cross-rank deadlock.
    r0 = [Action("F", 0, 0), Action("B", 0, 0), Action("F", 1, 0), Action("B", 1, 0)]
    r1 = [Action("F", 0, 1), Action("F", 1, 1), Action("B", 1, 1), Action("B", 0, 1)]
    with pytest.raises(ScheduleError, match="deadlock"):
        validate_schedule(make_schedule("dead", 2, 2, ok.chunk_ranks, [r0, r1]))
    with pytest.raises(ScheduleError, match="appears 0 times"):
        validate_schedule(make_schedule("short", 2, 2, ok.chunk_ranks, [r0[:3], r1]))


@pytest.mark.parametrize("pp", [2, 4, 8])
@pytest.mark.parametrize("m", [1, 4, 7, 16])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(pp, m):
    closed = (pp - 1) / (m + pp - 1)
    for name in ("gpipe", "1f1b"):
        r = simulate(build_schedule(name, pp, m))
        assert r.bubble_fractions == pytest.approx([closed] * pp)
        r = simulate(build_schedule(name, pp, m), SPLIT_COSTS)  # any F:B ratio, same fraction
        assert r.bubble_fraction == pytest.approx(closed)
    assert simulate(build_schedule("gpipe", pp, m)).peak_activations == (m,) * pp
    assert simulate(build_schedule("1f1b", pp, m)).peak_activations == tuple(min(pp - r, m) for r in range(pp))


@pytest.mark.parametrize("pp", [2, 4, 8])
@pytest.mark.parametrize("v", [2, 4])
def test_interleaved_bubble_time_is_one_vth_of_1f1b(pp, v):
    for m in (pp, 2 * pp, 4 * pp):
        # Per-chunk costs 1/v of a stage: the same model, so bubble time compares directly.
        chunk_costs = Costs(f=1 / v, full_backward=2 / v)
        inter = simulate(build_schedule("interleaved", pp, m, v), chunk_costs)
        base = simulate(build_schedule("1f1b", pp, m), Costs(f=1, full_backward=2))
        assert inter.idle_time(0) == pytest.approx(base.idle_time(0) / v)
        assert inter.bubble_fraction == pytest.approx((pp - 1) / (v * m + pp - 1))


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_zb_h1_bubble_time_is_a_third_of_1f1b_with_same_memory(pp):
    for m in (pp, 2 * pp + 1, 4 * pp):
        zb = simulate(build_schedule("zb-h1", pp, m), SPLIT_COSTS)
        base = simulate(build_schedule("1f1b", pp, m), SPLIT_COSTS)
        assert base.idle_time(0) == pytest.approx(3 * (pp - 1))  # (p-1)(F+B+W)
        for r in range(pp):
            assert zb.idle_time(r) == pytest.approx(base.idle_time(r) / 3)  # (p-1)(F+B-W)
        assert zb.peak_activations == base.peak_activations


@pytest.mark.parametrize("pp", [2, 4, 8])
def test_zb_v_bubble_near_zero_from_2p_microbatches(pp):
    for m in (2 * pp, 2 * pp + 1, 4 * pp):
        r = simulate(build_schedule("zb-v", pp, m), SPLIT_COSTS)
        # Only the unavoidable ramp is idle: the last rank cannot start before p-1 chunk forwards.
        assert max(r.idle_time(k) for k in range(pp)) <= (pp - 1) + 1e-9
        assert r.bubble_fraction <= (pp - 1) / (6 * m + pp - 1) + 1e-9
        assert max(r.peak_activations) <= 2 * pp  # 1F1B's memory: 2p half-size chunks


@pytest.mark.parametrize("pp", [2, 4, 8])
@pytest.mark.parametrize("costs", [SPLIT_COSTS, Costs(f=2, b=2, w=1, full_backward=None), Costs(f=1, b=2, w=1, full_backward=None)])
def test_dualpipev_bubble_within_published_bound(pp, costs):
    stages = 2 * pp  # PP in the DualPipe paper counts stages, two per rank here
    f, b_full, w = costs.f, costs.b + costs.w, costs.w
    fb = f + b_full  # F&B run back to back here, no overlap
    bound = (stages / 2 - 1) * (fb + b_full - 3 * w)
    for m in (2 * pp, 2 * pp + 1, 4 * pp):
        r = simulate(build_schedule("dualpipev", pp, m), costs)
        assert max(r.idle_time(k) for k in range(pp)) <= bound + 1e-9


def test_invalid_combinations_name_the_values():
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'"):
        build_schedule("pipedream", 4, 8)
    with pytest.raises(ValueError, match="interleaved needs vpp >= 2"):
        build_schedule("interleaved", 4, 8, 1)
    with pytest.raises(ValueError, match="1f1b runs one chunk per rank"):
        build_schedule("1f1b", 4, 8, 2)
    with pytest.raises(ValueError, match="always places 2 chunks"):
        build_schedule("zb-v", 4, 8, 3)
    with pytest.raises(ValueError, match="microbatches=0"):
        build_schedule("gpipe", 4, 0)


def test_chunk_ranks_match_the_explainer():
    # PP=4, VPP=2: GPU 0 holds chunks {0, 4}, GPU 3 holds {3, 7}; V shapes hold r and 2p-1-r.
    assert [chunks_on_rank("interleaved", r, 4, 2) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [chunks_on_rank("zb-v", r, 4) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert chunks_on_rank("dualpipev", 1, 4, 2) == [1, 6]
    assert chunks_on_rank(build_schedule("1f1b", 4, 4), 2) == [2]
    ranges = split_layers(32, 8)
    assert [(r.start, r.stop - 1) for r in ranges[:5]] == [(0, 3), (4, 7), (8, 11), (12, 15), (16, 19)]
    assert [len(r) for r in split_layers(10, 4)] == [3, 3, 2, 2]
    with pytest.raises(ValueError, match="num_layers=3 cannot fill num_chunks=4"):
        split_layers(3, 4)


def test_uneven_end_stages_in_every_chunk_layout():
    # Llama-3-405B over 16 stages (7 | 8 x 14 | 7); DeepSeek-V3's 61 layers with a light first stage
    assert stage_layer_counts(126, 16, 1, 7, 7) == [7] + [8] * 14 + [7]
    assert stage_layer_counts(61, 16, 1, 1) == [1] + [4] * 15
    assert split_stages(10, chunk_ranks("1f1b", 4)) == split_layers(10, 4)  # 0 = even, as before

    def sizes(layers, name, pp, vpp, first, last):
        return [len(r) for r in split_stages(layers, chunk_ranks(name, pp, vpp), first, last)]

    assert sizes(10, "gpipe", 4, 1, 1, 3) == [1, 3, 3, 3]
    # vpp 2 on 4 ranks: rank 0 holds chunks 0 and 4, each with half of its 2 layers
    assert sizes(12, "interleaved", 4, 2, 2, 2) == [1, 2, 2, 1, 1, 2, 2, 1]
    # V: rank 0 holds chunks 0 and 5 (both ends), rank 2 the bottom of the V (chunks 2 and 3)
    assert sizes(12, "zb-v", 3, 1, 2, 6) == [1, 2, 3, 3, 2, 1]
    ranges = split_stages(12, chunk_ranks("dualpipev", 3), 2, 6)
    assert [r.start for r in ranges] == [0, 1, 3, 6, 9, 11] and ranges[-1].stop == 12
    for bad, match in [((10, "1f1b", 2, 3, 4), "must add up to num_layers at pp=2, they add up to 7"),
                       ((10, "1f1b", 4, 3, 0), "the other 3 stages get 7 layers"),
                       ((12, "zb-v", 3, 3, 5), "3 layers on stage 0 do not split evenly into its 2 chunks"),
                       ((4, "1f1b", 4, 0, 2), "must split evenly into 3 stages x 1 chunks of at least one layer"),
                       ((5, "zb-v", 3, 1, 0), "1 layer on stage 0 does not split evenly"),  # counts in the singular
                       ((7, "zb-v", 2, 2, 0), "the other 1 stage gets 5 layers")]:
        layers, name, pp, first, last = bad
        with pytest.raises(ValueError, match=match):
            split_stages(layers, chunk_ranks(name, pp), first, last)


def test_costs_parse_and_render_multi_slot_actions_and_p2p():
    assert parse_costs("") == Costs()
    assert parse_costs("f=1,b=1,w=1").duration(Action("B", 0, 0)) == 2  # full B = b + w
    assert parse_costs("f=1,b=2,full=3,p2p=0.5") == Costs(1, 2, 1, 3, 0.5)
    with pytest.raises(ValueError, match="keys f, b, w, full, p2p"):
        parse_costs("x=1")
    text = render_timeline(simulate(build_schedule("1f1b", 2, 2), parse_costs("f=1,b=2,w=0")))
    assert text.splitlines()[1] == "GPU 0:  F0 F1 .. .. B0 B0 .. B1 B1"
    r = simulate(build_schedule("1f1b", 2, 1), Costs(p2p=0.5))
    assert r.makespan == 5 and render_timeline(r).splitlines()[2].startswith("GPU 1:  .. .. .. F0 F0 B0 B0")


def test_json_has_the_issue_fields_and_two_chunk_cells_use_case():
    r = simulate(build_schedule("zb-v", 2, 4), SPLIT_COSTS)
    out = timeline_json(r)
    assert {"makespan", "bubble_fraction", "peak_activations", "ranks"} <= set(out)
    assert out["ranks"][0][0] == {"type": "F", "microbatch": 0, "chunk": 0, "split": False, "start": 0, "end": 1}
    row0 = render_timeline(r).splitlines()[1]
    assert "f0" in row0 and "F0" in row0  # rank 0's second chunk (chunk 3) is lower case
