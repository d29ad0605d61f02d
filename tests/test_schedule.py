"""pipeline/tables.py and schedule.py: every timetable is valid (each cell once, dependencies at earlier ticks),
its ticks, bubbles and in-flight peaks equal the closed forms of the module docstring, and the CLI
prints them, draws them and answers bad input with one error line. Pure Python, no compile."""

import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT
from pipeline.schedule import closed_form, costs, in_flight, weighted
from pipeline.tables import (BACKWARD, FORWARD, IDLE, SCHEDULES, WEIGHT, Op, bubble, cells, needs, one_f_one_b, place,
                             split, timetable, v_shape, with_backward)

CASES = [(schedule, p, m) for schedule in SCHEDULES for p in (2, 4) for m in (p, 2 * p, 4 * p)]
V = 2  # interleaved, interleaved-1f1b


def _table(schedule, p, m):
    return timetable(schedule, p, m, V)


def _v(schedule):
    return V if schedule in ("interleaved", "interleaved-1f1b", "zbv") else 1


def _ticks(table):
    """(kind, m, v, s) -> tick, asserting each appears once."""
    at = {}
    for t, row in enumerate(table):
        for s, op in enumerate(row):
            if op is not None:
                key = (op.kind, op.microbatch, op.chunk, s)
                assert key not in at, f"{key} twice"
                at[key] = t
    return at


@pytest.mark.parametrize("schedule, p, m", CASES)
def test_every_cell_once_after_what_it_needs(schedule, p, m):
    v_count = _v(schedule)
    table = _table(schedule, p, m)
    assert all(len(row) == p for row in table)
    full = with_backward(table)  # gpipe, interleaved: the forward table and its mirror image
    at = _ticks(full)
    kinds = "FBW" if schedule in ("zb-h1", "zbv") else "FB"
    assert set(at) == {(k, i, v, s) for k in kinds for i in range(m) for v in range(v_count) for s in range(p)}
    for (kind, i, v, s), t in at.items():
        if schedule == "zbv":  # the V: chunk 0 down the stages, chunk 1 back up, the loss on stage 0
            before = {("F", 0): [("F", i, 0, s - 1)] if s > 0 else [],
                      ("F", 1): [("F", i, 1, s + 1)] if s < p - 1 else [("F", i, 0, s)],
                      ("B", 1): [("B", i, 1, s - 1)] if s > 0 else [],
                      ("B", 0): [("B", i, 0, s + 1)] if s < p - 1 else [("B", i, 1, s)],
                      }.get((kind, v), [("B", i, v, s)]) + ([("F", i, v, s)] if kind == "B" else [])
        elif kind == "F":
            before = [("F", i, v, s - 1)] if s > 0 else [("F", i, v - 1, p - 1)] if v > 0 else []
        elif kind == "B":
            before = ([("B", i, v, s + 1)] if s < p - 1 else [("B", i, v + 1, 0)] if v < v_count - 1 else [])
            before.append(("F", i, v, s))  # every F before its B
        else:
            before = [("B", i, v, s)]  # every B before its W
        for need in before:
            assert at[need] < t, f"{(kind, i, v, s)} at {t} before {need} at {at[need]}"


