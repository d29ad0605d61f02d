"""training/checkpoint.py in-process: resharding restores, damaged checkpoints, model mismatch, NaN
steps, the logged step time around a save."""

import time

import jax
import numpy as np
import pytest

from configs import ConfigError
from conftest import small_config
from sharding.mesh import build_mesh
from training.build import make_program, build
from training.checkpoint import Checkpointer
from training.loop import TrainingStopped, train

PAIRS = [("dp=2,fsdp=2,tp=2", "fsdp=8"), ("dp=2,fsdp=2,tp=2", "dp=4,tp=2"), ("fsdp=8", "dp=2,tp=4")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, corpus):
    """{source mesh: (checkpoint dir, host state after step 2)}; checkpoints at steps 1 and 2."""
    out = {}
    for spec in sorted({src for src, _ in PAIRS}):
        directory = tmp_path_factory.mktemp("ckpt")
        cfg = small_config(spec)
        checkpoints = Checkpointer(directory, cfg)
        job = build(cfg, build_mesh(cfg.parallel), corpus=corpus)
        state, hosts = job.state, []
        with jax.set_mesh(job.mesh):
            for step in range(2):
                state, _ = job.step_fn(state, job.batches(step))
                checkpoints.save(step + 1, state)
                hosts.append(jax.device_get(state))
        checkpoints.wait()
        checkpoints.close()
        out[spec] = directory, hosts
    return out


def restore(directory, cfg, read_only=False):
    program = make_program(cfg, build_mesh(cfg.parallel))
    checkpoints = Checkpointer(directory, cfg, read_only=read_only)
    try:
        return program, checkpoints.restore_latest(program)
    finally:
        checkpoints.close()


@pytest.mark.parametrize("source, target", PAIRS)
def test_restore_onto_another_mesh(source, target, saved, tmp_path):
    directory, hosts = saved[source]
    program, state = restore(directory, small_config(target))
    assert int(state.step) == 2
    leaves, shardings = jax.tree.leaves(state), jax.tree.leaves(program.shardings)
    assert len(leaves) == len(jax.tree.leaves(hosts[-1])) == len(shardings)
    for got, want, sharding in zip(leaves, jax.tree.leaves(hosts[-1]), shardings):
        assert got.sharding == sharding  # arrives in the new mesh's layout, not gathered
        np.testing.assert_array_equal(np.asarray(got), want)
    assert any(s.spec != jax.sharding.PartitionSpec() for s in shardings)


def test_a_save_in_one_process_compiles_no_replica_slices(tmp_path):
    """dp=8 replicates every array over 8 devices of this one process: the save writes each
    shard whole from one replica (training.checkpoint.whole_shard_saves), so it compiles no
    slice. orbax's replica-parallel default cut each replica's part out with an eagerly
    compiled slice: 72 `jit(slice)` compiles for this state (41 arrays) beside the checksums'.
    (A slice compiles in milliseconds, under the tests' 0.5 s floor for the persistent cache,
    so none can come from it unseen.)"""
    cfg = small_config("dp=8")
    mesh = build_mesh(cfg.parallel)
    program = make_program(cfg, mesh)
    with jax.set_mesh(mesh):
        state = program.init_fn()
    checkpoints = Checkpointer(tmp_path, cfg)
    compiled = []
    count = lambda event, seconds, fun_name="", **kwargs: compiled.append(fun_name) if event.endswith(  # noqa: E731
        "backend_compile_duration") else None
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        with jax.set_mesh(mesh):
            checkpoints.save(1, state)
            checkpoints.wait()
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
        checkpoints.close()
    assert not [name for name in compiled if "slice" in name], compiled
    assert (tmp_path / "1" / "state").is_dir()


def test_damaged_checkpoint_falls_back_to_the_previous(saved, tmp_path, capsys):
    import shutil

    directory = tmp_path / "checkpoints"
    shutil.copytree(saved["fsdp=8"][0], directory)
    flip_a_bit(directory / "2")
    _, state = restore(directory, small_config("fsdp=8"))
    out = capsys.readouterr().out
    assert "checkpoint" in out and "is damaged (DamagedCheckpoint: checksum mismatch" in out
    assert f"resumed from {directory.resolve() / '1'} (step 1)" in out
    assert int(state.step) == 1 and (directory / "2.damaged").is_dir() and not (directory / "2").exists()
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(saved["fsdp=8"][1][0])):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_unreadable_arrays_are_one_short_line(saved, tmp_path, capsys):
    """Every array file of step 2 cut short: tensorstore's read fails (not the checksum). The
    fall-back says so in one line without tensorstore's spec, and the reads orbax abandons print
    nothing (quiet_abandoned_reads)."""
    import shutil

    directory = tmp_path / "checkpoints"
    shutil.copytree(saved["fsdp=8"][0], directory)
    for data in (directory / "2" / "state" / "ocdbt.process_0" / "d").iterdir():  # the arrays' bytes
        data.write_bytes(data.read_bytes()[:10])
    _, state = restore(directory, small_config("fsdp=8"))
    out, err = capsys.readouterr()
    damaged = [line for line in out.splitlines() if "is damaged" in line]
    assert len(damaged) == 1 and "Encountered error while reading array index" in damaged[0], out
    assert "TensorStore" not in out and len(damaged[0]) < 400, damaged[0]
    assert int(state.step) == 1 and (directory / "2.damaged").is_dir()
    assert "Traceback" not in err and "Exception ignored" not in err, err[-2000:]


