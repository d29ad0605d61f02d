"""training/data.py: token sources, their errors, and deterministic sharded batches.

Also training/profiling.parse_window (the --profile-steps window).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from configs.base import ConfigError, DataConfig
from sharding.mesh import build_mesh, parse_mesh
from sharding.rules import data_sharding
from training.data import SYNTHETIC_TOKENS, Batches, held_out, held_out_files, load_tokens, stdlib_files
from training.profiling import parse_window


# ---------------------------------------------------------------- sources


@pytest.fixture(scope="module")
def stdlib_list() -> list[Path]:
    return stdlib_files()


def test_stdlib_files(stdlib_list):
    assert len(stdlib_list) > 100
    assert all(f.suffix == ".py" for f in stdlib_list)
    assert all("site-packages" not in f.parts for f in stdlib_list)
    assert all("__pycache__" not in f.parts for f in stdlib_list)
    root = Path(sysconfig.get_paths()["stdlib"])
    assert all(f.is_relative_to(root) for f in stdlib_list)
    names = {f.relative_to(root).as_posix() for f in stdlib_list}
    assert {"os.py", "json/__init__.py"} <= names
    assert stdlib_list == stdlib_files()  # fixed order


def test_load_stdlib(stdlib_list):
    corpus = load_tokens(DataConfig(source="stdlib"), 256)
    tokens = corpus.train
    assert tokens.dtype == corpus.eval.dtype == np.uint8
    assert tokens.ndim == 1
    assert tokens.size > 1_000_000
    held = stdlib_list[99::100]  # every 100th file is held out, whole
    assert corpus.eval.size == sum(f.stat().st_size for f in held) > 0
    assert tokens.size + corpus.eval.size == sum(f.stat().st_size for f in stdlib_list)
    head = stdlib_list[0].read_bytes()
    assert tokens[: len(head)].tobytes() == head
    assert corpus.eval[: held[0].stat().st_size].tobytes() == held[0].read_bytes()


def test_load_text_file(tmp_path):
    text = "def f(x):\n    return x + 1\n# é ü\n".encode()
    path = tmp_path / "corpus.txt"
    path.write_bytes(text)
    corpus = load_tokens(DataConfig(source="text", path=str(path)), 256)
    tokens = corpus.train
    assert tokens.dtype == np.uint8
    assert tokens.tobytes() == text  # one file: its last len // 100 bytes (0 here) are held out
    assert tokens.tolist() == list(text)
    assert corpus.eval.size == 0


def test_load_text_directory(tmp_path):
    contents = {
        "b.txt": b"second file\n",
        "a.txt": b"first file\n",
        "sub/c.py": b"third = 3\n",
        "sub/deeper/d.md": b"# fourth\n",
    }
    for name, data in contents.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    corpus = load_tokens(DataConfig(source="text", path=str(tmp_path)), 300)
    expected = b"first file\n" + b"second file\n" + b"third = 3\n"
    assert corpus.train.tobytes() == expected
    assert corpus.eval.tobytes() == b"# fourth\n"  # fewer than 100 files: the last one is held out


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_load_token_file(tmp_path, dtype):
    vocab = 70_000 if dtype == "uint32" else 50_000
    ids = np.arange(0, vocab, 37, dtype=dtype)[::-1].copy()
    path = tmp_path / f"tokens_{dtype}.bin"
    ids.tofile(path)
    corpus = load_tokens(DataConfig(source="tokens", path=str(path), token_dtype=dtype), vocab)
    for part in (corpus.train, corpus.eval):
        assert isinstance(part, np.memmap)
        assert part.dtype == np.dtype(dtype)
    cut = ids.size - ids.size // 100  # the last 1% is held out
    np.testing.assert_array_equal(np.asarray(corpus.train), ids[:cut])
    np.testing.assert_array_equal(np.asarray(corpus.eval), ids[cut:])
    if dtype == "uint32":
        assert int(corpus.train.max()) > 65535  # ids that need 32 bits survive


def test_load_synthetic():
    a = load_tokens(DataConfig(source="synthetic", seed=7), 1000)
    b = load_tokens(DataConfig(source="synthetic", seed=7), 1000)
    c = load_tokens(DataConfig(source="synthetic", seed=8), 1000)
    assert a.train.shape == (SYNTHETIC_TOKENS,)
    assert a.eval.shape == (SYNTHETIC_TOKENS // 100,)
    assert int(a.train.max()) < 1000 and int(a.train.min()) >= 0
    assert int(a.train.max()) == 999  # the whole vocabulary is used
    np.testing.assert_array_equal(a.train, b.train)
    np.testing.assert_array_equal(a.eval, b.eval)
    assert not np.array_equal(a.train[:1000], c.train[:1000])
    assert not np.array_equal(a.train[: a.eval.size], a.eval)  # a stream of its own


def test_synthetic_allows_small_vocab():
    tokens = load_tokens(DataConfig(source="synthetic"), 16)
    assert int(tokens.train.max()) == int(tokens.eval.max()) == 15


# ---------------------------------------------------------------- source errors


def test_missing_path():
    with pytest.raises(ConfigError) as err:
        load_tokens(DataConfig(source="text", path=""), 256)
    assert "data.path" in str(err.value)
    with pytest.raises(ConfigError):
        load_tokens(DataConfig(source="tokens", path=""), 256)


@pytest.mark.parametrize("source", ["text", "tokens"])
def test_nonexistent_path(tmp_path, source):
    missing = tmp_path / "nope.bin"
    with pytest.raises(ConfigError) as err:
        load_tokens(DataConfig(source=source, path=str(missing)), 256)
    assert "nope.bin" in str(err.value)


@pytest.mark.parametrize("source, name, message", [("text", "empty.txt", "no bytes"), ("tokens", "empty.bin", "empty")])
def test_empty_file(tmp_path, source, name, message):
    path = tmp_path / name
    path.write_bytes(b"")
    with pytest.raises(ConfigError) as err:
        load_tokens(DataConfig(source=source, path=str(path)), 256)
    assert message in str(err.value)


def test_empty_text_dir(tmp_path):
    (tmp_path / "sub").mkdir()  # directories only, no files
    with pytest.raises(ConfigError):
        load_tokens(DataConfig(source="text", path=str(tmp_path)), 256)
    (tmp_path / "sub" / "e.txt").write_bytes(b"")  # a file, but empty
    with pytest.raises(ConfigError):
        load_tokens(DataConfig(source="text", path=str(tmp_path)), 256)


def test_token_path_that_is_a_directory_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"^--set data\.path=\S+ is a directory: data\.source=tokens reads one file"):
        load_tokens(DataConfig(source="tokens", path=str(tmp_path)), 256)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_id_out_of_vocab(tmp_path, dtype):
    path = tmp_path / "t.bin"
    np.array([1, 2, 300, 4], dtype=dtype).tofile(path)
    with pytest.raises(ConfigError) as err:
        load_tokens(DataConfig(source="tokens", path=str(path), token_dtype=dtype), 300)
    assert "300" in str(err.value)
    # One more id in the vocabulary and it loads.
    assert load_tokens(DataConfig(source="tokens", path=str(path), token_dtype=dtype), 301).train.tolist() == [1, 2, 300, 4]


def test_token_file_size_not_multiple_of_dtype(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"abc")  # 3 bytes: not whole uint16 ids (e.g. the wrong token_dtype)
    with pytest.raises(ConfigError) as err:
        load_tokens(DataConfig(source="tokens", path=str(path), token_dtype="uint16"), 70_000)
    assert "odd.bin" in str(err.value)


@pytest.mark.parametrize("source", ["stdlib", "text"])
def test_byte_level_needs_256(tmp_path, source):
    path = tmp_path / "x.txt"
    path.write_bytes(b"abc")
    with pytest.raises(ConfigError) as err:
        load_tokens(DataConfig(source=source, path=str(path)), 255)
    assert "256" in str(err.value)


def test_unknown_source():
    with pytest.raises(ConfigError) as err:
        load_tokens(DataConfig(source="webtext", path="/tmp"), 256)
    assert "webtext" in str(err.value)


def test_bad_token_dtype(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(10, dtype=np.uint16).tofile(path)
    with pytest.raises(ConfigError) as err:
        load_tokens(DataConfig(source="tokens", path=str(path), token_dtype="int8"), 256)
    assert "int8" in str(err.value)


# ---------------------------------------------------------------- Batches


K, B, L = 2, 4, 16


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() == 8, "tests need XLA_FLAGS=--xla_force_host_platform_device_count=8"
    return build_mesh(parse_mesh("dp=2,fsdp=2,tp=2"))


@pytest.fixture(scope="module")
def sharding(mesh):
    return data_sharding(mesh, (K, B, L))


@pytest.fixture(scope="module")
def corpus() -> np.ndarray:
    # Distinct values at every position (mod 2**31) so a window identifies its offset.
    return np.arange(10_000, dtype=np.uint32) * 3 + 5


def test_data_sharding_spec(sharding):
    assert sharding.spec == P(None, ("data", "fsdp"), None)


def test_batch_same_step_twice_and_fresh(corpus, sharding):
    a = Batches(corpus, 0, K, B, L, sharding)
    first = a.host_batch(3)
    again = a.host_batch(3)
    fresh = Batches(corpus, 0, K, B, L, sharding).host_batch(3)  # a resumed run
    for name in ("inputs", "targets"):
        np.testing.assert_array_equal(first[name], again[name])
        np.testing.assert_array_equal(first[name], fresh[name])


def test_batch_steps_and_seeds_differ(corpus, sharding):
    a = Batches(corpus, 0, K, B, L, sharding)
    s3, s4 = a.host_batch(3)["inputs"], a.host_batch(4)["inputs"]
    assert not np.array_equal(s3, s4)
    other_seed = Batches(corpus, 1, K, B, L, sharding).host_batch(3)["inputs"]
    assert not np.array_equal(s3, other_seed)
    # Microbatches within a step differ too.
    assert not np.array_equal(s3[0], s3[1])


def test_batch_windows_come_from_corpus(corpus, sharding):
    batch = Batches(corpus, 0, K, B, L, sharding).host_batch(5)
    inputs, targets = batch["inputs"], batch["targets"]
    assert inputs.shape == targets.shape == (K, B, L)  # one process holds every row
    assert inputs.dtype == targets.dtype == np.int32
    np.testing.assert_array_equal(inputs[..., 1:], targets[..., :-1])
    for seq_in, seq_tg in zip(inputs.reshape(-1, L), targets.reshape(-1, L)):
        start = (int(seq_in[0]) - 5) // 3
        assert 0 <= start and start + L < corpus.size
        np.testing.assert_array_equal(seq_in, corpus[start : start + L])
        np.testing.assert_array_equal(seq_tg, corpus[start + 1 : start + L + 1])


def test_batch_global_array(corpus, sharding, mesh):
    batches = Batches(corpus, 0, K, B, L, sharding)
    out = batches(2)
    host = batches.host_batch(2)
    assert set(out) == {"inputs", "targets"}
    for name, arr in out.items():
        assert isinstance(arr, jax.Array)
        assert arr.shape == (K, B, L)
        assert arr.dtype == np.int32
        assert arr.sharding.spec == P(None, ("data", "fsdp"), None)
        assert arr.sharding.mesh.shape == mesh.shape
        np.testing.assert_array_equal(np.asarray(arr), host[name])
        # Each device holds one row of b (b=4 over data*fsdp=4), replicated over tensor.
        shards = arr.addressable_shards
        assert len(shards) == 8
        assert {s.data.shape for s in shards} == {(K, 1, L)}
    np.testing.assert_array_equal(np.asarray(out["inputs"])[..., 1:], np.asarray(out["targets"])[..., :-1])


def test_batch_exact_minimum_corpus(sharding):
    tokens = np.arange(L + 1, dtype=np.uint16)
    batch = Batches(tokens, 0, K, B, L, sharding).host_batch(0)
    # Only one window fits: every sequence starts at offset 0.
    np.testing.assert_array_equal(batch["inputs"], np.broadcast_to(np.arange(L), (K, B, L)))
    np.testing.assert_array_equal(batch["targets"], np.broadcast_to(np.arange(1, L + 1), (K, B, L)))


@pytest.mark.parametrize("size", [0, 5, L - 1, L])
def test_batch_corpus_too_short(sharding, size):
    with pytest.raises(ConfigError) as err:
        Batches(np.arange(size, dtype=np.uint8), 0, K, B, L, sharding)
    assert str(L) in str(err.value)


# ---------------------------------------------------------------- the held-out split


@pytest.mark.parametrize("n, held", [(2, [1]), (4, [3]), (99, [98]), (100, [99]), (250, [99, 199])])
def test_held_out_files(n, held):
    files = [Path(f"{i:03d}.py") for i in range(n)]
    train, evals = held_out_files(files)
    assert evals == [files[i] for i in held]
    assert sorted(train + evals) == files and not set(train) & set(evals)


def test_byte_split_keeps_whole_files_apart(tmp_path, sharding):
    """150 files, file j all bytes j: file 99 is held out whole; no training window ever reads
    a byte of it, and every evaluation window reads nothing else."""
    for j in range(150):
        (tmp_path / f"{j:03d}.txt").write_bytes(bytes([j]) * 300)
    corpus = load_tokens(DataConfig(source="text", path=str(tmp_path)), 256)
    assert corpus.eval.tobytes() == bytes([99]) * 300 and 99 not in corpus.train
    train = Batches(corpus.train, 0, K, B, L, sharding)
    seen = np.concatenate([train.host_batch(s)["inputs"].ravel() for s in range(200)])
    assert 99 not in seen and len(np.unique(seen)) == 149  # every training file is read
    evals = held_out(corpus.eval, K, B, L, sharding)
    assert all(set(np.unique(evals.host_batch(i)["targets"])) == {99} for i in range(4))


def test_token_split_on_offsets(tmp_path, sharding):
    """Token ids equal to their offsets: training windows lie before the cut, evaluation
    windows after it."""
    path = tmp_path / "t.bin"
    np.arange(20_000, dtype=np.uint32).tofile(path)
    corpus = load_tokens(DataConfig(source="tokens", path=str(path), token_dtype="uint32"), 20_000)
    cut = 20_000 - 200
    train = Batches(corpus.train, 0, K, B, L, sharding)
    for s in range(100):
        batch = train.host_batch(s)
        assert batch["targets"].max() < cut and batch["inputs"].min() >= 0
    evals = held_out(corpus.eval, K, B, L, sharding)
    assert min(evals.host_batch(i)["inputs"].min() for i in range(4)) >= cut


def test_held_out_too_short(sharding):
    with pytest.raises(ConfigError) as err:
        held_out(np.arange(L, dtype=np.uint8), K, B, L, sharding)
    assert "held-out part of the corpus has 16 tokens" in str(err.value) and "train.eval_every=0" in str(err.value)


# ---------------------------------------------------------------- profiling.parse_window


@pytest.mark.parametrize("text, window", [("5:8", (5, 8)), ("0:1", (0, 1)), ("10:200", (10, 200))])
def test_parse_window(text, window):
    assert parse_window(text) == window


def test_parse_window_empty():
    assert parse_window("") is None


@pytest.mark.parametrize("text", ["5", "8:5", "5:5", "a:b", "-1:3", ":8", "5:", "5:8:9", "5-8"])
def test_parse_window_bad(text):
    with pytest.raises(ConfigError) as err:
        parse_window(text)
    assert "START:END" in str(err.value)


def test_host_batch_holds_only_this_process_rows(sharding):
    """With several processes each reads only its rows; simulate a process holding rows 1 and 3."""
    tokens = np.arange(10_000, dtype=np.uint16)
    full = Batches(tokens, 7, K, B, L, sharding)
    part = Batches(tokens, 7, K, B, L, sharding)
    part.rows = np.array([1, 3])
    for name in ("inputs", "targets"):
        np.testing.assert_array_equal(part.host_batch(5)[name], full.host_batch(5)[name][:, [1, 3]])