@pytest.mark.parametrize("schedule, p, m", CASES)
def test_ticks_and_bubbles_equal_the_closed_forms(schedule, p, m):
    table = _table(schedule, p, m)
    ticks = len(table)
    idle = sum(c is None for row in table for c in row)
    assert bubble(table) == pytest.approx(closed_form(schedule, p, m, V)[1])  # what the CLI prints
    w = weighted(table)
    if schedule == "gpipe":
        assert (ticks, idle) == (m + p - 1, p * (p - 1))
        assert w.time == w.async_time == 3 * (m + p - 1)  # F = 1, mirrored B = 2
        assert w.bubble == w.async_bubble == pytest.approx((p - 1) / (m + p - 1))
    elif schedule == "interleaved":
        assert (ticks, idle) == (V * m + p - 1, p * (p - 1))
        assert w.time == w.async_time == 3 * (V * m + p - 1)
        assert w.bubble == pytest.approx((p - 1) / (V * m + p - 1))
    elif schedule == "1f1b":
        assert (ticks, idle) == (2 * (m + p - 1), 2 * p * (p - 1))  # GPipe's bubble in ticks
        assert w.async_time == 3 * (m + p - 1)
        assert w.time == 4 * m + 3 * p - 4  # lock-step: 2M·B + (p-1)(F+B) - (B-F)
        assert w.bubble == pytest.approx(1 - 3 * m / (4 * m + 3 * p - 4))
        recomputed = weighted(table, costs(recompute=True))
        assert (recomputed.time, recomputed.async_time) == (6 * m + 4 * p - 6, 4 * (m + p - 1))
    elif schedule == "interleaved-1f1b":
        assert (ticks, idle) == (2 * (V * m + p - 1), 2 * p * (p - 1))
        ideal = 3 * V * m  # chunk costs F = 1, B = 2
        assert w.async_time == 3 * (V * m + p - 1)
        assert (w.async_time - ideal) / ideal == pytest.approx((p - 1) / (V * m))  # Narayanan et al.
        assert w.async_bubble == pytest.approx((p - 1) / (V * m + p - 1))
        assert w.time >= w.async_time  # lock-step: no short form, never better
    elif schedule == "zbv":  # half-stage cells, F = B = W = 1: p-1 idle cells per stage as zb-h1,
        assert (ticks, idle) == (6 * m + p - 1, p * (p - 1))  # each half as long: half its idle time
        assert w.time == w.async_time == 6 * m + p - 1
        assert w.bubble == pytest.approx((p - 1) / (6 * m + p - 1)) and w.bubble < weighted(timetable("zb-h1", p, m)).bubble
    else:  # zb-h1: F = B = W = 1
        assert (ticks, idle) == (3 * m + p - 1, p * (p - 1))
        assert w.time == w.async_time == 3 * m + (p - 1) * (1 + 1 - 1)  # M(F+B+W) + (p-1)(F+B-W)
        assert w.bubble == pytest.approx((p - 1) / (3 * m + p - 1))
        one_f = weighted(timetable("1f1b", p, m), {"F": 1, "B": 2, "W": 0}).async_time  # B and W in one cell
        assert one_f - 3 * m == (p - 1) * 3  # 1F1B's bubble: (p-1)(F+B+W)
        heavy = weighted(table, costs(split_backward=True, recompute=True))  # B = 2: still the closed form
        assert heavy.async_time == 4 * m + (p - 1) * (1 + 2 - 1)


@pytest.mark.parametrize("schedule, p, m", CASES)
def test_in_flight_peaks(schedule, p, m):
    table = _table(schedule, p, m)
    peaks = in_flight(table)
    if schedule in ("gpipe", "interleaved"):
        assert peaks == [m * _v(schedule)] * p  # every microbatch's residuals until the backward
    elif schedule == "1f1b":
        assert peaks == [min(p - s, m) for s in range(p)]
    elif schedule == "interleaved-1f1b":  # Megatron's warm-up + 1, in (microbatch, chunk) pairs
        assert peaks == [min(2 * (p - s - 1) + (V - 1) * p + 1, m * V) for s in range(p)]
    elif schedule == "zbv":  # 2p half-stage pairs until W on every stage: zb-h1's p whole ones
        assert peaks == [2 * p] * p
    else:  # zb-h1: until W, p on every stage (1F1B's stage 0); until B, 1F1B's p - s
        assert peaks == [min(p, m)] * p
        assert in_flight(table, until="B") == [min(p - s, m) for s in range(p)]
        assert max(peaks) <= max(in_flight(timetable("1f1b", p, m)))


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zb_h1_below_p_microbatches(p):
    """M < p: no steady state, 2M + 2p - 1 ticks (M = 1: the forward chain, the backward chain, one W)."""
    for m in range(1, p + 1):
        table = timetable("zb-h1", p, m)
        assert len(table) == 2 * m + 2 * p - 1 and in_flight(table) == [m] * p
        assert bubble(table) == pytest.approx(closed_form("zb-h1", p, m)[1])


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 7, 8])
def test_zbv_at_every_m(p):
    """zbv places without deadlock at every M (below p too: no steady state, more ticks), 2p in
    flight at most. Its closed form 6M + p - 1 holds at every M >= p for p = 2, 3, 4, and for
    p = 8 from M = 14; elsewhere the greedy placer takes up to p/2 ticks more (tables.zbv)."""
    for m in range(1, 4 * p):
        table = timetable("zbv", p, m)
        assert max(in_flight(table)) <= 2 * p
        if m >= p:
            extra = len(table) - (6 * m + p - 1)
            assert extra == 0 if p <= 4 or (p == 8 and m >= 14) else 0 <= extra <= p / 2, (m, extra)