def test_the_quieted_noise_is_only_the_abandoned_reads():
    """After quiet_abandoned_reads (a fresh process: pytest swaps sys.unraisablehook per test): a
    dropped coroutine's exception, the closed loop's and asyncio's never-retrieved message are
    silent; an object's failing __del__ and other asyncio errors still print."""
    import subprocess
    import sys

    script = """if True:
        import gc, logging
        from training.checkpoint import quiet_abandoned_reads

        class Suspend:
            def __await__(self):
                yield

        async def read(error):
            try:
                await Suspend()
            finally:
                raise error

        class Leaky:
            def __del__(self):
                raise ValueError("a real __del__ bug")

        quiet_abandoned_reads()
        for error in (Exception("Encountered error while reading array index"), RuntimeError("Event loop is closed")):
            coroutine = read(error)
            coroutine.send(None)
            del coroutine
        Leaky()
        gc.collect()
        logging.getLogger("asyncio").error("Task exception was never retrieved")
        logging.getLogger("asyncio").error("another asyncio error")
    """
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "a real __del__ bug" in out.stderr and "another asyncio error" in out.stderr
    assert "reading array index" not in out.stderr and "Event loop is closed" not in out.stderr
    assert "never retrieved" not in out.stderr


def test_a_resume_on_another_stream_says_so(saved, tmp_path, capsys):
    """data.source and the global batch changed at a resume: allowed (fine-tuning on other data),
    said in one note naming both, the checkpoint's values and the new."""
    import shutil

    directory = tmp_path / "checkpoints"
    shutil.copytree(saved["fsdp=8"][0], directory)
    cfg = small_config("fsdp=8", "data.source=synthetic", "train.global_batch_size=32")
    _, state = restore(directory, cfg)
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    assert int(state.step) == 2 and notes == [
        f"note: data.source='stdlib' in the checkpoint, 'synthetic' now; train.global_batch_size="
        f"{small_config().train.global_batch_size} in the checkpoint, 32 now: from step 2 on the batches are another "
        "stream, not the saved run's continuation (as intended when fine-tuning on other data; else resume without "
        "the --set)"]
    _, state = restore(directory, small_config("fsdp=8"))
    assert "note: " not in capsys.readouterr().out


def flip_a_bit(step_dir):
    """One bit flipped in a saved parameter's value, written back through tensorstore into the
    step's OCDBT store, so that every file stays readable: orbax alone restores it silently.
    (Flipping a byte of a data file instead lands in zstd-compressed chunks, which tensorstore
    may or may not refuse, depending on which chunk the byte falls in.)"""
    import tensorstore as ts

    spec = {"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{step_dir / 'state'}/"},
            "path": "params.blocks.attn.wq.value/"}
    array = ts.open(spec).result()
    value = np.asarray(array[(0,) * array.ndim].read().result(), np.float32)
    array[(0,) * array.ndim].write((value.view(np.uint32) ^ 0x40).view(np.float32)).result()


def test_a_reader_leaves_the_run_as_it_is(saved, tmp_path, capsys, caplog):
    """read_only (--eval-only, tools.generate, possibly beside a training run): a save in flight
    is neither read nor removed, a damaged step is skipped but not moved."""
    import shutil

    directory = tmp_path / "checkpoints"
    shutil.copytree(saved["fsdp=8"][0], directory)
    flip_a_bit(directory / "2")
    (directory / "3.orbax-checkpoint-tmp").mkdir()
    _, state = restore(directory, small_config("fsdp=8"), read_only=True)
    out = capsys.readouterr().out
    assert int(state.step) == 1 and "is damaged (DamagedCheckpoint: checksum mismatch" in out and "left in place" in out
    assert "3.orbax-checkpoint-tmp was cut off mid-write, or is still being written (never committed): not read" in out
    assert sorted(p.name for p in directory.iterdir()) == ["1", "2", "3.orbax-checkpoint-tmp"]
    assert "Given directory is read only" not in caplog.text  # orbax's warning of what a reader asked for