def test_zbv_turns_on_the_last_stage_and_ends_its_loss_on_the_first():
    """The V: microbatch 0 goes down on chunk 0, turns on stage p-1 (F0.1 right after F0 there),
    and its first backward (chunk 1, the head and loss) is on stage 0."""
    p, table = 4, timetable("zbv", 4, 8)
    assert v_shape(table) and not v_shape(timetable("interleaved-1f1b", 4, 8, 2))
    last = [str(row[p - 1]) for row in table if row[p - 1] is not None]
    assert last[:2] == ["F0", "F0.1"]
    first_b = next((t, s) for t, row in enumerate(table) for s, op in enumerate(row) if op and op.kind == "B")
    assert first_b[1] == 0 and str(table[first_b[0]][0]) == "B0.1"


def test_zb_h1_last_stage_could_not_hold_fewer():
    """Holding at most p - s until W, the last stage runs F B W back to back: 3M + 2p - 2 ticks,
    1F1B's bubble; ZB-H1's delay of s Ws on stage s buys 3M + p - 1."""
    p, m = 4, 8
    assert len(timetable("zb-h1", p, m)) == 3 * m + p - 1
    last = [row[p - 1] for row in timetable("zb-h1", p, m) if row[p - 1] is not None]
    assert [str(op) for op in last[:6]] == ["F0", "B0", "F1", "B1", "F2", "B2"]


def test_1f1b_family_shares_the_placer_and_cells():
    assert one_f_one_b(4, 8, 1) == timetable("1f1b", 4, 8) == timetable("1f1b", 4, 8, 3)
    assert one_f_one_b(4, 8, 2) == timetable("interleaved-1f1b", 4, 8, 2)
    kind = cells(timetable("zb-h1", 2, 2)).kind
    assert {int(k) for k in kind.flat} == {IDLE, FORWARD, BACKWARD, WEIGHT}
    assert (IDLE, FORWARD, BACKWARD, WEIGHT) == (0, 1, 2, 3)
    assert split(timetable("zb-h1", 2, 2)) and not split(timetable("1f1b", 2, 2))
    assert costs() == {"F": 1, "B": 2, "W": 1, "head": 0.0} and costs(True) == {"F": 1, "B": 1, "W": 1, "head": 0.0}


@pytest.mark.parametrize("schedule, p, m", CASES)
def test_the_head_weighs_on_its_cells(schedule, p, m):
    """The head (forward and backward of the last chunk's output, h forwards): the 1F1B family
    runs it over the stages at its last chunk's B ticks, h/p on every stage at each of M, so
    lock-step time grows by M·h/p, all of it busy (asynchronously it stays in the one stage's B
    cells); gpipe and interleaved run ceil(M/p) heads on every stage between the ticks and the
    backward, M of them real."""
    table, h = _table(schedule, p, m), 0.77
    plain, headed = weighted(table, costs(split(table))), weighted(table, costs(split(table), head=h))
    busy = 3 * m * _v(schedule)  # F + B (+ W) per stage, in chunk costs
    assert plain.time * (1 - plain.bubble) == pytest.approx(busy)
    assert headed.time * (1 - headed.bubble) == pytest.approx(busy + m * h / p)
    if schedule in ("gpipe", "interleaved"):
        dealt = -(-m // p)
        assert headed.time == pytest.approx(plain.time + dealt * h)
        assert headed.async_time == pytest.approx(plain.async_time + dealt * h)
    else:
        assert headed.time == pytest.approx(plain.time + m * h / p)
        assert headed.time - busy - m * h / p == pytest.approx(plain.time - busy)  # the idle time unchanged
        assert plain.async_time + h <= headed.async_time <= plain.async_time + m * h + 1e-9


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "zb-h1", "zbv"])
def test_head_cells_are_the_tick_programs_head_cells(schedule):
    """schedule.head_cell names the cells the tick program gives the head's cotangent
    (pipeline/tick_program.py's Program.head), all on one stage, at M distinct ticks (`heads`)."""
    from pipeline.schedule import head_cell
    from pipeline.tick_program import heads, program

    p, m = 4, 8
    table, prog = _table(schedule, p, m), program(schedule, p, m, V)
    marked = {(t, s) for t, row in enumerate(table) for s, op in enumerate(row)
              if op is not None and head_cell(op, s, p, _v(schedule), v_shape(table))}
    assert len(marked) == m
    assert marked == {(int(t), int(s)) for t, s in zip(*prog.head.nonzero())}
    assert len({s for _, s in marked}) == 1 and heads(prog).sum() == m


@pytest.mark.parametrize("schedule, p, m, v", [
    ("1f1b", 8, 64, 1), ("interleaved-1f1b", 4, 32, 4), ("zb-h1", 8, 64, 1), ("zb-h1", 4, 2, 1)])
def test_placer_runs_each_op_at_the_first_tick_it_can(schedule, p, m, v):
    """place: each op at the tick after the later of its stage's previous op and the cells it needs
    (what stepping tick by tick gives), at shapes beyond the closed-form cases."""
    table = timetable(schedule, p, m, v)
    at = _ticks(table)
    for s in range(p):
        previous = -1
        for t, op in ((t, row[s]) for t, row in enumerate(table) if row[s] is not None):
            assert t == max([previous] + [at[d] for d in needs(op, s, p, v)]) + 1, (op, s, t)
            previous = t


def test_placer_names_op_lists_that_wait_for_one_another():
    missing = r"never placed \[\('B', 0, 0, 1\), \('F', 0, 0, 0\)\]"  # (kind, m, v, stage)
    with pytest.raises(ValueError, match=r"deadlock: \[Op\(kind='B', microbatch=0.*" + missing):
        # stage 0's B0 waits for stage 1's B0, which follows 1's F0, which waits for 0's F0, after its B0
        place([[Op("B", 0), Op("F", 0)], [Op("F", 0), Op("B", 0)]])


@pytest.mark.parametrize("args, message", [
    (("interleaved-1f1b", 4, 6, 2), "divisible by stages"),
    (("interleaved-1f1b", 4, 8, 1), "virtual stages >= 2"),
    (("interleaved", 4, 6, 2), "divisible by stages"),
    (("1f1b", 0, 4), "must be >= 1"),
    (("zb-h1", 2, 0), "must be >= 1"),
    (("pipedream", 2, 2), "unknown schedule"),
])
def test_bad_input_raises(args, message):
    with pytest.raises(ValueError, match=message):
        timetable(*args)