def test_no_restorable_checkpoint_is_an_error_not_a_fresh_start(saved, tmp_path):
    """Every step damaged: an error (training from step 0 beside them would hide it), each step
    set aside, beside an earlier `.damaged` of the same step rather than over it; the next
    attempt, which sees only those, is the same error."""
    import shutil

    directory = tmp_path / "checkpoints"
    shutil.copytree(saved["fsdp=8"][0], directory)
    (directory / "2.damaged").mkdir()
    for step in ("1", "2"):
        flip_a_bit(directory / step)
    with pytest.raises(ConfigError, match=r"none of the 2 checkpoint\(s\) in .* restores .*put back a good copy"):
        restore(directory, small_config("fsdp=8"))
    assert sorted(p.name for p in directory.iterdir()) == ["1.damaged", "2.damaged", "2.damaged-2"]
    with pytest.raises(ConfigError, match=r"holds only damaged checkpoints \(1.damaged, 2.damaged, 2.damaged-2\), "
                                          "set aside by an earlier resume; put back a good copy"):
        restore(directory, small_config("fsdp=8"))  # the next attempt


def test_checkpoint_of_another_model_is_refused(saved):
    cfg = small_config("fsdp=8", "model.d_model=32", "model.n_layers=3", "model.remat=full")
    with pytest.raises(ConfigError) as e:
        restore(saved["fsdp=8"][0], cfg)
    message = str(e.value)
    assert "model.d_model=64 in the checkpoint, 32 now" in message
    assert "model.n_layers=2 in the checkpoint, 3 now" in message
    assert "remat" not in message  # changes the computation, not the saved state


def test_nan_step_is_skipped_and_repeated_nans_stop(corpus, tmp_path, monkeypatch, capsys):
    cfg = small_config("", "train.log_every=1", "train.max_bad_steps=2", "train.checkpoint_every=1")
    mesh = build_mesh(cfg.parallel, jax.devices()[:1])
    monkeypatch.setenv("MESHTRAIN_TEST_NAN_STEPS", "2")  # the batch of step index 2 (logged as step 3)
    job = build(cfg, mesh, corpus=corpus)
    (tmp_path / "one").mkdir()
    records = {r["step"]: r for r in train(job, tmp_path / "one")}
    assert np.isnan(records[3]["loss"]) and records[3]["skipped"] == 1 and records[3]["bad_steps"] == 1
    assert np.isfinite(records[4]["loss"]) and records[4]["bad_steps"] == 0 and records[5]["skipped"] == 1
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(job.state.params))

    monkeypatch.setenv("MESHTRAIN_TEST_NAN_STEPS", "2,3")
    (tmp_path / "two").mkdir()
    checkpoints = Checkpointer(tmp_path / "two" / "checkpoints", cfg)
    job = build(cfg, mesh, corpus=corpus)
    with pytest.raises(TrainingStopped, match="step 4: 2 non-finite steps in a row") as e:
        train(job, tmp_path / "two", checkpoints)
    assert checkpoints.latest() == 3 and str(checkpoints.path(3)) in str(e.value)
    state = checkpoints.restore_latest(make_program(cfg, mesh))
    checkpoints.close()
    assert int(state.bad_steps) == 1 and int(state.skipped) == 1  # step 4's failed update never saved
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))


def test_the_logged_step_time_leaves_the_checkpoint_saves_out(corpus, tmp_path, monkeypatch, capsys):
    """A save blocks the host (checksums, the copy to host memory); made to take 1.5 s more here,
    it is reported as the interval's checkpoint_s and kept out of its step time, which would
    otherwise hold 1.5 s per step at step 2 (an interval of one step) and 0.75 s at step 4."""
    cfg = small_config("", "train.log_every=2", "train.checkpoint_every=2", "train.steps=4")
    mesh = build_mesh(cfg.parallel, jax.devices()[:1])
    save = Checkpointer.save
    monkeypatch.setattr(Checkpointer, "save", lambda self, step, state: (time.sleep(1.5), save(self, step, state)))
    checkpoints = Checkpointer(tmp_path / "checkpoints", cfg)
    records = {r["step"]: r for r in train(build(cfg, mesh, corpus=corpus), tmp_path, checkpoints)}
    checkpoints.close()
    assert sorted(records) == [2, 4] and (tmp_path / "checkpoints" / "4").is_dir()
    for r in records.values():
        assert r["checkpoint_s"] >= 1.5 and r["step_time_s"] < 0.5, r
        assert r["tokens_per_s"] == pytest.approx(cfg.train.global_batch_size * cfg.train.seq_len / r["step_time_s"])
    out = capsys.readouterr().out
    assert all(f"| ckpt {r['checkpoint_s']:.1f} s |" in out for r in records.values()), out