def _cli(*args, code=None):
    argv = ["-c", code, *args] if code else ["-m", "pipeline.schedule", *args]
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_cli_prints_the_table_and_its_figures():
    out = _cli("--schedule", "zb-h1", "--stages", "4", "--microbatches", "8")
    assert out.returncode == 0, out.stderr
    assert "   4   .  .  . B0\n   5   .  . B0 F1\n" in out.stdout  # the table
    assert ("zb-h1: 27 ticks, bubble 0.1111 (3 idle ticks per stage); weighted (F=1 B=1 W=1) lock-step 0.1111, "
            "asynchronous 0.1111; closed form (p-1)/(3M+p-1) = 0.1111; in flight [4, 4, 4, 4]") in out.stdout
    out = _cli("--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--recompute")
    assert "weighted (F=1 B=3) lock-step 0.4483, asynchronous 0.2727" in out.stdout  # 1 - 8·4/(6·8+4·4-6)
    out = _cli("--schedule", "1f1b", "--stages", "4", "--microbatches", "8", "--head", "0.77")
    assert "weighted (F=1 B=2 head=0.77) lock-step 0.3852" in out.stdout  # 1 - (24 + 8·0.77/4)/(40 + 8·0.77/4)


def test_cli_compares_every_schedule():
    out = _cli("--schedule", "all", "--stages", "4", "--microbatches", "8", "--virtual-stages", "2")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "p=4 M=8 V=2"
    assert [line.split(":")[0] for line in lines[1:]] == list(SCHEDULES)
    assert "interleaved-1f1b: 38 ticks, bubble 0.1579" in out.stdout
    out = _cli("--schedule", "all", "--stages", "4", "--microbatches", "6")
    assert out.returncode == 0 and "interleaved-1f1b: n/a (" in out.stdout and "zb-h1: 21 ticks" in out.stdout


def test_cli_draws_a_png(tmp_path):
    path = tmp_path / "new" / "zb.png"  # its folder made
    out = _cli("--schedule", "interleaved-1f1b", "--stages", "2", "--microbatches", "4", "--png", str(path))
    assert out.returncode == 0, out.stderr
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--schedule", "interleaved", "--stages", "4", "--microbatches", "6"], "divisible by --stages (4)"),
    (["--schedule", "interleaved-1f1b", "--stages", "4", "--microbatches", "6"], "divisible by stages (4)"),
    (["--schedule", "interleaved-1f1b", "--virtual-stages", "1"], "needs virtual stages >= 2"),
    (["--stages", "0"], "must be >= 1"),
    (["--microbatches", "-1"], "must be >= 1"),
    (["--schedule", "pipedream"], "invalid choice"),
    (["--head", "-1"], "--head -1.0: the head's cost is a finite number of chunk forwards >= 0"),
    (["--head", "nan"], "--head nan:"),
    (["--schedule", "all", "--png", "x.png"], "draws one schedule"),
    (["--schedule", "1f1b", "--png", "x.txt"], "x.txt is not a .png name; name the picture to write, e.g. x.png"),
    (["--schedule", "1f1b", "--png", "timetable"], "e.g. timetable.png"),  # matplotlib would write timetable.png
    (["--schedule", "1f1b", "--png", "pyproject.toml/x.png"], "--png pyproject.toml/x.png: cannot make its folder"),
])
def test_cli_bad_input_is_one_error_line(args, message):
    out = _cli(*args)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: ") and message in out.stderr, out.stderr


def test_cli_png_without_matplotlib(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None; from pipeline.schedule import main; "
            f"sys.exit(main(['--schedule', '1f1b', '--stages', '2', '--microbatches', '2', '--png', "
            f"{str(tmp_path / 'x.png')!r}]))")
    out = _cli(code=code)
    assert out.returncode == 2
    assert out.stderr == "error: --png needs matplotlib: pip install 'meshtrain[profile]'\n"
    assert not (tmp_path / "x.png").exists()


def test_cell_shares_count_each_cell_on_its_own_stage():
    """The census's shares of a cell per device (pipeline.tick_program.cell_shares): pp=2,tp=2 1f1b
    at M = 4, 10 ticks: both stages run 4 F and 4 B; no W; every device the head over the
    stages at stage 1's 4 B ticks and the embedding's backward at stage 0's. zb-h1 adds M Ws on
    every stage."""
    from pipeline.tick_program import SCOPE, cell_shares, program

    shares = cell_shares(program("1f1b", 2, 4), {"stage": 2, "tensor": 2})
    assert shares[SCOPE + "F"] == dict.fromkeys(range(4), 0.4)
    assert shares[SCOPE + "B"] == dict.fromkeys(range(4), 0.4)
    assert shares[SCOPE + "head"] == dict.fromkeys(range(4), 0.4)
    assert shares[SCOPE + "W"] == dict.fromkeys(range(4), 0.0)
    assert shares[SCOPE + "embed_back"] == dict.fromkeys(range(4), 0.4)  # stage 0's B ticks, on every device
    split = cell_shares(program("zb-h1", 2, 4), {"data": 1, "stage": 2})  # 13 ticks; stage the second axis
    assert split[SCOPE + "W"] == dict.fromkeys(range(2), 4 / 13)
    assert split[SCOPE + "embed_back"] == dict.fromkeys(range(2), 4 / 13)
    assert shares[SCOPE + "permute_down"] == shares[SCOPE + "permute_up"] == dict.fromkeys(range(4), 0.4)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "zb-h1", "zbv"])
def test_the_permutes_run_at_the_ticks_some_stage_receives_by_them(schedule):
    """pipeline.tick_program.moves (from the table, as tools.traffic reads it) and the program's
    `moving`: a permute runs at a tick exactly when some stage has an arrival slot of it. At p =
    2 without a ring that is M ticks each way (one forward and one gradient per microbatch cross
    the one boundary; zbv: 2M, both chunks' values cross it); at p = 4 the warm-up and
    cool-down ticks skip one way."""
    from pipeline.tick_program import moves, program

    for p, m in ((2, 4), (4, 8)):
        prog = program(schedule, p, m, _v(schedule))
        runs = moves(timetable(schedule, p, m, _v(schedule)))
        for way in ("down", "up"):
            slots = np.stack([getattr(prog, f"{way}_input"), getattr(prog, f"{way}_grad")])
            assert (runs[way] == (slots >= 0).any(axis=(0, 2))).all() and (prog.moving[way] == runs[way]).all()
        ticks = len(prog.branch)
        if p == 2 and schedule != "interleaved-1f1b":
            per = 2 * m if schedule == "zbv" else m
            assert (runs["down"].sum(), runs["up"].sum()) == (per, per) and ticks > per
        else:
            assert 0 < runs["down"].sum() < ticks and 0 < runs["up"].sum() < ticks


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "zb-h1", "zbv"])
def test_the_embedding_backward_runs_at_stage_0s_first_chunk_b_ticks(schedule):
    """pipeline.tick_program.embeds_back: M ticks, one per microbatch, each the tick whose stage
    0 runs the B of the model's first chunk (v = 0) for that microbatch, never that of another
    chunk (interleaved-1f1b's and zbv's stage 0 hold two)."""
    from pipeline.tables import BACKWARD
    from pipeline.tick_program import embeds_back, program

    p, m = 4, 8
    prog = program(schedule, p, m, _v(schedule))
    ticks = embeds_back(prog).nonzero()[0]
    assert len(ticks) == m and sorted(prog.microbatch[ticks, 0]) == list(range(m))
    assert (prog.branch[ticks, 0] == BACKWARD).all() and (prog.chunk[ticks, 0] == 0).all()
    others = (prog.branch[:, 0] == BACKWARD) & ~embeds_back(prog)
    # interleaved-1f1b's and zbv's stage 0 run chunk 1's B too (zbv's the last chunk's, the head's cotangent)
    assert (prog.chunk[others, 0] != 0).all() and others.any() == (schedule in ("interleaved-1f1b", "zbv"))
    assert prog.head[others, 0].any() == (schedule == "zbv")
